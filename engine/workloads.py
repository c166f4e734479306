"""The workloads of the public runs this project grew from (DESIGN.md section 7)."""
from __future__ import annotations

import random

PROMPTS = {
    "fib": "Write a Python function that returns the n-th Fibonacci number.",
    "qsort": "Implement quicksort in Python.",
    "arith": ("A farmer has 17 cows. He buys three times as many sheep as cows, then sells 12 of the sheep. "
              "Each remaining sheep gives 2 kg of wool a year. How many kilograms of wool does he get in a year? "
              "Solve it step by step."),
    "json": ('Emit only a JSON object that follows this schema: {"name": string, "age": integer, '
             '"email": string, "tags": [string]}. Describe a fictional user.'),
}

# New tokens per length: the public runs' values on a GPU, scaled down on a CPU.
LENGTHS = {"short": 256, "long": 2048}
CPU_LENGTHS = {"short": 16, "long": 32}

SYNTHETIC_PROMPT_TOKENS = 128


def prompt_ids(target, workload: str) -> list[int]:
    """The workload's prompt in the target's chat template, or seeded random ids for a target with no tokenizer."""
    if workload not in PROMPTS:
        raise KeyError(workload)
    if target.tokenizer is not None:
        return target.encode(PROMPTS[workload])
    rng = random.Random(workload)
    return [rng.randrange(target.model.cfg.vocab_size) for _ in range(SYNTHETIC_PROMPT_TOKENS)]
