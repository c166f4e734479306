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
from .errors import EngineError

RANKS = 5  # tokens ranked per position


class OracleDrafter(Drafter):
    def __init__(self, reference: list[int], vocab_size: int, block_size: int, miss_rate: float = 0.25,
                 absent_rate: float = 0.3, seed: int = 0, device="cpu", cost: Drafter | None = None,
                 max_length: int | None = None):
        """reference: prompt + the target's greedy continuation. miss_rate: chance that a position's right token
        is not ranked first; absent_rate: chance that such a miss leaves it out of the ranked tokens entirely.
        cost: a real drafter to run first in every round (its proposal is discarded; synthetic acceptance).
        max_length: room for references set later with `set_reference` (default: this one's length)."""
        if vocab_size < 2 * RANKS:  # an EngineError: `bench --acceptance synthetic` reaches it with the user's target
            raise EngineError(f"synthetic acceptance (the oracle drafter) needs a vocabulary of at least {2 * RANKS} "
                              f"tokens; the target has {vocab_size}")
        self.vocab_size, self.block_size, self.cost = vocab_size, block_size, cost
        self.miss_rate, self.absent_rate, self.seed = miss_rate, absent_rate, seed
        self.feature_layers = cost.feature_layers if cost is not None else ()
        self.graphable = cost is None or cost.graphable
        rows = max(max_length or 0, len(reference)) + block_size
        self.ranked = torch.zeros(rows, RANKS, dtype=torch.long, device=device)  # per position, best first
        self.ranked_rows: torch.Tensor | None = None  # batched decoding: [rows in the batch, positions, RANKS]
        self.scores = torch.tensor([20.0 - 2.0 * r for r in range(RANKS)], device=device).expand(block_size - 1, RANKS)
        self.noise = torch.randn(block_size - 1, vocab_size, generator=torch.Generator().manual_seed(seed)).to(device)
        self.depths = torch.arange(1, block_size, device=device)
        self.by_prompt: dict[tuple, torch.Tensor] = {}  # batched decoding: a prompt's ranked table, built once
        self.set_reference(reference)

    def set_reference(self, reference: list[int], sequence: int | None = None, miss_rate: float | None = None
                      ) -> None:
        """Propose this continuation from now on (in place: graphs captured over this drafter stay valid); in
        batched decoding, for the sequence in batch row `sequence`, with its own miss rate if given."""
        (self.ranked if sequence is None else self.ranked_rows[sequence]).copy_(self._table(reference, miss_rate))

    def _table(self, reference: list[int], miss_rate: float | None) -> torch.Tensor:
        """The ranked candidates of every position for this reference (a few ms of host work: built outside decoding
        where it can be)."""
        if len(reference) > self.max_length:
            raise ValueError(f"reference of {len(reference)} tokens exceeds the oracle's max_length")
        miss = self.miss_rate if miss_rate is None else miss_rate
        return torch.tensor([self._ranked(p, reference, miss) for p in range(self.ranked.shape[0])],
                            device=self.ranked.device)

    @property
    def max_length(self) -> int:
        """The longest reference (prompt + continuation) that `set_reference` takes."""
        return self.ranked.shape[0] - self.block_size

    def _ranked(self, position: int, reference: list[int], miss_rate: float) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + position)
        wrong = rng.sample(range(self.vocab_size), RANKS + 1)
        if position >= len(reference):
            return wrong[:RANKS]
        right = reference[position]
        wrong = [t for t in wrong if t != right][:RANKS]
        if rng.random() >= miss_rate:
            return [right] + wrong[:RANKS - 1]
        if rng.random() < self.absent_rate:
            return wrong
        rank = rng.randint(1, RANKS - 1)
        return wrong[:rank] + [right] + wrong[rank:RANKS - 1]

    def start(self, prompt_len: int, capacity: int, sequences: int | None = None) -> None:
        if sequences is not None and (self.ranked_rows is None or self.ranked_rows.shape[0] != sequences):
            self.ranked_rows = self.ranked.repeat(sequences, 1, 1)  # each row's set by reset_sequence
        if self.cost is not None:
            self.cost.start(prompt_len, capacity, **({} if sequences is None else dict(sequences=sequences)))

    def prefill(self, features: torch.Tensor, row: int | None = None) -> bool:
        return self.cost is not None and self.cost.prefill(features, row)

    def add_reference(self, prompt: list[int], continuation: list[int], miss_rate: float | None = None) -> None:
        """Batched decoding: the continuation to propose, with its own miss rate if given, for a row that starts
        this prompt (reset_sequence)."""
        self.by_prompt[tuple(prompt)] = self._table(list(prompt) + list(continuation), miss_rate)

    def reset_sequence(self, row: int, prompt: list[int]) -> None:
        table = self.by_prompt.get(tuple(prompt))
        self.ranked_rows[row].copy_(table if table is not None else self._table(prompt, None))  # unknown: all wrong
        if self.cost is not None:
            self.cost.reset_sequence(row, prompt)

    def move_sequence(self, src: int, dst: int) -> None:
        self.ranked_rows[dst].copy_(self.ranked_rows[src])
        if self.cost is not None:
            self.cost.move_sequence(src, dst)

    def propose(self, inp: DraftInput) -> torch.Tensor:
        if self.cost is not None:
            self.cost.propose(inp)
        if inp.length.dim() == 0:
            ranked = self.ranked.index_select(0, inp.length + self.depths)  # the positions after the bonus
            return self.noise.scatter(1, ranked, self.scores)
        B = inp.length.shape[0]  # one sequence per row
        positions = inp.length[:, None] + self.depths                              # [B, block - 1]
        ranked = self.ranked_rows[:B].gather(1, positions[..., None].expand(-1, -1, RANKS))
        return self.noise.expand(B, -1, -1).scatter(2, ranked, self.scores.expand(B, -1, -1))

    @property
    def cache(self):  # the wrapped drafter's buffers, which captured graphs depend on
        return getattr(self.cost, "cache", None)
