"""The one timer abstraction: named stages, CUDA events on a GPU (resolved once at the end, no sync per
stage), a host clock on a CPU."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class StageTimer:
    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[tuple[str, object, object]] = []
        self._ms: dict[str, float] = defaultdict(float)

    @contextmanager
    def stage(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._ms[name] += (time.perf_counter() - t0) * 1e3

    def totals_ms(self) -> dict[str, float]:
        """Total milliseconds per stage (synchronises once on a GPU)."""
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self._ms[name] += start.elapsed_time(end)
            self._events.clear()
        return dict(self._ms)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
