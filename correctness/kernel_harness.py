"""Shared by the kernel tests: running Triton kernels under the interpreter in a subprocess (CPU), and
micro-timing them on a GPU (printed with pytest -s, never asserted against floors)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, check: str) -> subprocess.CompletedProcess:
    """Run `python -m module check` with TRITON_INTERPRET=1, which must be set before triton is imported: a
    fresh process is the only reliable way when other tests (or xdist workers) imported triton already."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore",
               CUDA_VISIBLE_DEVICES="")
    env.pop("ENGINE_DISABLE_TRITON", None)
    return subprocess.run([sys.executable, "-m", module, check], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def assert_interpreted_ok(module: str, check: str) -> None:
    proc = run_interpreted(module, check)
    assert proc.returncode == 0 and "OK" in proc.stdout, \
        f"interpreter check {check} failed\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"


def hard_logit_cases(gen: torch.Generator, rows: int, vocab: int) -> list[tuple[str, torch.Tensor, int]]:
    """Logits that trip row-wise kernels over a vocabulary, as (name, logits [rows, vocab], finite columns):
    ties (the lowest index must win), a masked tail of -inf (whole blocks of it when vocab is large), and rows
    with a stride != vocab."""
    ties = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    masked = torch.randn(rows, vocab, generator=gen)
    masked[:, vocab // 3:] = float("-inf")
    strided = torch.randn(rows, vocab + 7, generator=gen)[:, 3:vocab + 3]
    return [("ties", ties, vocab), ("-inf tail", masked, vocab // 3), ("strided", strided, vocab)]


def graph_time_us(fn, reps: int = 50, iters: int = 20) -> float:
    """Microseconds per call of fn: `reps` calls captured in one CUDA graph (after a warm-up on a side stream),
    the graph replayed `iters` times; launch gaps inside the graph included."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * reps) * 1e6


def run_checks_main(checks: dict) -> None:
    """`python -m correctness.test_kernel_X [CHECK ...]` under TRITON_INTERPRET=1: run the named checks, print OK."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1")
    for check in sys.argv[1:] or sorted(checks):
        t0 = time.perf_counter()
        print(f"{check}: {checks[check]()} in {time.perf_counter() - t0:.1f}s")
    print("OK")
