"""`python -m engine train-draft` at toy scale on a CPU: data from the target's own greedy answers, a few training
steps, a checkpoint that resumes, a draft in the public DFlash format that the loader reads and that decodes
losslessly, and the held-out acceptance summary. (The committed default draft is trained on a GPU: README.)"""
from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest
import torch

import engine
from engine.corpus import heldout_prompts, training_prompts
from engine.exactness import compare_tokens
from engine.train_draft import TrainSettings, heldout_acceptance, save_dflash, train

ROOT = Path(__file__).resolve().parents[1]


def test_training_prompts_are_distinct_and_never_held_out():
    prompts = training_prompts(3000, seed=1)
    assert len(prompts) == 3000 == len(set(prompts))
    assert not set(prompts) & set(heldout_prompts().values())
    kinds = ("Write a", "JSON", "step by step", "Explain")
    assert all(any(k in p for p in prompts) for k in kinds)
    assert training_prompts(50, seed=1) == prompts[:50]  # seeded


@pytest.mark.slow
def test_train_resume_load_and_decode(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    settings = TrainSettings(out=str(tmp_path / "run"), layers=1, block_size=4, prompts=12, new_tokens=12,
                             gen_batch=6, steps=4, batch=3, anchors=3, warmup=1, save_every=2, eval_tokens=12)
    logs = []
    draft_dir = train(target, settings, torch.device("cpu"), log=logs.append)
    assert any(line.startswith("data: ") for line in logs)
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] and config["num_target_layers"] == 3
    first = (draft_dir / "model.safetensors").read_bytes()

    with pytest.raises(engine.EngineError, match="pass --resume"):
        train(target, settings, torch.device("cpu"), log=logs.append)
    settings.steps = 6
    train(target, settings, torch.device("cpu"), resume=True, log=logs.append)
    assert "resuming at step 4" in logs and any(line.endswith("data.pt") for line in logs)  # data reused
    assert (draft_dir / "model.safetensors").read_bytes() != first  # two more steps changed the weights

    drafter = engine.load_drafter(str(draft_dir), target)
    ids = [5, 9, 14, 3, 77, 120]
    ref = engine.Decoder(target.model).generate(ids, 20, record_margins=True)
    for method in ("dflash", "ddtree"):
        out = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, 6)).generate(ids, 20)
        assert compare_tokens(ref.tokens, ref.margins, out.tokens, 1e-4).ok
    # the same draft in shards (HF-style index) loads to the same proposals
    from engine.loading import load_dflash_draft

    sharded = tmp_path / "sharded"
    save_dflash(load_dflash_draft(draft_dir, target), target, sharded, dtype=torch.float32, max_shard_bytes=20_000)
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    again = engine.load_drafter(str(sharded), target)
    out = engine.Decoder(target.model, again, engine.DecodeSettings("ddtree", 6)).generate(ids, 20)
    assert compare_tokens(ref.tokens, ref.margins, out.tokens, 1e-4).ok
    taus = heldout_acceptance(target, draft_dir, 12)
    assert set(taus) == {"dflash", "ddtree-15", "ddtree-32"} and all(t >= 1.0 for t in taus.values())


def test_train_draft_rejects_bad_settings(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engine", "train-draft", "--out", str(tmp_path / "x"), "--steps",
                           "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--steps must be >= 1" in proc.stderr
    assert not (tmp_path / "x").exists()
