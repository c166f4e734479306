"""The gate catches a real regression: with a known slowdown planted (ENGINE_DISABLE_TRITON=1: the PyTorch
references instead of the Triton kernels, hence no CUDA graphs), the tp1 tok/s floors fail; without it they pass.

    pytest perf/test_gate.py -m gpu       # on a GPU runner whose floors file has the default pair's fib floors

Each side runs `pytest perf -m tp1` on a small selection in a subprocess (this test is not tp1-marked, so it never
runs itself).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.launch import visible_gpus
from engine.results import gpu_telemetry
from engine.workloads import GATED_LENGTHS
from perf.floors import floor_key

# whole parameter ids: a bare "ar" would match every test (the parametrize mark's name contains it)
SELECTION = "throughput and default and not synthetic and (fib-ar] or fib-ddtree-15])"


def _suite(tmp_path, pytestconfig, planted: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_DISABLE_TRITON"}
    if planted:
        env["ENGINE_DISABLE_TRITON"] = "1"
    cmd = [sys.executable, "-m", "pytest", "perf", "-m", "tp1", "-q", "-p", "no:cacheprovider", "--require-floors",
           "-k", SELECTION, "--floors", pytestconfig.getoption("floors"),
           "--perf-results", str(tmp_path / f"gate-{'planted' if planted else 'clean'}.json")]
    if planted:
        cmd.append("-x")  # the first floor that fails is the answer: the eager references are slow
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.gpu
def test_planted_slowdown_fails_the_tp1_floors(tmp_path, pytestconfig, floors):
    if not visible_gpus():
        pytest.skip("tok/s floors exist on GPUs only: the gate check needs a GPU")
    device = gpu_telemetry(0)["name"]
    needed = [floor_key(device, 1, "default", "fib", length, m) for length in GATED_LENGTHS for m in ("ar", "ddtree-15")]
    missing = [k for k in needed if (floors.get(k) or {}).get("tok_s") is None]
    if missing:
        pytest.skip(f"no tok/s floors for {missing} in {pytestconfig.getoption('floors')}")
    clean = _suite(tmp_path, pytestconfig, planted=False)
    assert clean.returncode == 0, f"the floors fail without the planted slowdown:\n{clean.stdout[-3000:]}"
    planted = _suite(tmp_path, pytestconfig, planted=True)
    assert planted.returncode == 1 and "below floor" in planted.stdout, \
        f"the planted slowdown did not fail the floors:\n{planted.stdout[-3000:]}"
