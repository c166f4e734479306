"""Which DDTree budget pays at a given concurrency (`bench --concurrency ... --methods ddtree-auto`; issue 31).

A bigger tree accepts more tokens per round (tau grows with the budget), but every sequence verifies 1 + budget rows,
and a verify pass costs more as the batch's rows grow: little while the target's weights dominate (a few rows in
all), in proportion once the pass is bound by its arithmetic (many sequences of many rows). The tree that pays at
concurrency 1 does not at 32. The policy measures both sides on this device, with the decode loop's own code, and
picks per concurrency c the budget with the most tokens per second:

    tok/s(c, b) = c * tau(b) / (draft_ms(c, b) + verify_ms(c, 1 + b))

- tau(b): DDTree-b's acceptance length over the workloads at concurrency 1 (a sequence's acceptance does not depend
  on the batch it shares a round with);
- draft_ms(c, b): one draft pass over c sequences; its LM head runs over min(b, block - 1) positions (a tree of budget
  b reaches depth b), the layers over the whole block;
- verify_ms(c, T): one target pass over c sequences of T verified rows each, after a context of typical length.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kernels import triton_disabled
from kernels.argmax import argmax

from .decode import draft_depth
from .draft import DraftInput
from .timing import sync

BUDGETS = (4, 8, 15, 32, 64)
TIMED = 5  # timed passes per measurement, after one untimed: the median


@dataclass
class BudgetChoice:
    concurrency: int
    budget: int
    table: dict[int, dict[str, float]]  # per candidate budget: tau, round_ms, tok_s (the model's)


def _median_ms(step, device: torch.device) -> float:
    """The median time of `step` over TIMED runs after one untimed. On a GPU the step is captured as a CUDA graph and
    replayed, as decoding runs it: timed eagerly, an 8B pass would measure its ~40 kernel launches per layer."""
    step()
    graph = None
    if device.type == "cuda" and not triton_disabled():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    times = []
    for _ in range(TIMED):
        sync(device)
        t0 = time.perf_counter()
        graph.replay() if graph is not None else step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def verify_ms(target, concurrency: int, rows: int, context: int) -> float:
    """One target pass over `concurrency` sequences of `rows` verified rows each (a chain: the cost does not depend on
    the tree's shape), after `context` committed tokens per sequence."""
    dev = target.device
    cache = target.new_cache(context + rows, concurrency, own_lengths=True)
    cache.start.fill_(context)
    ids = torch.zeros(concurrency, rows, dtype=torch.long, device=dev)
    positions = (context + torch.arange(rows, device=dev)).expand(concurrency, -1)
    mask = torch.ones(rows, rows, dtype=torch.bool, device=dev).tril().expand(concurrency, -1, -1)
    return _median_ms(lambda: argmax(target.logits(target(ids, positions, cache, mask)[0])), dev)


@torch.no_grad()
def draft_ms(drafter, target, concurrency: int, context: int, depth: int | None = None) -> float:
    """One draft pass over `concurrency` sequences, each with a block of new context rows after `context` tokens,
    proposing `depth` positions (DraftInput.depth)."""
    if drafter is None:
        return 0.0
    dev, block = target.device, drafter.block_size
    width = len(drafter.feature_layers) * target.cfg.hidden_size
    tokens = torch.zeros(concurrency, context + 2 * block + 1, dtype=torch.long, device=dev)
    length = torch.full((concurrency,), context, dtype=torch.long, device=dev)
    features = torch.zeros(concurrency, block, width, dtype=target.dtype, device=dev)
    n_features = torch.full((concurrency,), block, dtype=torch.long, device=dev)

    drafter.start(0, context + 2 * block + 1, sequences=concurrency)
    cache = getattr(drafter, "cache", None)

    def step():
        if cache is not None:
            cache.start.fill_(context)  # the same context every pass
        drafter.propose(DraftInput(tokens, length, features, n_features, depth))
    return _median_ms(step, dev)


def choose_budgets(bench, workloads: list[str], new_tokens: int, concurrency: list[int],
                   budgets: tuple[int, ...] = BUDGETS) -> dict[int, BudgetChoice]:
    """The budget per concurrency, with the model's table: tau per budget from `bench` (concurrency 1, every output
    checked against AR), the draft and verify passes timed at each concurrency."""
    from .errors import EngineError

    tau = {}
    for b in budgets:
        records = [bench.measure(w, new_tokens, f"ddtree-{b}") for w in workloads]
        bad = [r for r in records if not r["lossless"]]
        if bad:
            raise EngineError(f"budget policy: ddtree-{b} diverged from AR: {bad[0]['exactness']}")
        rounds = sum(r["rounds"] for r in records)
        tau[b] = sum(sum(r["acceptance_lengths"]) for r in records) / max(1, rounds)
    target = bench.target.model
    context = max(len(bench.reference(w, new_tokens).tokens) for w in workloads) // 2 + 64
    drafter = bench._drafter_for(context + new_tokens)
    drafter = getattr(drafter, "cost", None) or drafter  # an oracle's cost is its draft's
    choices = {}
    block = 0 if drafter is None else drafter.block_size
    depths = {b: draft_depth("ddtree", b, block) for b in budgets}
    for c in concurrency:
        d = {depth: draft_ms(drafter, target, c, context, depth) for depth in set(depths.values())}
        table = {}
        for b in budgets:
            round_ms = d[depths[b]] + verify_ms(target, c, 1 + b, context)
            table[b] = dict(tau=tau[b], round_ms=round_ms, tok_s=1e3 * c * tau[b] / round_ms)
        best = max(budgets, key=lambda b: table[b]["tok_s"])
        choices[c] = BudgetChoice(c, best, table)
    return choices
