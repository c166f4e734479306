"""A pytest plugin for perf/test_preflight.py only: `pytest -p perf.preflight_fakes` replaces perf.preflight's probes
with the readings of a fake runner, chosen by PREFLIGHT_FAKE (read here and nowhere else):

- `broken` (default): NVML lists one H200, CUDA fails as on the container runners that lacked a device permission
  (cuInit error 999), /dev/nvidia0 does not open, /dev/nvidia-uvm is missing;
- `throttled`: CUDA works, but the H200 runs below its base clock under a power cap, beside another process, and
  copies at half its usual rate.
"""
from __future__ import annotations

import os

from perf import preflight

SCENARIO = os.environ.get("PREFLIGHT_FAKE", "broken")
DRIVER = "550.54.15"
CUDA_999 = ("RuntimeError: CUDA unknown error - this may be due to an incorrectly set up environment, e.g. changing "
            "env variable CUDA_VISIBLE_DEVICES after program start. Setting the available devices to be zero.")
FILES = {"/dev/nvidiactl": "exists (char 195:255), opens read/write",
         "/dev/nvidia0": "exists (char 195:0), does not open read/write (Permission denied)"}  # /dev/nvidia-uvm: missing
THROTTLED = dict(index=0, name="NVIDIA H200", max_mhz=1980, base_mhz=1755, sm_mhz=1305, reasons=0x4,
                 processes=[dict(pid=4242, name="python3", used_bytes=20 * 2**30)], copy_tbps=2.05)


def pytest_configure(config):
    """Replace the probes (here, not at import: perf/test_preflight.py imports this module for its readings)."""
    preflight.read_nvml = lambda: preflight.Nvml(visible=[0], driver=DRIVER)
    preflight.list_device_files = lambda: list(FILES)
    preflight.file_status = lambda path: FILES.get(path, "missing")
    if SCENARIO == "broken":
        preflight.run_probe = lambda indices: dict(cuda_error=CUDA_999)
    else:
        preflight.run_probe = lambda indices: dict(pid=1, torch="2.5.1+cu124", torch_cuda="12.4", cuda_error=None,
                                                   cuda_count=1, gpus=[THROTTLED])
