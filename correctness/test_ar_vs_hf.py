"""The engine's greedy AR equals transformers' greedy `generate`, token for token (exactness rule)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import engine
from engine.exactness import compare_tokens, tolerance_for

from .checkpoints import TINY, hf_greedy


def check_against_hf(target, hf_model, prompt, max_new_tokens, stop):
    ours = engine.Decoder(target.model).generate(prompt, max_new_tokens, stop)
    ref, margins = hf_greedy(hf_model, prompt, max_new_tokens, list(stop) or None)
    verdict = compare_tokens(ref, margins, ours.tokens, tolerance_for(torch.float32))
    assert verdict.ok, f"engine AR vs HF generate: {verdict.describe()}\nHF:  {ref}\nour: {ours.tokens}"
    return ours, verdict


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_checkpoints_match_hf(tiny_checkpoints, name):
    path, hf_model = tiny_checkpoints[name]
    target = engine.load_target(str(path), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(len(name))
    vocab = target.model.cfg.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 7, 23)]
    prompts.append([1, 2, 2, 5, 2, 9])  # bos and eos ids inside the prompt must not stop anything
    identical = 0
    for prompt in prompts:
        ours, verdict = check_against_hf(target, hf_model, prompt, 40, ())
        assert len(ours.tokens) == 40
        identical += verdict.identical
    assert identical >= len(prompts) - 1, "near-ties in float32 should be rare: choose other seeds"
    assert target.model.norms_folded == ("bias" not in name), "the decoder folds the norms of every unbiased model"


def test_tiny_checkpoint_stops_like_hf(tiny_checkpoints):
    """With a stop token that greedy decoding reaches, both stop right after emitting it."""
    path, hf_model = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    prompt = [5, 17, 33, 8]
    free = engine.Decoder(target.model).generate(prompt, 30)
    stop = free.tokens[12]
    ours, _ = check_against_hf(target, hf_model, prompt, 30, (stop,))
    assert ours.tokens == free.tokens[:free.tokens.index(stop) + 1]


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-mqa-tied"])
def test_partial_rotary_factor_only_where_transformers_reads_it(tiny_checkpoints, tmp_path, name):
    """transformers' Llama, Mistral, Qwen2 and Qwen3 rotate whole heads even where the config carries a
    partial_rotary_factor (the hybrid family reads it): the engine follows the model type."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / name
    shutil.copytree(tiny_checkpoints[name][0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "partial_rotary_factor": 0.5}))
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = engine.load_target(str(path), "cpu", torch.float32)
    assert target.model.rotary.dim == target.model.cfg.head_dim
    check_against_hf(target, hf_model, [5, 17, 33, 8, 40, 3], 24, ())


def test_a_tied_config_with_its_own_lm_head_decodes_with_that_head(tiny_checkpoints, tmp_path):
    """A config that says tie_word_embeddings over a checkpoint holding its own, different lm_head.weight: transformers
    keeps the two apart and decodes with lm_head; so does the engine."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tied-with-head"
    shutil.copytree(tiny_checkpoints["llama-gqa-untied"][0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = engine.load_target(str(path), "cpu", torch.float32)
    assert target.model.lm_head.weight is not target.model.embed_tokens.weight
    check_against_hf(target, hf_model, [5, 17, 33, 8, 40, 3], 24, ())


@pytest.mark.slow
def test_default_model_matches_hf(default_target, default_hf_dir):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(default_hf_dir, dtype=torch.float32).eval()
    for text in ("Write a Python function that returns the n-th Fibonacci number.", "What is the capital of France?"):
        prompt = default_target.encode(text)
        check_against_hf(default_target, hf_model, prompt, 24, default_target.stop_ids)
