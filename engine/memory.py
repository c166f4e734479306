"""How much memory a device has left: what a request or the draft trainer's feature bank may still take."""
from __future__ import annotations

import os

import torch


def available_bytes(device: torch.device | str) -> int | None:
    """Free device memory plus what PyTorch's caching allocator holds unused (GPU), or the host's available memory
    (CPU: MemAvailable, which counts reclaimable page cache); None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def gib(n: int) -> str:
    """Bytes for a person: '12.3 GiB' (or MiB below one GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
