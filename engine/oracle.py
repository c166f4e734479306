"""A drafter that knows the answer: it proposes a known continuation, with seeded mistakes.

Used by the correctness suite to drive multi-token acceptance, rejected drafts and accepted side branches
(a mistake demotes the right token to a lower rank, where a DDTree sibling can still catch it), and by
benchmarks as synthetic acceptance: wrapped around a real drafter, which still runs (real cost) but whose
proposals are replaced. Mistakes depend only on (seed, absolute position), so every method sees the same
proposal for the same position. Proposals are looked up on the device from the committed length, so the oracle
is as graphable as the drafter it wraps.
"""
from __future__ import annotations

import random

import torch

from .draft import DraftInput, Drafter

RANKS = 5  # tokens ranked per position


class OracleDrafter(Drafter):
    def __init__(self, reference: list[int], vocab_size: int, block_size: int, miss_rate: float = 0.25,
                 absent_rate: float = 0.3, seed: int = 0, device="cpu", cost: Drafter | None = None,
                 max_length: int | None = None):
        """reference: prompt + the target's greedy continuation. miss_rate: chance that a position's right token
        is not ranked first; absent_rate: chance that such a miss leaves it out of the ranked tokens entirely.
        cost: a real drafter to run first in every round (its proposal is discarded; synthetic acceptance).
        max_length: room for references set later with `set_reference` (default: this one's length)."""
        if vocab_size < 2 * RANKS:
            raise ValueError(f"the oracle drafter needs a vocabulary of at least {2 * RANKS} tokens")
        self.vocab_size, self.block_size, self.cost = vocab_size, block_size, cost
        self.miss_rate, self.absent_rate, self.seed = miss_rate, absent_rate, seed
        self.feature_layers = cost.feature_layers if cost is not None else ()
        self.graphable = cost is None or cost.graphable
        rows = max(max_length or 0, len(reference)) + block_size
        self.ranked = torch.zeros(rows, RANKS, dtype=torch.long, device=device)  # per position, best first
        self.scores = torch.tensor([20.0 - 2.0 * r for r in range(RANKS)], device=device).expand(block_size - 1, RANKS)
        self.noise = torch.randn(block_size - 1, vocab_size, generator=torch.Generator().manual_seed(seed)).to(device)
        self.depths = torch.arange(1, block_size, device=device)
        self.set_reference(reference)

    def set_reference(self, reference: list[int]) -> None:
        """Propose this continuation from now on (in place: graphs captured over this drafter stay valid)."""
        if len(reference) > self.max_length:
            raise ValueError(f"reference of {len(reference)} tokens exceeds the oracle's max_length")
        table = [self._ranked(p, reference) for p in range(self.ranked.shape[0])]
        self.ranked.copy_(torch.tensor(table))

    @property
    def max_length(self) -> int:
        """The longest reference (prompt + continuation) that `set_reference` takes."""
        return self.ranked.shape[0] - self.block_size

    def _ranked(self, position: int, reference: list[int]) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + position)
        wrong = rng.sample(range(self.vocab_size), RANKS + 1)
        if position >= len(reference):
            return wrong[:RANKS]
        right = reference[position]
        wrong = [t for t in wrong if t != right][:RANKS]
        if rng.random() >= self.miss_rate:
            return [right] + wrong[:RANKS - 1]
        if rng.random() < self.absent_rate:
            return wrong
        rank = rng.randint(1, RANKS - 1)
        return wrong[:rank] + [right] + wrong[rank:RANKS - 1]

    def start(self, prompt_len: int, capacity: int) -> None:
        if self.cost is not None:
            self.cost.start(prompt_len, capacity)

    def propose(self, inp: DraftInput) -> torch.Tensor:
        if self.cost is not None:
            self.cost.propose(inp)
        ranked = self.ranked.index_select(0, inp.length + self.depths)  # rows for the positions after the bonus
        return self.noise.scatter(1, ranked, self.scores)

    @property
    def cache(self):  # the wrapped drafter's buffers, which captured graphs depend on
        return getattr(self.cost, "cache", None)
