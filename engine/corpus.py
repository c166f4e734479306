"""Offline prompts for training drafts: instructions, code, arithmetic, JSON and chat, generated from templates
with a seeded RNG (nothing is downloaded), plus a held-out evaluation set that training never sees.

The held-out set is the DESIGN.md section 7 workloads (engine.workloads.PROMPTS) and HELDOUT below; the training
generator uses other templates and subjects, and `training_prompts` drops any prompt equal to a held-out one.
"""
from __future__ import annotations

import random

from .workloads import PROMPTS

SUBJECTS = ["photosynthesis", "the water cycle", "binary search", "hash tables", "the French revolution",
            "compound interest", "black holes", "vaccines", "supply and demand", "plate tectonics",
            "recursion", "the stock market", "neural networks", "climate change", "the immune system",
            "volcanoes", "electric cars", "the printing press", "prime numbers", "gravity", "bees",
            "cloud computing", "the Roman empire", "sleep", "coffee", "solar panels", "chess openings",
            "version control", "public key cryptography", "the human heart", "rainbows", "inflation"]
AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year student", "an expert", "my grandmother"]
TASKS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a string",
         "merges two sorted lists", "computes the factorial of n", "flattens a nested list",
         "finds the largest element of a list", "removes duplicates from a list while keeping order",
         "converts Celsius to Fahrenheit", "checks whether a string is a palindrome",
         "returns the greatest common divisor of two integers", "sums the digits of an integer",
         "counts word frequencies in a text", "transposes a matrix", "implements binary search",
         "validates an email address with a regular expression", "computes a moving average",
         "parses a CSV line into fields", "rotates a list by k positions", "implements a stack class"]
LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "TypeScript", "Bash"]
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Giulia", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]
ITEMS = ["apples", "books", "pencils", "marbles", "cookies", "stamps", "tickets", "coins", "shells", "cards"]
OBJECTS = ["a book", "a movie", "a product", "a city", "a recipe", "a laptop", "a company", "a song", "a planet"]
FIELDS = [("title", "string"), ("year", "integer"), ("rating", "number"), ("tags", "[string]"),
          ("price", "number"), ("in_stock", "boolean"), ("author", "string"), ("country", "string"),
          ("population", "integer"), ("ingredients", "[string]"), ("id", "integer")]
CHAT = ["Hi! How are you today?", "Can you recommend a good book to read this weekend?",
        "I feel stressed about my exams. Any advice?", "What should I cook for dinner tonight?",
        "Tell me a fun fact about space.", "How do I get better at public speaking?",
        "What's a good way to start learning to draw?", "Can you help me plan a trip to Japan?",
        "Write a short poem about the sea.", "Give me three tips for staying productive.",
        "Tell me a joke about programmers.", "What is the difference between weather and climate?"]

# Held out from training: the section 7 workloads plus these (other tasks, other phrasings).
HELDOUT = [
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a C function that reverses a linked list in place.",
    "Explain how a hash map handles collisions, briefly.",
    "Tom has 23 marbles. He gives 7 to Sara and then buys twice as many as he has left. How many marbles does "
    "he have now? Solve it step by step.",
    'Emit only a JSON object that follows this schema: {"city": string, "country": string, "population": '
    'integer, "landmarks": [string]}. Describe a fictional city.',
    "Summarize the plot of a story about a robot who learns to paint, in three sentences.",
    "What are the pros and cons of working from home?",
    "Write a haiku about autumn leaves.",
]


def _instruction(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    return rng.choice([
        f"Explain {subject} to {rng.choice(AUDIENCES)}.",
        f"Give a short overview of {subject} in {rng.randint(3, 6)} bullet points.",
        f"What are the most common misconceptions about {subject}?",
        f"Write a short paragraph about the history of {subject}.",
        f"Compare {subject} and {rng.choice(SUBJECTS)}.",
    ])


def _code(rng: random.Random) -> str:
    task, lang = rng.choice(TASKS), rng.choice(LANGUAGES)
    return rng.choice([
        f"Write a {lang} function that {task}.",
        f"Implement a {lang} program that {task}, with comments.",
        f"Write a {lang} function that {task}, and show an example call.",
        f"How would you write code that {task} in {lang}? Explain the approach and give the code.",
    ])


def _arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(1, 40)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice([
        f"What is {a} * {b} + {c}? Show your work.",
        f"{name} has {a} {item}. {other} gives {name} {b} times as many, then {name} loses {c}. "
        f"How many {item} does {name} have? Solve it step by step.",
        f"A shop sells {item} at {b} dollars each. {name} buys {a} and pays with {a * b + c} dollars. "
        f"How much change does {name} get? Explain.",
        f"If a train travels {a * 10} km in {b} hours, what is its average speed? Show the steps.",
        f"Compute the sum of the integers from 1 to {a}, step by step.",
    ])


def _json(rng: random.Random) -> str:
    fields = rng.sample(FIELDS, rng.randint(3, 5))
    schema = ", ".join(f'"{k}": {t}' for k, t in fields)
    return rng.choice([
        f"Emit only a JSON object that follows this schema: {{{schema}}}. Describe {rng.choice(OBJECTS)}.",
        f"Return a JSON array of {rng.randint(2, 4)} objects with the fields {{{schema}}}, describing "
        f"fictional examples of {rng.choice(OBJECTS)}.",
        f"Convert this to JSON with keys name and age: {rng.choice(NAMES)} is {rng.randint(18, 90)} years old.",
    ])


def _chat(rng: random.Random) -> str:
    return rng.choice(CHAT)


KINDS = (_instruction, _code, _arithmetic, _json, _chat)


def heldout_prompts() -> dict[str, str]:
    return {**PROMPTS, **{f"heldout-{i}": p for i, p in enumerate(HELDOUT)}}


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct prompts (as many as the templates allow) cycling over the kinds, never a held-out one."""
    rng = random.Random(seed)
    held = set(heldout_prompts().values())
    seen, out = set(), []
    for attempt in range(n * 50):
        prompt = KINDS[attempt % len(KINDS)](rng)
        if prompt not in seen and prompt not in held:
            seen.add(prompt)
            out.append(prompt)
            if len(out) == n:
                break
    return out
