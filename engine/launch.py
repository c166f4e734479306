"""Running the engine in fresh processes, for the test suites: torchrun with a timeout (so an NCCL or gloo error, a
crash or a hang fails with the processes' last output instead of hanging the suite), and the GPUs this process may
use, counted without creating a CUDA context."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(nproc: int, args: list[str], timeout: float, cpu: bool = False, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc ARGS` (ARGS start with -m MODULE); raises AssertionError with
    the tail of the output on a non-zero exit or a timeout. cpu=True hides the GPUs (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # keep the caller's entries
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore", **(env or {}))
    if cpu:
        full_env["CUDA_VISIBLE_DEVICES"] = ""
    # On a hang, SIGTERM to torchrun, which forwards it to the ranks (each in a session of its own) and waits for
    # them; SIGKILL to its process group if that does not end it.
    with subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.send_signal(signal.SIGTERM)
            try:
                stdout, stderr = popen.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                stdout, stderr = popen.communicate()
            raise AssertionError(f"torchrun x{nproc} {' '.join(args)} hung: no exit after {timeout:.0f} s\n"
                                 f"{(stdout + stderr)[-4000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun x{nproc} {' '.join(args)} failed with exit code {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}")
    return proc


def visible_gpus() -> list[int]:
    """Indices of the GPUs this process may use, counted through NVML (no CUDA context is created)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception:  # no NVIDIA driver, or no NVML
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    return [int(i) for i in visible.split(",") if i.strip().isdecimal() and int(i) < count]
