"""Tensor parallelism on CPUs with gloo (engine/parallel.py): sharded logits match width 1 within float32
tolerance, sharded AR equals width-1 AR, and DFlash / DDTree at width 2 (and 4 and 8) equal AR at the same width, with
random drafts and with the oracle drafter (multi-token acceptance, side branches), and a draft sharded like the target
(ENGINE_SHARD_DRAFT) gives the replicated draft's logits. Each run is a fresh torchrun process group in a subprocess
with a timeout (engine/launch.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import engine
from engine.launch import ROOT, run_torchrun
from engine.errors import EngineError
from engine.parallel import _split, check_fits, head_ranges

# GQA split evenly, MQA (the KV head replicated), biases (row-parallel ones added once), 3 KV heads over 2 ranks
# (uneven) with tied embeddings and an odd vocabulary (padded vocabulary shards)
WIDTH2 = ("llama-gqa-untied", "qwen3-mqa-tied", "qwen2-bias", "llama-tied-mha-rope3")
WIDTH4 = ("qwen3-mqa-tied", "qwen2-bias", "qwen3-gqa-untied-sharded")
# width 8: one query head a rank, each of the 2 KV heads replicated on 4 ranks, 15 MLP columns a rank
WIDTH8 = ("qwen3-gqa-untied-sharded",)


def _run_worker(tmp_path, checkpoints, names, nproc):
    out = tmp_path / f"tp{nproc}.json"
    run_torchrun(nproc, ["-m", "correctness.tp_worker", str(out), *(str(checkpoints[n][0]) for n in names)],
                 timeout=600, cpu=True)
    return json.loads(out.read_text())


def _check(results, names):
    for name in names:
        r = next(v for k, v in results["targets"].items() if k.endswith(name))
        assert r["logits_max_abs_diff"] <= 1e-4 * max(1.0, r["logits_scale"]), (name, r["logits_max_abs_diff"])
        assert r["ar_vs_width1_ok"], f"{name}: sharded AR vs width 1: {r['ar_vs_width1']}"
        for method, m in r["methods"].items():
            assert m["ok"], f"{name} {method} at width {results['world']}: {m['verdict']}"
            if "oracle" in method:
                assert m["tau"] > 1.5, f"{name} {method}: the oracle should be accepted several tokens a round"
        # ENGINE_SHARD_DRAFT: a sharded draft computes the replicated draft's logits, its cache holds fewer KV heads
        diff, scale = r["draft_logits_max_abs_diff"], r["draft_logits_scale"]
        assert diff <= 1e-4 * max(1.0, scale), f"{name}: sharded draft logits differ by {diff} (scale {scale})"
        full_heads, rank0_heads = r["draft_cache_kv_heads"]
        assert rank0_heads < full_heads or full_heads < results["world"], (name, r["draft_cache_kv_heads"])


@pytest.mark.slow
def test_width2_matches_width1_and_is_lossless(tiny_checkpoints, tmp_path):
    _check(_run_worker(tmp_path, tiny_checkpoints, WIDTH2, 2), WIDTH2)


@pytest.mark.slow
def test_width4_matches_width1_and_is_lossless(tiny_checkpoints, tmp_path):
    _check(_run_worker(tmp_path, tiny_checkpoints, WIDTH4, 4), WIDTH4)


@pytest.mark.slow
def test_width8_matches_width1_and_is_lossless(tiny_checkpoints, tmp_path):
    """The widest group of the perf suite's markers (tp8), as eight gloo processes (about a minute on two cores)."""
    _check(_run_worker(tmp_path, tiny_checkpoints, WIDTH8, 8), WIDTH8)


@pytest.mark.slow
def test_cli_generate_width2_prints_the_width1_tokens():
    args = ["--method", "ddtree", "--budget", "15", "--max-new-tokens", "24", "--prompt-ids", "1,2,3,4,5,6,7,8,2,9"]
    one = subprocess.run([sys.executable, "-m", "engine", "generate", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_torchrun(2, ["-m", "engine", "generate", "--tp", "2", *args], timeout=300, cpu=True)
    tokens = [line for line in two.stdout.splitlines() if line.startswith("tokens:")]
    assert tokens == [line for line in one.stdout.splitlines() if line.startswith("tokens:")], two.stdout
    assert len(tokens) == 1  # only rank 0 prints


def test_tp_without_torchrun_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--tp", "2", "--max-new-tokens", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WORLD_SIZE": "1"})
    assert proc.returncode == 2
    assert "--tp 2 needs 2 processes" in proc.stderr and "torchrun --nproc_per_node=2" in proc.stderr


@pytest.mark.parametrize("heads,kv_heads,inter,world,message", [
    (6, 2, 100, 4, "does not fit"),      # 2 KV heads replicated over 4 ranks would split groups of 3 query heads
    (3, 3, 80, 4, "does not fit"),       # 3 KV heads over 4 ranks: neither divides the other
    (8, 8, 3, 4, "exceeds the MLP width"),
    (8, 8, 64, 0, "must be >= 1"),
])
def test_widths_that_do_not_fit(heads, kv_heads, inter, world, message):
    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter)
    with pytest.raises(EngineError, match=message):
        check_fits(cfg, world)


def test_shard_draft_switch_and_a_draft_that_does_not_fit(tiny_checkpoints, monkeypatch):
    """ENGINE_SHARD_DRAFT is 0/1/auto (auto: replicate), anything else one error; a draft whose heads do not split
    over the width is one error naming the draft, before any collective runs."""
    from engine.loading import random_draft
    from engine.parallel import TensorParallel, shard_draft, shard_draft_wanted

    for text, want in (("", False), ("auto", False), ("0", False), ("1", True)):
        monkeypatch.setenv("ENGINE_SHARD_DRAFT", text)
        assert shard_draft_wanted() is want
    monkeypatch.setenv("ENGINE_SHARD_DRAFT", "shard")
    with pytest.raises(EngineError, match="ENGINE_SHARD_DRAFT"):
        shard_draft_wanted()
    target = engine.load_target(str(tiny_checkpoints["llama-tied-mha-rope3"][0]), "cpu", torch.float32)
    with pytest.raises(EngineError, match="the draft cannot be sharded.*does not fit"):
        shard_draft(random_draft(target, 1), TensorParallel(rank=0, world=4))  # 3 KV heads over 4 ranks


def test_head_ranges_cover_every_head_once():
    for heads, kv, world in ((9, 3, 2), (32, 8, 8), (12, 4, 8), (6, 1, 2), (14, 7, 4)):
        cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv, intermediate_size=64)
        if kv < world and (world % kv or (heads // kv) % (world // kv)):
            continue
        q = sorted(h for r in range(world) for h in range(*head_ranges(cfg, world, r)[0]))
        assert q == list(range(heads)), (heads, kv, world)
        for r in range(world):
            (q_lo, q_hi), (kv_lo, kv_hi) = head_ranges(cfg, world, r)
            G = heads // kv
            assert kv_lo <= q_lo // G and (q_hi - 1) // G < kv_hi  # the rank holds the KV heads its queries read
    assert [_split(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_a_crash_or_a_hang_under_torchrun_fails_with_the_output(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'about to fail', flush=True)\nsys.exit(3)\n")
    with pytest.raises(AssertionError, match="about to fail"):
        run_torchrun(2, [str(crash)], timeout=120, cpu=True)
    hang = tmp_path / "hang.py"
    hang.write_text("import time\nprint('waiting forever', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(AssertionError, match="hung"):
        run_torchrun(2, [str(hang)], timeout=8, cpu=True)


def test_concurrency_sweep_at_width2_equals_width1(tiny_checkpoints, tmp_path):
    """`bench --concurrency` under torchrun at width 2 (gloo): batched decoding on a sharded target gives every request
    the same tokens and acceptance as at width 1, each checked against its batch-1 AR output."""
    path = str(tiny_checkpoints["qwen3-gqa-untied-sharded"][0])
    args = ["bench", "--device", "cpu", "--target", path, "--draft", "random:1", "--acceptance", "synthetic:0.2",
            "--workloads", "fib,json", "--lengths", "short=8", "--methods", "ar,dflash,ddtree-4",
            "--concurrency", "1,3", "--repeats", "1", "--warmup", "0"]
    from engine.cli import main

    assert main([*args, "--json", str(tmp_path / "w1.json")]) == 0
    run_torchrun(2, ["-m", "engine", *args, "--tp", "2", "--json", str(tmp_path / "w2.json")], timeout=600, cpu=True)
    w1, w2 = (json.loads((tmp_path / f"w{n}.json").read_text())["sweep"] for n in (1, 2))
    assert [(r["concurrency"], r["method"], r["tau"], r["lossless"]) for r in w2] == \
        [(r["concurrency"], r["method"], r["tau"], r["lossless"]) for r in w1]
    assert all(r["lossless"] for r in w2)


def test_exit_rank_flushes_output_and_keeps_the_exit_code():
    """A torchrun rank leaves through engine.parallel.exit_rank (no interpreter finalization, where gloo can abort a
    finished rank): its buffered output still arrives and its exit code is the one given."""
    code = "import sys; from engine.parallel import exit_rank; print('done'); print('warn', file=sys.stderr); exit_rank(3)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == "done\n" and "warn" in proc.stderr
