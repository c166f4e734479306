"""The benchmark registry: prompts, the held-out set, lengths, methods and model pairs.

`python -m engine bench`, the perf suite, the asv benchmarks and train-draft's held-out check all read these
names here (docs/design.md, "Workloads"). The module imports nothing heavy, so the asv benchmarks can read it
while asv discovers them without importing torch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# The workloads of the public runs this project grew from.
PROMPTS = {
    "fib": "Write a Python function that returns the n-th Fibonacci number.",
    "qsort": "Implement quicksort in Python.",
    "arith": ("A farmer has 17 cows. He buys three times as many sheep as cows, then sells 12 of the sheep. "
              "Each remaining sheep gives 2 kg of wool a year. How many kilograms of wool does he get in a year? "
              "Solve it step by step."),
    "json": ('Emit only a JSON object that follows this schema: {"name": string, "age": integer, '
             '"email": string, "tags": [string]}. Describe a fictional user.'),
}
WORKLOADS = tuple(PROMPTS)

# Held out from draft training with PROMPTS (the training corpus drops any prompt equal to one of them).
HELDOUT = {
    "anagram": "Write a Python function that checks whether two strings are anagrams.",
    "c-list": "Write a C function that reverses a linked list in place.",
    "hashmap": "Explain how a hash map handles collisions, briefly.",
    "marbles": ("Tom has 23 marbles. He gives 7 to Sara and then buys twice as many as he has left. How many marbles "
                "does he have now? Solve it step by step."),
    "city": ('Emit only a JSON object that follows this schema: {"city": string, "country": string, "population": '
             'integer, "landmarks": [string]}. Describe a fictional city.'),
    "robot": "Summarize the plot of a story about a robot who learns to paint, in three sentences.",
    "remote": "What are the pros and cons of working from home?",
    "haiku": "Write a haiku about autumn leaves.",
}
HELDOUT_TOKENS = 128  # new tokens per held-out prompt: train-draft's summary and the perf suite's held-out floor


def heldout_prompts() -> dict[str, str]:
    """The held-out set by workload name: the PROMPTS workloads, then HELDOUT."""
    return {**PROMPTS, **HELDOUT}


# New tokens per length name: the public runs' values on a GPU, scaled down on a CPU. The perf suite and asv
# measure GATED_LENGTHS; `bench` measures every length.
LENGTHS = {"cuda": {"short": 256, "long": 2048}, "cpu": {"short": 32, "long": 64}}
GATED_LENGTHS = ("short",)

# Untimed and timed generations per combination: the median of 3 on a GPU; a CPU's greedy runs are deterministic
# and slow, so one.
RUNS = {"cuda": dict(warmup=1, repeats=3), "cpu": dict(warmup=0, repeats=1)}


def lengths_for(device_type: str) -> dict[str, int]:
    return dict(LENGTHS["cuda" if device_type == "cuda" else "cpu"])


def runs_for(device_type: str) -> dict[str, int]:
    return dict(RUNS["cuda" if device_type == "cuda" else "cpu"])


METHODS = ("ar", "dflash", "ddtree-15", "ddtree-16", "ddtree-32", "ddtree-64")
HELDOUT_METHODS = ("dflash", "ddtree-15", "ddtree-32")  # what train-draft's summary reports
# The perf suite's concurrency floors (engine.measure.sweep): requests at once, and the methods measured there.
CONCURRENCY = (1, 8)
CONCURRENCY_METHODS = ("ar", "dflash", "ddtree-15", "ddtree-32")
TOPK_CAP = 8

SYNTHETIC_MISS_RATE = 0.25  # synthetic acceptance: the oracle ranks the right token first 3 times in 4


@dataclass(frozen=True)
class Pair:
    """A target and its draft, as `--target`/`--draft` take them. miss_rate: synthetic acceptance (the draft runs,
    an oracle built from the AR output replaces its proposals), None for real acceptance. draft_weights: as
    `--draft-weights` takes them."""
    name: str
    target: str
    draft: str
    miss_rate: float | None = None
    gpu_only: bool = False
    draft_weights: str = "model"


PAIRS = (
    Pair("default", "smollm2-135m", "default"),
    Pair("default-synthetic", "smollm2-135m", "default", SYNTHETIC_MISS_RATE),
    Pair("qwen3-8b-synthetic", "synthetic:qwen3-8b", "random:5", SYNTHETIC_MISS_RATE, gpu_only=True),
    # The same with the draft's weights in int8 (half its bytes a round; acceptance is the oracle's either way)
    Pair("qwen3-8b-int8-draft-synthetic", "synthetic:qwen3-8b", "random:5", SYNTHETIC_MISS_RATE, gpu_only=True,
         draft_weights="int8"),
    # Hybrid targets (Gated DeltaNet + gated attention): Qwen3.6-27B's shape needs a GPU; the tiny one keeps the
    # hybrid decode path under the CPU suite's tau floors.
    Pair("qwen3.6-27b-synthetic", "synthetic:qwen3.6-27b", "random:5", SYNTHETIC_MISS_RATE, gpu_only=True),
    Pair("hybrid-tiny-synthetic", "synthetic:hybrid-tiny", "random:1", SYNTHETIC_MISS_RATE),
)


# The A/B gate's pre-merge selection (`pytest perf -m tp1 --baseline REV`, perf/ab.py), sized for about 5 minutes on
# one H200: per pair, its workloads and methods. The host-bound 135M pair with real acceptance on a code and a JSON
# prompt; the bandwidth-bound 8B shape on one prompt (its weights are random and its acceptance synthetic, so a
# second prompt measures the same kernels again); AR and the chain and tree paths. Hybrid targets are not in it
# (`--ab-full -k qwen3.6` for a change to their path); `--ab-full` measures everything above (nightly). On a CPU
# only the default pair of these exists; there the A/B tests the mechanics, not speed.
PREMERGE_METHODS = ("ar", "dflash", "ddtree-15")
PREMERGE = {"default": (("fib", "json"), PREMERGE_METHODS),
            "qwen3-8b-synthetic": (("fib",), PREMERGE_METHODS)}


def in_premerge(pair: str, workload: str, method: str) -> bool:
    workloads, methods = PREMERGE.get(pair, ((), ()))
    return workload in workloads and method in methods


def user_pair(target: str, draft: str) -> Pair:
    """A user's own pair, named by its target's and draft's last path parts (the name keys floors and asv series,
    so it does not depend on where the checkpoints sit)."""
    def base(spec: str) -> str:
        return spec.rstrip("/").rsplit("/", 1)[-1] or spec
    return Pair(f"user:{base(target)}|{base(draft)}", target, draft)


def pairs(on_gpu: bool, user: Pair | None = None) -> dict[str, Pair]:
    """The pairs a machine measures by name: the GPU-only ones where a GPU is present, and the user's."""
    chosen = {p.name: p for p in PAIRS if on_gpu or not p.gpu_only}
    if user is not None:
        chosen[user.name] = user
    return chosen


SYNTHETIC_PROMPT_TOKENS = 128


def prompt_ids(target, workload: str) -> list[int]:
    """The workload's prompt (PROMPTS or HELDOUT) in the target's chat template, or seeded random ids for a target
    with no tokenizer."""
    prompts = heldout_prompts()
    if workload not in prompts:
        raise KeyError(workload)
    if target.tokenizer is not None:
        return target.encode(prompts[workload])
    rng = random.Random(workload)
    return [rng.randrange(target.model.cfg.vocab_size) for _ in range(SYNTHETIC_PROMPT_TOKENS)]
