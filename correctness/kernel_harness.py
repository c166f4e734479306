"""Shared by the kernel tests: running Triton kernels under the interpreter in a subprocess (CPU), with the programs
in reverse order where a test asks, and logits that trip row-wise kernels. (Kernel times are measured by
python -m perf.kernel_times, not here.)"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def programs_in_reverse():
    """Under TRITON_INTERPRET=1 the programs run one after another in grid order, so a program that writes rows
    another program owns goes unseen whenever the owner runs later and overwrites them. Reversed, the owner runs
    first and the stray write shows (a GPU runs programs in no fixed order)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if not hasattr(builder, "set_grid_idx") or not hasattr(builder, "set_grid_dim"):
        raise RuntimeError("triton's interpreter has no set_grid_idx / set_grid_dim: update programs_in_reverse")
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    dims = [1, 1, 1]

    def reversed_dim(x, y, z):
        dims[:] = [x, y, z]
        set_dim(x, y, z)

    def reversed_idx(x, y, z):
        set_idx(dims[0] - 1 - x, dims[1] - 1 - y, dims[2] - 1 - z)

    builder.set_grid_dim, builder.set_grid_idx = reversed_dim, reversed_idx
    try:
        yield
    finally:
        del builder.set_grid_dim, builder.set_grid_idx  # the class's methods again


def assert_close_ulps(got: torch.Tensor, want: torch.Tensor, context: str, *, fp32_tol: float, atol: float,
                      rtol: float, max_differing: float) -> None:
    """A kernel's output against its reference: float32 within fp32_tol (absolute and relative); a 16-bit type
    elementwise within atol + rtol |want| (a few ulps: one rounding placed on another float32 sum) with at most
    `max_differing` of the elements differing at all (a rounding placed at the wrong point makes many differ)."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{context}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    g, w = got.float().cpu(), want.float().cpu()
    assert not g.isnan().any(), f"{context}: NaN in the output (an element was not written)"
    if got.dtype == torch.float32:
        torch.testing.assert_close(g, w, atol=fp32_tol, rtol=fp32_tol, msg=lambda m: f"{context}: {m}")
        return
    diff = (g - w).abs()
    bad = diff > atol + rtol * w.abs()
    assert not bad.any(), (f"{context}: {int(bad.sum())} elements beyond the tolerance; max diff "
                           f"{diff.max().item():.4g} at {bad.nonzero()[:4].tolist()}")
    frac = (diff > 0).float().mean().item() if diff.numel() else 0.0
    assert frac <= max_differing, f"{context}: {frac:.2%} of the elements differ (max {diff.max().item():.4g})"


def hard_logit_cases(gen: torch.Generator, rows: int, vocab: int) -> list[tuple[str, torch.Tensor, int]]:
    """Logits that trip row-wise kernels over a vocabulary, as (name, logits [rows, vocab], finite columns):
    ties (the lowest index must win), a masked tail of -inf (whole blocks of it when vocab is large), and rows
    with a stride != vocab."""
    ties = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    masked = torch.randn(rows, vocab, generator=gen)
    masked[:, vocab // 3:] = float("-inf")
    strided = torch.randn(rows, vocab + 7, generator=gen)[:, 3:vocab + 3]
    return [("ties", ties, vocab), ("-inf tail", masked, vocab // 3), ("strided", strided, vocab)]


def interpreter_numpy_fix() -> None:
    """Older Triton interpreters (3.6 among them) turn a scalar into a Python int with int() of its one-element
    array, which numpy >= 2.4 refuses, so every loop bounded by a loaded scalar raised TypeError('only 0-dimensional
    arrays can be converted to Python scalars') (triton-lang/triton#9171, fixed upstream by squeezing the array).
    Each launch re-installs the interpreter's tensor methods, so this wraps the installer to take the element with
    .item() (which still refuses more than one)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    install = getattr(interpreter, "_patch_lang_tensor", None)
    if install is None or getattr(install, "numpy_fix", False):
        return

    def install_fixed(tensor, scope):
        install(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    install_fixed.numpy_fix = True
    interpreter._patch_lang_tensor = install_fixed


def run_checks_main(checks: dict) -> None:
    """`python -m correctness.test_kernel_X [CHECK ...]` under TRITON_INTERPRET=1: run the named checks, print OK."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1")
    interpreter_numpy_fix()
    for check in sys.argv[1:] or sorted(checks):
        t0 = time.perf_counter()
        print(f"{check}: {checks[check]()} in {time.perf_counter() - t0:.1f}s")
    print("OK")
