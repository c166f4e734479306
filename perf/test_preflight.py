"""The runner preflight (perf/preflight.py), on a CPU by simulation: where NVML sees GPUs but CUDA cannot initialize,
pytest stops before any test with a diagnosis; on a working GPU the header reports clocks, throttle reasons, other
processes and copy bandwidth. Whole runs are `pytest` subprocesses with `-p perf.preflight_fakes`, which replaces
the NVML and CUDA probes; the messages are checked from fake readings."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.launch import visible_gpus
from perf import preflight, preflight_fakes
from perf.preflight import Nvml

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
H200 = dict(index=0, name="NVIDIA H200", max_mhz=1980, base_mhz=1755, sm_mhz=1980, reasons=0, processes=[],
            copy_tbps=4.3)


def run_pytest(*args, fake: str | None = None):
    """`pytest ARGS` in a fresh process; returns (exit code, output, seconds)."""
    # Not an xdist worker of this run (the preflight leaves workers alone), no inherited options.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    plugin = []
    if fake:
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["PREFLIGHT_FAKE"] = fake
        plugin = ["-p", "perf.preflight_fakes"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *plugin, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.parametrize("args", [("perf", "-m", "tp1", "-k", "hybrid-tiny", "-n", "2"),
                                  ("correctness/test_exactness.py",)], ids=["perf-tp1-xdist", "correctness"])
def test_broken_cuda_stops_the_run_with_the_diagnosis(args):
    code, out, seconds = run_pytest(*args, fake="broken")
    assert code == pytest.ExitCode.USAGE_ERROR, out
    assert seconds < 30, f"took {seconds:.1f} s"
    for item in (preflight_fakes.CUDA_999, "/dev/nvidiactl: exists (char 195:255), opens read/write",
                 "/dev/nvidia0: exists (char 195:0), does not open read/write (Permission denied)",
                 "/dev/nvidia-uvm: missing",
                 f"NVML driver version: {preflight_fakes.DRIVER}", "CUDA_VISIBLE_DEVICES: unset",
                 f"built with CUDA runtime {torch.version.cuda or 'none'}"):
        assert item in out, f"{item!r} missing from:\n{out}"
    assert not re.search(r"\b(collected|passed|failed|skipped)\b", out), out  # nothing was collected, let alone run


def test_a_selection_without_gpu_tests_is_not_checked():
    code, out, _ = run_pytest("correctness/test_exactness.py", "-m", "not gpu", "--co", fake="broken")
    assert code == 0, out
    assert "selects no GPU test; CUDA not checked" in out


def test_header_of_a_throttled_gpu():
    code, out, _ = run_pytest("perf/test_floors.py", "--co", fake="throttled")
    assert code == 0, out
    header = [line for line in out.splitlines() if line.startswith("preflight")]
    assert header[0].startswith("preflight: 1 x NVIDIA H200, driver 550.54.15"), header
    for item in ("SM clock 1305 MHz under load, below base 1755 MHz", "throttle reasons: software power cap",
                 "other processes: pid 4242 python3 (20.0 GiB)", "copy 2.05 TB/s, far under the usual 3.8-4.4"):
        assert item in header[1], header


@pytest.mark.skipif(bool(visible_gpus()), reason="checks the machine without GPUs")
def test_real_preflight_is_quiet_without_gpus():
    code, out, _ = run_pytest("perf/test_floors.py", "--co")
    assert code == 0, out
    header = [line for line in out.splitlines() if "preflight" in line]
    assert len(header) == 1 and header[0].startswith("preflight: no GPU"), header


@pytest.mark.skipif(bool(visible_gpus()), reason="checks the machine without GPUs")
def test_real_cuda_probe_reports_instead_of_crashing():
    probe = preflight.run_probe([0])  # the child process, on a machine without CUDA
    assert probe["cuda_error"] and probe["gpus"] == [], probe


def test_check_in_process(monkeypatch):
    """check() with the probes replaced: broken CUDA raises the usage error, no GPU and a CPU selection never probe."""
    def no_probe(indices):
        raise AssertionError("probed CUDA")

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(preflight, "file_status", lambda path: "missing")  # no /dev/nvidiactl: a CPU machine
    monkeypatch.setattr(preflight, "run_probe", no_probe)
    monkeypatch.setattr(preflight, "read_nvml", lambda: Nvml(error="NVMLError_LibraryNotFound"))
    assert preflight.check("", {"gpu"}) == ["preflight: no GPU (NVMLError_LibraryNotFound); CPU run"]
    monkeypatch.setattr(preflight, "read_nvml", lambda: Nvml([0], "550.54.15"))
    assert "selects no GPU test" in preflight.check("cpu", {"gpu", "tp1"})[0]
    monkeypatch.setattr(preflight, "run_probe", lambda indices: dict(cuda_error="cuInit: 999"))
    with pytest.raises(pytest.UsageError, match="cuInit: 999"):
        preflight.check("", {"gpu"})
    monkeypatch.setattr(preflight, "run_probe", lambda indices: dict(pid=7, torch="t", torch_cuda="12.4", gpus=[H200]))
    assert len(preflight.check("", {"gpu"})) == 1  # a healthy GPU: the summary line alone


def test_diagnosis_names_every_item():
    text = preflight.diagnosis(Nvml([0, 1], "550.54.15"), "cuInit: 999",
                               {"/dev/nvidiactl": "exists, opens read/write", "/dev/nvidia-uvm": "missing"},
                               "2.5.1+cu124", "12.4", "0,1")
    for item in ("NVML sees 2 GPU(s)", "CUDA error: cuInit: 999", "/dev/nvidiactl: exists, opens read/write",
                 "/dev/nvidia-uvm: missing", "NVML driver version: 550.54.15", "built with CUDA runtime 12.4",
                 "CUDA_VISIBLE_DEVICES: '0,1'"):
        assert item in text
    assert "a CPU build of torch" in preflight.diagnosis(Nvml([0]), "e", {}, "2.5.1+cpu", None, None)


def test_device_files(tmp_path, monkeypatch):
    (tmp_path / "dev").write_text("")
    assert preflight.file_status(str(tmp_path / "dev")) == "exists (not a device), opens read/write"
    assert preflight.file_status("/dev/null") == "exists (char 1:3), opens read/write"
    assert preflight.file_status(str(tmp_path / "absent")) == "missing"
    assert preflight.file_status(str(tmp_path)) == "exists (a directory)"
    monkeypatch.setattr(preflight, "list_device_files", lambda: ["/dev/nvidia-modeset"])
    monkeypatch.setattr(preflight, "file_status", lambda path: "missing")
    assert list(preflight.device_files([2, 3])) == ["/dev/nvidia-modeset", "/dev/nvidia-uvm", "/dev/nvidia2",
                                                    "/dev/nvidia3", "/dev/nvidiactl"]


@pytest.mark.parametrize("nvml,visible_env,node,expected", [
    (Nvml([0]), None, True, True),
    (Nvml([0]), "", True, False),  # CUDA_VISIBLE_DEVICES= : a CPU run on purpose
    (Nvml(error="NVMLError_LibraryNotFound"), None, False, False),  # a CPU machine
    (Nvml(error="NVMLError_LibraryNotFound"), None, True, True),  # the driver's node without NVML: half mounted
    (Nvml([], "550.54.15"), None, True, False),
])
def test_gpus_expected(nvml, visible_env, node, expected):
    assert preflight.gpus_expected(nvml, visible_env, node) is expected


@pytest.mark.parametrize("markexpr,markers,expected", [
    ("", {"gpu"}, True), ("gpu", {"gpu"}, True), ("gpu and slow", {"gpu"}, True), ("not gpu", {"gpu"}, False),
    ("cpu", {"gpu", "tp1"}, False), ("tp1", {"gpu", "tp1"}, True), ("not gpu", {"gpu", "tp1"}, True),
    ("slow and cpu", {"gpu"}, False),
])
def test_selects_gpu_tests(markexpr, markers, expected):
    assert preflight.selects_gpu_tests(markexpr, markers) is expected


def test_report_lines():
    healthy = preflight.report_lines(dict(driver="580.159.04", torch="2.11.0+cu130", torch_cuda="13.0",
                                          gpus=[H200, dict(H200, index=1, copy_tbps=4.25)]), 2)
    assert healthy == ["preflight: 2 x NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130 (CUDA 13.0); under load: "
                       "SM 1980 MHz (max 1980, base 1755), copy 4.25-4.30 TB/s (usual 3.8-4.4)"]
    ours = dict(H200, processes=[dict(pid=11, name="python", used_bytes=None)], reasons=0x1 | 0x20)
    lines = preflight.report_lines(dict(gpus=[ours], cuda_count=0), 2, own_pids={11})
    assert lines[1] == "preflight WARNING: CUDA sees 0 of the 2 GPUs NVML lists"
    assert lines[2] == "preflight WARNING GPU0: throttle reasons: software thermal slowdown"  # idle is no reason
    other = dict(H200, processes=[dict(pid=12, name="python", used_bytes=None)], copy_error="OutOfMemoryError: x")
    assert preflight.report_lines(dict(gpus=[other]), 1)[1] == (
        "preflight WARNING GPU0: other processes: pid 12 python; copy check failed: OutOfMemoryError: x")
    unknown = dict(H200, name="NVIDIA A40", copy_tbps=0.1, base_mhz=None, sm_mhz=300)
    assert len(preflight.report_lines(dict(gpus=[unknown]), 1)) == 1  # no usual rate, no base clock: no flag


def test_copy_flag():
    assert preflight.copy_flag("NVIDIA H200", 3.9) is None
    assert preflight.copy_flag("NVIDIA H200", 3.1) is None  # within noise and light neighbours
    assert "far under the usual 3.8-4.4 TB/s" in preflight.copy_flag("NVIDIA H200", 2.5)
    assert preflight.copy_flag("NVIDIA H100 80GB HBM3", 1.0) is not None
    assert preflight.copy_flag("Some GPU", 0.01) is None
