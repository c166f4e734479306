"""The training recipe: one field per `train-draft` option, the defaults those of the committed default draft."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ..errors import EngineError
from ..workloads import HELDOUT_TOKENS


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainSettings:
    """The recipe; the defaults made the committed default draft (docs/training.md). Each help text is its CLI
    option's."""
    out: str
    init: str = _setting("", "a DFlash draft directory (or `default`: the target's default draft) to start from "
                             "instead of random weights, fine-tuning it (e.g. after the target's numerics changed); "
                             "its layers, block size, mask token and target layers replace --layers and "
                             "--block-size")
    layers: int = _setting(5, "draft layers, each of the target's width")
    block_size: int = _setting(16, "tokens per draft block, the anchor's own included")
    prompts: int = _setting(106496, "training prompts, each answered by the target")
    new_tokens: int = _setting(256, "greedy answer tokens per prompt (past end-of-sequence)")
    gen_batch: int = _setting(2048, "prompts per batch while the target answers them")
    steps: int = _setting(43595, "optimizer steps (with --minutes: at most)")
    minutes: float = _setting(0.0, "if > 0, a time budget for the data and the steps together: the run measures its "
                                   "step rate and sets the step count that ends within it (logged, and saved in "
                                   "summary.json)")
    batch: int = _setting(32, "sequences per step")
    anchors: int = _setting(32, "random anchors (blocks) per sequence")
    lr: float = _setting(6e-4, "peak learning rate (linear warm-up, cosine to a tenth)")
    warmup: int = _setting(100, "warm-up steps")
    gamma: float = _setting(7.0, "loss weight exp(-(j-1)/gamma) of block position j")
    self_written: float = _setting(0.75, "share of the prompts the target writes itself (the rest from templates)")
    distill: float = _setting(0.0, "share of the loss that is the KL to the target's next-token distribution "
                                   "(the rest: cross-entropy on its argmax)")
    compile: bool = _setting(True, "compile the draft's training pass with torch.compile, which fuses its "
                                    "elementwise work (GPUs only)")
    save_every: int = _setting(1000, "steps between checkpoints (about 270 MB each with the optimizer state)")
    validation: int = _setting(512, "sequences of the data kept out of training (at most a tenth, whole batches): "
                                  "at every checkpoint the draft's teacher-forced acceptance on them is logged and "
                                  "the draft written is the best so far; 0: none, the last step's draft")
    seed: int = _setting(0, "seed of the data and of training")
    eval_tokens: int = _setting(HELDOUT_TOKENS, "new tokens per held-out prompt in the summary (as the perf "
                                                "suite's held-out floor)")

    def check(self, resume: bool = False) -> None:
        """Refuse a recipe out of range with one EngineError naming its option, before the target loads or anything
        runs. Every float must be finite: NaN fails no comparison, so `lr <= 0` alone lets `--lr nan` through to a
        draft of NaNs."""
        def option(name):
            return "--" + name.replace("_", "-")

        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and not math.isfinite(value):
                raise EngineError(f"{option(f.name)} must be a finite number, got {value}")
        for name in ("layers", "prompts", "new_tokens", "gen_batch", "steps", "batch", "anchors", "save_every",
                     "eval_tokens", "warmup", "validation", "block_size"):
            least = {"warmup": 0, "validation": 0, "block_size": 2}.get(name, 1)
            if getattr(self, name) < least:
                raise EngineError(f"{option(name)} must be >= {least}, got {getattr(self, name)}")
        for name in ("lr", "gamma"):
            if getattr(self, name) <= 0:
                raise EngineError(f"{option(name)} must be > 0, got {getattr(self, name)}")
        if self.minutes < 0:
            raise EngineError(f"--minutes is a time budget, 0 for none; got {self.minutes}")
        if self.minutes and resume:
            raise EngineError("--minutes sets the step count in a run's first minutes, so it cannot resume a run: "
                              "pass --resume with the --steps that run logged")
        if not 0 <= self.distill <= 1:
            raise EngineError(f"--distill is the KL's share of the loss, from 0 to 1; got {self.distill}")
        if not 0 <= self.self_written <= 1:
            raise EngineError(f"--self-written is a share of the prompts, from 0 to 1; got {self.self_written}")
