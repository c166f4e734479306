"""Result files: written atomically, with the environment they were measured in."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch


def write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON so that readers see the old file or the whole new one, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
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
