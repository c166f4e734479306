"""Result files: written atomically, with the environment they were measured in.

A file is written to a temporary sibling (.NAME.PID.RANDOM.tmp) and renamed into place, so readers see the old file
or the whole new one. A temporary whose writer process is gone (a killed run) is removed by the next writer in that
folder."""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from .errors import EngineError

_TEMPORARY = re.compile(r"^\..+\.(\d+)\.[^.]+\.tmp$")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary_sibling(path: Path, folder: bool = False) -> Path:
    """A new, empty temporary file (or folder) beside path, named for remove_stale_temporaries. Its mode is what a
    plain open() or mkdir() would give (mkstemp and mkdtemp make it private), since it is renamed into place."""
    prefix, where = f".{path.name}.{os.getpid()}.", path.parent
    if folder:
        tmp = Path(tempfile.mkdtemp(dir=where, prefix=prefix, suffix=".tmp"))
    else:
        fd, name = tempfile.mkstemp(dir=where, prefix=prefix, suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
    tmp.chmod((0o777 if folder else 0o666) & ~_umask())
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(folder: Path) -> None:
    """Remove the temporaries in folder whose writer process no longer runs: what a killed run left behind."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return
    for entry in entries:
        m = _TEMPORARY.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _replace_atomically(path: Path, write) -> None:
    """write(tmp) into a temporary sibling of path, then rename it into place; the temporary never outlives a
    failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    tmp = temporary_sibling(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike, what: str = "results") -> None:
    """Fail before a long run, not after it, when its result file cannot be written there (creates nothing)."""
    path = Path(path)
    if path.is_dir():
        raise EngineError(f"cannot write {what} to {path}: it is a directory")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise EngineError(f"cannot write {what} to {path}: {folder} is not a directory")
    try:
        temporary_sibling(folder / path.name).unlink()
    except OSError as e:
        raise EngineError(f"cannot write {what} to {path} ({e.strerror or e})") from None


def write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON atomically. When the file cannot be written (a full disk, a folder gone read-only), the JSON is
    kept in the system's temporary folder and the EngineError says where, so a long run's results survive."""
    path = Path(path)
    text = json.dumps(obj, indent=2) + "\n"
    try:
        _replace_atomically(path, lambda tmp: tmp.write_text(text))
    except OSError as e:
        fd, kept = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=path.suffix or ".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        raise EngineError(f"cannot write {path} ({e.strerror or e}); the results were kept in {kept}") from None


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save, atomically (checkpoints and data of a training run)."""
    _replace_atomically(Path(path), lambda tmp: torch.save(obj, tmp))


def git_sha() -> str | None:
    """The checkout's commit, with "+dirty" where tracked files differ from it (the numbers are then not that
    commit's); None outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    try:
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def sm_clock_mhz(device) -> int | None:
    """The GPU's SM clock now (NVML, through torch's device-index mapping); None off a GPU or without NVML. Read after
    each timed run: process-to-process speed differences of a small model at equal tau are checked against it."""
    if getattr(device, "type", None) != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # no NVML, or a driver without the query
        return None


def gpu_telemetry(index: int = 0) -> dict | None:
    """Name, driver, clocks, power, temperature and throttle reasons of a GPU through NVML (no CUDA context)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(h)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return dict(
            name=name.decode() if isinstance(name, bytes) else name,
            driver=driver.decode() if isinstance(driver, bytes) else driver,
            sm_clock_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            mem_clock_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
            power_w=pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
            temperature_c=pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            throttle_reasons=hex(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
        )
    except Exception:  # no NVIDIA driver, no GPU, or an NVML call this driver lacks
        return None
