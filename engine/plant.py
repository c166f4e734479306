"""A planted, calibrated slowdown, to measure how small a regression the perf gate catches.

ENGINE_PLANT_SLOWDOWN=F (e.g. 0.05) makes every decode round take F more of its own measured time: after each round
is launched, the round's time T (host clock, from the end of the previous round's plant to now) is measured and an
extra F * T is spent both on the device (a spin kernel, GPUs only) and on the host (a busy wait). Spending it on both
keeps it on the critical path whichever side bounds the loop: a GPU-bound loop waits for the spin, a host-bound one
(the 135M pairs) for the wait; the other side's copy overlaps it. In steady state a round's period grows from T to
(1 + F) * T, so decode tok/s drops by F / (1 + F). The outputs are untouched, and so are the stage times (the plant
runs between rounds, outside the stage timer). Unset or 0: nothing is planted. ENGINE_DISABLE_TRITON=1 stays the
large planted regression (docs/testing.md).
"""
from __future__ import annotations

import functools
import math
import os
import time

import torch

from .errors import EngineError

ENV = "ENGINE_PLANT_SLOWDOWN"


class Plant:
    def __init__(self, fraction: float, device: torch.device):
        self.fraction = fraction
        self.cycles_per_ms = _cycles_per_ms(_index(device)) if device.type == "cuda" else None
        self.mark = time.perf_counter()

    def after_round(self) -> None:
        now = time.perf_counter()
        extra = self.fraction * (now - self.mark)  # seconds
        if self.cycles_per_ms is not None:
            torch.cuda._sleep(int(extra * 1e3 * self.cycles_per_ms))
        # A busy wait: time.sleep overshoots by 50-100 us, as much as a 5% plant of a 2 ms GPU round.
        while time.perf_counter() < now + extra:
            pass
        self.mark = time.perf_counter()


def planted_slowdown(device: torch.device) -> Plant | None:
    """The plant ENGINE_PLANT_SLOWDOWN asks for (read at each generation), or None."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not (math.isfinite(fraction) and fraction >= 0):
        raise EngineError(f"{ENV} must be a fraction >= 0 of each round's time (e.g. 0.05), got {text!r}")
    return Plant(fraction, device) if fraction > 0 else None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _cycles_per_ms(index: int) -> float:
    """The spin kernel counts SM clock cycles: measure their rate once per process and GPU (the second of two spins,
    so the clock has ramped up), rather than trust a nominal clock that boost and power limits move."""
    cycles = 20_000_000  # about 10 ms at 2 GHz
    with torch.cuda.device(index):
        for _ in range(2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
        return cycles / start.elapsed_time(end)
