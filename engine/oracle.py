"""A drafter that knows the answer: it proposes a known continuation, with seeded mistakes.

Used by the correctness suite to drive multi-token acceptance, rejected drafts and accepted side branches
(a mistake demotes the right token to a lower rank, where a DDTree sibling can still catch it), and by
benchmarks as a synthetic-acceptance drafter. Mistakes depend only on (seed, absolute position), so every
method sees the same proposal for the same position.
"""
from __future__ import annotations

import random

import torch

from .draft import DraftInput, Drafter


class OracleDrafter(Drafter):
    def __init__(self, reference: list[int], vocab_size: int, block_size: int, miss_rate: float = 0.25,
                 absent_rate: float = 0.3, seed: int = 0, device="cpu"):
        """reference: prompt + the target's greedy continuation. miss_rate: chance that a position's right
        token is not ranked first; absent_rate: chance that such a miss leaves it out of the top ranks entirely."""
        if vocab_size < 8:
            raise ValueError("the oracle drafter needs a vocabulary of at least 8 tokens")
        self.reference, self.vocab_size, self.block_size = list(reference), vocab_size, block_size
        self.miss_rate, self.absent_rate, self.seed, self.device = miss_rate, absent_rate, seed, device

    def start(self, prompt_len: int, capacity: int) -> None:
        pass

    def _ranked(self, position: int, context_ok: bool) -> list[int]:
        """The tokens proposed for an absolute position, best first."""
        rng = random.Random(self.seed * 1_000_003 + position)
        wrong = rng.sample(range(self.vocab_size), 5)
        if not context_ok or position >= len(self.reference):
            return wrong
        right = self.reference[position]
        wrong = [t for t in wrong if t != right][:4]
        if rng.random() >= self.miss_rate:
            return [right] + wrong
        if rng.random() < self.absent_rate:
            return wrong
        return wrong[:rng.randint(1, 3)] + [right] + wrong[3:]

    def propose(self, inp: DraftInput) -> torch.Tensor:
        n = inp.tokens.shape[1]  # the bonus sits at position n - 1
        context_ok = inp.tokens[0].tolist() == self.reference[:n]
        gen = torch.Generator().manual_seed(self.seed + n)
        logits = torch.randn(self.block_size - 1, self.vocab_size, generator=gen)
        for depth in range(1, self.block_size):
            for rank, token in enumerate(self._ranked(n - 1 + depth, context_ok)):
                logits[depth - 1, token] = 20.0 - 2.0 * rank
        return logits.to(self.device)
