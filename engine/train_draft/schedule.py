"""Time and learning rate: the step count that fits a time budget (--minutes), and warm-up plus cosine decay."""
from __future__ import annotations

import math

from .settings import TrainSettings

# Steps of a run between which a time budget (--minutes) measures the step rate: after the CUDA graph's warm-up.
RATE_WINDOW = (20, 220)


def steps_in_budget(settings: TrainSettings, step: int, rate: float, elapsed_s: float) -> int:
    """The step count that ends the run within settings.minutes: what the measured rate fits in the time left, less
    5% for checkpoints and jitter; never more than settings.steps, never fewer than the steps done."""
    left = settings.minutes * 60 - elapsed_s
    return max(step, min(settings.steps, step + int(0.95 * rate * left)))


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warm-up to settings.lr, then cosine decay to a tenth of it at the last step."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
