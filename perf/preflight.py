"""The runner preflight, once when pytest starts (both suites' conftests call install()).

A GPU runner whose CUDA cannot initialize (cuInit error 999 behind a missing device permission in a container, say)
would run the CPU path and pass the tau floors: a broken runner would read as a pass. So where NVML sees GPUs and the
run can select GPU tests, CUDA must initialize, or the run ends as a usage error before any test runs, with a
diagnosis: the CUDA error, the device files and whether they open, the driver and runtime versions,
CUDA_VISIBLE_DEVICES. Where CUDA works, the report header gives the GPUs' state as warnings: the SM clock under load
against the base clock, active throttle reasons, other processes on the GPU, a device-to-device copy bandwidth far
under the GPU's usual one.

CUDA is probed in a child process (`python -m perf.preflight`), so that pytest itself creates no CUDA context (the
perf suite picks each xdist worker's GPU before one exists) and a hung driver costs a timeout, not the run. The
probes (read_nvml, run_probe, file_status, list_device_files) are module functions that a test plugin replaces
(perf/preflight_fakes.py); everything else takes its inputs as arguments.
"""
from __future__ import annotations

import glob
import json
import os
import stat
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "gpu-preflight"
PROBE_TIMEOUT_S = 120  # torch's import from a cold disk and a context on each of 8 GPUs fit; a hung driver does not

# The markers of each suite's tests that run on the GPU where NVML lists one (perf's tp1 measures there too).
GPU_MARKERS = {"perf": ("gpu", "tp1", "tp2", "tp4", "tp8"), "correctness": ("gpu",)}

# Device-to-device copy rate (bytes read plus written per second) of healthy GPUs, by NVML name; others: no flag.
USUAL_COPY_TBPS = {"NVIDIA H200": (3.8, 4.4), "NVIDIA H100 80GB HBM3": (2.9, 3.0)}
FAR_UNDER = 0.8  # flag under this fraction of the usual low end: a busy neighbour or a bad HBM state, not noise
COPY_BYTES, COPIES = 1 << 30, 50

# NVML's clocks event (throttle) reason bits. "GPU idle" (0x1) is left out: it is no slowdown.
THROTTLE_REASONS = {0x2: "applications clocks setting", 0x4: "software power cap", 0x8: "hardware slowdown",
                    0x10: "sync boost", 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                    0x80: "hardware power brake", 0x100: "display clock setting", 0x200: "board limit",
                    0x400: "reliability"}


@dataclass
class Nvml:
    visible: list[int] = field(default_factory=list)  # GPU indices for this process (CUDA_VISIBLE_DEVICES applied)
    driver: str | None = None
    error: str | None = None  # why NVML could not be read (no driver, no library)


# ---- probes (replaced by perf/preflight_fakes.py in tests)

def _pynvml():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the pynvml package's notice of its rename
        import pynvml
    pynvml.nvmlInit()
    return pynvml


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def read_nvml() -> Nvml:
    from engine.launch import visible_gpus  # the suites' own count of GPUs, so both agree

    try:
        driver = _text(_pynvml().nvmlSystemGetDriverVersion())
    except Exception as e:  # no driver, no library
        return Nvml(error=f"{type(e).__name__}: {e}")
    return Nvml(visible_gpus(), driver)


def list_device_files() -> list[str]:
    return glob.glob("/dev/nvidia*")


def file_status(path: str) -> str:
    """Whether a device file exists and opens for read and write, as CUDA needs (NVML can do with less), and its
    device numbers: a container may map something else there (/dev/null is 1:3)."""
    if not os.path.lexists(path):
        return "missing"
    if os.path.isdir(path):
        return "exists (a directory)"
    st = os.stat(path)
    kind = f"char {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISCHR(st.st_mode) else "not a device"
    try:
        os.close(os.open(path, os.O_RDWR))
    except OSError as e:
        return f"exists ({kind}), does not open read/write ({e.strerror or e})"
    return f"exists ({kind}), opens read/write"


def run_probe(indices: list[int]) -> dict:
    """probe() in a child process: its JSON, or a cuda_error saying how the child failed."""
    # PCI order makes CUDA's device k the k-th visible NVML index, as NVML numbers by PCI bus.
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "perf.preflight", ",".join(map(str, indices))]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return dict(cuda_error=f"the CUDA probe (python -m perf.preflight) hung: no answer in {PROBE_TIMEOUT_S} s")
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return dict(cuda_error=f"the CUDA probe (python -m perf.preflight) exited with code {p.returncode}: "
                               f"{p.stderr.strip()[-2000:]}")


# ---- decisions and messages (pure: tested with fake readings)

def gpus_expected(nvml: Nvml, cuda_visible: str | None, driver_node: bool) -> bool:
    """Whether CUDA must work here: NVML lists GPUs for this process, or NVML fails where the NVIDIA driver's
    /dev/nvidiactl exists (a half-mounted container). CUDA_VISIBLE_DEVICES= (empty) asks for a CPU run."""
    if cuda_visible is not None and not cuda_visible.strip():
        return False
    return bool(nvml.visible) or (nvml.error is not None and driver_node)


def selects_gpu_tests(markexpr: str, markers) -> bool:
    """Whether `-m markexpr` can select a test carrying one of markers (alone or with `slow`)."""
    if not markexpr.strip():
        return bool(markers)
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser (private: guarded)

        expr = Expression.compile(markexpr)
    except Exception:
        return True  # cannot tell: check
    return any(expr.evaluate(lambda name, **_: name in marks) for m in markers for marks in ({m}, {m, "slow"}))


def device_files(indices: list[int]) -> dict[str, str]:
    """/dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidiaN of each visible GPU (listed even when missing), and any
    other /dev/nvidia* present, each with its file_status."""
    paths = {"/dev/nvidiactl", "/dev/nvidia-uvm", *(f"/dev/nvidia{i}" for i in indices or [0]), *list_device_files()}
    return {path: file_status(path) for path in sorted(paths)}


def diagnosis(nvml: Nvml, cuda_error: str, files: dict[str, str], torch_version: str, torch_cuda: str | None,
              cuda_visible: str | None) -> str:
    seen = (f"NVML sees {len(nvml.visible)} GPU(s)" if nvml.visible
            else f"NVML fails ({nvml.error}) where the NVIDIA driver's /dev/nvidiactl exists")
    return "\n".join([
        f"GPU preflight: {seen} but CUDA cannot initialize; the tests would take the CPU path and pass as a CPU run.",
        f"  CUDA error: {cuda_error}",
        "  device files:", *(f"    {path}: {status}" for path, status in files.items()),
        f"  NVML driver version: {nvml.driver or 'unknown'}",
        f"  torch {torch_version}, built with CUDA runtime {torch_cuda or 'none (a CPU build of torch)'}",
        f"  CUDA_VISIBLE_DEVICES: {'unset' if cuda_visible is None else repr(cuda_visible)}",
        "  Fix the runner (the device files and their permissions in the container, a driver that supports the "
        "runtime), or set CUDA_VISIBLE_DEVICES= to run on the CPU on purpose."])


def throttle_names(reasons: int | None) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if (reasons or 0) & bit]


def copy_flag(name: str, tbps: float | None) -> str | None:
    usual = USUAL_COPY_TBPS.get(name)
    if usual is None or tbps is None or tbps >= FAR_UNDER * usual[0]:
        return None
    return f"copy {tbps:.2f} TB/s, far under the usual {usual[0]}-{usual[1]} TB/s of an {name}"


def gpu_warnings(gpu: dict, own_pids) -> list[str]:
    out = []
    sm, base = gpu.get("sm_mhz"), gpu.get("base_mhz")
    if sm and base and sm < base:
        out.append(f"SM clock {sm} MHz under load, below base {base} MHz (max {gpu.get('max_mhz')})")
    if reasons := throttle_names(gpu.get("reasons")):
        out.append("throttle reasons: " + ", ".join(reasons))
    others = [p for p in gpu.get("processes", []) if p["pid"] not in own_pids]
    if others:
        out.append("other processes: " + ", ".join(
            f"pid {p['pid']} {p['name']}" + (f" ({p['used_bytes'] / 2**30:.1f} GiB)" if p.get("used_bytes") else "")
            for p in others))
    if gpu.get("copy_error"):
        out.append(f"copy check failed: {gpu['copy_error']}")
    elif flag := copy_flag(gpu["name"], gpu.get("copy_tbps")):
        out.append(flag)
    return out


def _span(values, fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "?"
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def report_lines(probe: dict, nvml_count: int, own_pids=()) -> list[str]:
    """The header of a GPU run: one summary line, then one warning line per GPU that has something to report."""
    gpus = probe["gpus"]
    if not gpus:  # NVML unreadable, CUDA fine
        return [f"preflight: CUDA sees {probe.get('cuda_count')} GPU(s), NVML none: no clocks or processes to report"]
    names = Counter(g["name"] for g in gpus)
    usual = {USUAL_COPY_TBPS[n] for n in names if n in USUAL_COPY_TBPS}
    lines = [f"preflight: {', '.join(f'{n} x {name}' for name, n in names.items())}, driver {probe.get('driver')}, "
             f"torch {probe.get('torch')} (CUDA {probe.get('torch_cuda')}); under load: SM "
             f"{_span([g.get('sm_mhz') for g in gpus], 'd')} MHz (max {_span([g.get('max_mhz') for g in gpus], 'd')},"
             f" base {_span([g.get('base_mhz') for g in gpus], 'd')}), copy "
             f"{_span([g.get('copy_tbps') for g in gpus], '.2f')} TB/s"
             + (f" (usual {'/'.join(f'{lo}-{hi}' for lo, hi in sorted(usual))})" if usual else "")]
    if probe.get("cuda_count", len(gpus)) < nvml_count:
        lines.append(f"preflight WARNING: CUDA sees {probe.get('cuda_count')} of the {nvml_count} GPUs NVML lists")
    for g in gpus:
        if found := gpu_warnings(g, own_pids):
            lines.append(f"preflight WARNING GPU{g['index']}: " + "; ".join(found))
    return lines


# ---- the run

def check(markexpr: str, markers) -> list[str]:
    """Raises pytest.UsageError with the diagnosis where CUDA must work and does not; else the header lines."""
    nvml = read_nvml()
    cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not gpus_expected(nvml, cuda_visible, file_status("/dev/nvidiactl") != "missing"):
        why = ("CUDA_VISIBLE_DEVICES is empty" if cuda_visible is not None and not cuda_visible.strip()
               else nvml.error or "NVML lists no GPU for this process")
        return [f"preflight: no GPU ({why}); CPU run"]
    if not selects_gpu_tests(markexpr, markers):
        return [f"preflight: -m {markexpr!r} selects no GPU test; CUDA not checked"]
    probe = run_probe(nvml.visible)
    if probe.get("cuda_error"):
        import torch

        raise pytest.UsageError(diagnosis(nvml, probe["cuda_error"], device_files(nvml.visible), torch.__version__,
                                          torch.version.cuda, cuda_visible))
    return report_lines(dict(probe, driver=nvml.driver), len(nvml.visible), {os.getpid(), probe.get("pid")})


class Preflight:
    """One per pytest process. The conftests add their suite's GPU markers at configure time; the check runs at
    session start, once all of them have (and before xdist starts its workers or any collection)."""

    def __init__(self):
        self.markers: set[str] = set()
        self.lines: list[str] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        self.lines = check(session.config.option.markexpr, self.markers)

    def pytest_report_header(self, config):
        return self.lines


def install(config, suite: str) -> None:
    """Called from a suite's pytest_configure. xdist workers skip it: their controller has checked."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    plugin = config.pluginmanager.get_plugin(PLUGIN)
    if plugin is None:
        plugin = Preflight()
        config.pluginmanager.register(plugin, PLUGIN)
    plugin.markers.update(GPU_MARKERS[suite])


# ---- the child process: `python -m perf.preflight 0,1,...` (NVML indices) prints probe()'s JSON

def _copy_tbps(torch, k: int, sample) -> tuple[float, object]:
    """Device-to-device copies of COPY_BYTES on CUDA device k, timed with CUDA events (bytes read plus written),
    and sample() taken while they run: clocks under load, not the idle clocks a quiet GPU drops to."""
    torch.cuda.set_device(k)
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=k)
    dst = torch.empty_like(src)
    for _ in range(10):  # warm-up: clocks up from idle
        dst.copy_(src)
    torch.cuda.synchronize(k)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(COPIES):
        dst.copy_(src)
    end.record()
    time.sleep(0.005)  # the copies take tens of ms: sample in the middle of them
    under_load = sample()
    end.synchronize()
    return 2 * COPY_BYTES * COPIES / (start.elapsed_time(end) / 1e3) / 1e12, under_load


def _nvml_static(nv, index: int, h) -> dict:
    """Name, maximum and base SM clocks and the compute processes of one GPU; what NVML cannot read stays out."""
    gpu = dict(index=index, name="?", processes=[])
    try:
        gpu["name"] = _text(nv.nvmlDeviceGetName(h))
        gpu["max_mhz"] = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)
        # The default application clock: the base clock a GPU holds under load.
        gpu["base_mhz"] = nv.nvmlDeviceGetClock(h, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_ID_APP_CLOCK_DEFAULT)
    except Exception:
        pass
    try:
        for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
            try:
                name = os.path.basename(_text(nv.nvmlSystemGetProcessName(p.pid)))
            except Exception:
                name = "?"
            gpu["processes"].append(dict(pid=p.pid, name=name, used_bytes=p.usedGpuMemory))
    except Exception:
        pass
    return gpu


def _under_load(nv, h) -> tuple[int | None, int | None]:
    """The SM clock and the clocks event (throttle) reasons, each None where NVML cannot read it."""
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons")  # the older name, in older NVML bindings
    readings = []
    for read in (lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), lambda: reasons(h)):
        try:
            readings.append(read())
        except Exception:
            readings.append(None)
    return tuple(readings)


def probe(indices: list[int]) -> dict:
    """NVML's readings that need no CUDA (the processes first, before this process has a context), CUDA's
    initialization, then per GPU the copy rate with the SM clock and throttle reasons under load."""
    import torch

    out = dict(pid=os.getpid(), torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_error=None, gpus=[])
    try:
        nv = _pynvml()
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in indices]
    except Exception:  # NVML failing is reported by the parent; CUDA is still probed
        nv, handles = None, []
    out["gpus"] = [_nvml_static(nv, i, h) for i, h in zip(indices, handles)]

    init_error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()  # warns with the driver's own words (cuInit's error) when it fails
        try:
            torch.cuda.init()
        except Exception as e:
            init_error = f"{type(e).__name__}: {e}"
    if init_error or not available:
        said = " | ".join(str(w.message) for w in caught if "cuda" in str(w.message).lower())
        out["cuda_error"] = init_error or said or "torch.cuda.is_available() is False"
        return out
    out["cuda_count"] = torch.cuda.device_count()
    for k, (gpu, h) in enumerate(zip(out["gpus"][:out["cuda_count"]], handles)):
        try:
            gpu["copy_tbps"], (gpu["sm_mhz"], gpu["reasons"]) = _copy_tbps(torch, k, lambda: _under_load(nv, h))
        except Exception as e:  # out of memory beside another process, say: a warning, not a failure
            gpu["copy_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return out


if __name__ == "__main__":
    print(json.dumps(probe([int(i) for i in sys.argv[1].split(",") if i.strip()])))
