"""The workloads of the public runs this project grew from (DESIGN.md section 7), and the held-out set that
draft training never sees: those four plus HELDOUT (other tasks, other phrasings)."""
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

# Held out from draft training with PROMPTS (engine/corpus.py drops any training prompt equal to one of them).
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
HELDOUT_TOKENS = 128  # new tokens per held-out prompt, as train-draft's summary measures it


def heldout_prompts() -> dict[str, str]:
    """The held-out set by workload name: the section 7 workloads, then HELDOUT."""
    return {**PROMPTS, **HELDOUT}


# New tokens per length: the public runs' values on a GPU, scaled down on a CPU.
LENGTHS = {"short": 256, "long": 2048}
CPU_LENGTHS = {"short": 16, "long": 32}

SYNTHETIC_PROMPT_TOKENS = 128


def prompt_ids(target, workload: str) -> list[int]:
    """The workload's prompt (section 7 or held out) in the target's chat template, or seeded random ids for a
    target with no tokenizer."""
    prompts = heldout_prompts()
    if workload not in prompts:
        raise KeyError(workload)
    if target.tokenizer is not None:
        return target.encode(prompts[workload])
    rng = random.Random(workload)
    return [rng.randrange(target.model.cfg.vocab_size) for _ in range(SYNTHETIC_PROMPT_TOKENS)]
