"""Shared by the kernel tests: running Triton kernels under the interpreter in a subprocess (CPU), and logits that
trip row-wise kernels. (Kernel times are measured by python -m perf.kernel_times, not here.)"""
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


def run_checks_main(checks: dict) -> None:
    """`python -m correctness.test_kernel_X [CHECK ...]` under TRITON_INTERPRET=1: run the named checks, print OK."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1")
    for check in sys.argv[1:] or sorted(checks):
        t0 = time.perf_counter()
        print(f"{check}: {checks[check]()} in {time.perf_counter() - t0:.1f}s")
    print("OK")
