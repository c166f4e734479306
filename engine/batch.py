"""Batched greedy decoding (issue 31): many requests per round, each one lossless.

`BatchDecoder` decodes a queue of prompts in up to `rows` batch rows. Each row is a separate sequence: its own
committed length (a cache with own lengths: `start` [rows]), its own draft context, its own draft tree and its own
acceptance. A round is the single-sequence round of engine/decode.py over the rows in use: draft, tree, verify,
commit, then one host read of every row's accepted count and tokens.

Continuous batching: the first prompts are prefilled together (one forward pass over prompts padded at their
ends, where that at most doubles the work; a hybrid's one at a time); a request that finishes (a stop token or its
length) frees its row, which takes the next prompt from the queue, prefilled into that row (a row view of the
cache); the draft takes its prompt's context then (`Drafter.prefill`; a drafter without one reads the prompt's
features in the row's next proposal). When the queue is empty, the last row in use moves into the freed row, so that
a round runs over the first `in_use` rows only and finished requests stop costing work.

Hybrid targets: their Gated DeltaNet layers follow a chain shared by the rows (AR, DFlash) or each row's own
tree (DDTree), and commit replays each row's own accepted path; per-row trees and replays run one sequence at a
time (a batched kernel over such schedules is future work).

On a GPU each stage of a round over B rows is captured once per B as a CUDA graph over the batch's buffers (a
graph per batch size: rows in use change as requests finish) and replayed; a round right after an admission runs
eagerly where the drafter has no prefill (its draft reads a prompt's features), as does the first round at each B
(the warm-up, captured after it).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from kernels.argmax import argmax
from kernels.gated_delta import tree_schedule
from kernels.topk import topk_logprobs
from kernels.tree_ops import build_tree, walk_tree

from .decode import Decoder, DecodeSettings, GenerationResult, RoundTree, capture_stages
from .draft import DraftInput, Drafter
from .errors import EngineError
from .model import Transformer
from .memory import available_bytes, gib
from .timing import StageTimer, sync


PREFILL_MASK_ENTRIES = 1 << 24  # prompts prefilled together: at most this many causal-mask entries (rows x T x T)


@dataclass
class _Request:
    index: int                  # the prompt's position in the caller's list
    prompt: list[int]
    out: list[int]
    accepted: list[int]
    prefill_s: float            # time to first token from the call (waiting for a row included)
    started: float              # host clock at its first token


@dataclass
class _Batch:
    """The device state of one generate() call, allocated once: graphs are captured over these tensors."""
    cache: object                    # a ModelCache with own lengths, one row per sequence
    tokens: torch.Tensor             # [rows, capacity + block + 1]: each row's prompt, committed ids, next bonus
    features: torch.Tensor | None    # [rows, block, F]: context features of each row's last commit
    n_features: torch.Tensor         # [rows]
    round_out: torch.Tensor          # [rows, 1 + block]: the last round's accepted count and committed tokens
    prompt_features: dict = field(default_factory=dict)  # row -> its prompt's features, read by its next draft
    stages: dict = field(default_factory=dict)           # B -> the stages' intermediates (a namespace)
    graphs: dict = field(default_factory=dict)           # B -> {stage: CUDA graph}
    drafter_buffers: tuple | None = None                 # the drafter buffers the graphs were captured over

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


class BatchDecoder:
    """Greedy decoding of many prompts, `rows` at a time, with AR, DFlash or DDTree per row."""

    def __init__(self, target: Transformer, drafter: Drafter | None = None, settings: DecodeSettings = DecodeSettings(),
                 rows: int = 8, cuda_graphs: bool | None = None):
        if rows < 1:
            raise EngineError(f"rows (concurrency) must be >= 1, got {rows}")
        # the single-sequence decoder's settings checks, sizes, memory estimate and whether graphs can hold a round
        self.one = Decoder(target, drafter, settings, cuda_graphs=cuda_graphs, run_ahead=False)
        self.target, self.settings, self.rows = target, settings, rows
        self.drafter, self.block, self.nodes = self.one.drafter, self.one.block_size, self.one.nodes
        self.feature_layers = self.one.feature_layers
        self.cuda_graphs = self.one.cuda_graphs
        self.batch: _Batch | None = None  # kept between calls of the same size, and its graphs with it

    def check_fits(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """Refuse what cannot run (empty or out-of-vocabulary prompts, the position limit, memory for the rows of
        the longest request), before anything runs; the capacity per row."""
        if not prompts:
            raise EngineError("no prompts to decode")
        for p in prompts:
            self.one._check(p, max_new_tokens)
        capacity = self.one._capacity(max(len(p) for p in prompts), max_new_tokens)
        rows = min(self.rows, len(prompts))
        need, free = sum(self.one.round_bytes(capacity).values()) * rows, available_bytes(self.target.device)
        if free is not None and need > free:
            raise EngineError(f"{rows} rows of {capacity} tokens need about {gib(need)}; {self.target.device} has "
                              f"{gib(free)} available")
        return capacity

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> list[GenerationResult]:
        """Every prompt's greedy continuation, in the order given. A result's prefill_s is its time to first token
        from this call (waiting for a free row included), its decode_s the time from then to its last token;
        stage_ms are per round of the whole batch."""
        capacity = self.check_fits(prompts, max_new_tokens)
        target, dev, block = self.target, self.target.device, self.block
        rows = min(self.rows, len(prompts))
        stop = set(stop_ids)
        batch = self.batch
        if batch is None or batch.capacity < capacity or batch.rows != rows:
            width = len(self.feature_layers) * target.cfg.hidden_size
            batch = self.batch = _Batch(
                cache=target.new_cache(capacity, rows, own_lengths=True),
                tokens=torch.zeros(rows, capacity + block + 1, dtype=torch.long, device=dev),
                features=torch.zeros(rows, block, width, dtype=target.dtype, device=dev) if self.feature_layers
                else None,
                n_features=torch.zeros(rows, dtype=torch.long, device=dev),
                round_out=torch.zeros(rows, 1 + block, dtype=torch.long, device=dev))
        batch.cache.reset()
        batch.prompt_features.clear()
        if self.drafter is not None:
            self.drafter.start(0, batch.capacity, sequences=rows)
            # graphs over drafter buffers that another decoder's request re-allocated would read freed memory
            buffers = (getattr(self.drafter, "cache", None), getattr(self.drafter, "ranked_rows", None))
            if batch.drafter_buffers is None or any(a is not b for a, b in zip(buffers, batch.drafter_buffers)):
                batch.graphs.clear()
                batch.drafter_buffers = buffers
        queue = deque(enumerate(prompts))
        live: list[_Request | None] = [None] * rows
        results: list[GenerationResult | None] = [None] * len(prompts)
        timer = StageTimer(dev)
        n_rounds = 0

        def admit(first: int, count: int = 1) -> None:
            """The next `count` prompts into rows first .. first + count - 1: prefilled in one forward pass (each
            row causal over its own prompt, padded at the end to the longest: a real token never sees a pad, and
            a pad's cache slots lie past its row's committed length, overwritten by its first round), their first
            tokens, their draft contexts reset."""
            items = [queue.popleft() for _ in range(count)]
            view = batch.cache.rows(first, count)
            view.reset()  # new sequences: start 0, and a hybrid's recurrent state and conv window from zeros
            lengths = [len(p) for _, p in items]
            T = max(lengths)
            ids = torch.zeros(count, T, dtype=torch.long)
            for i, (_, prompt) in enumerate(items):
                ids[i, :len(prompt)] = torch.tensor(prompt)
            ids = ids.to(dev)
            causal = torch.ones(count, T, T, dtype=torch.bool, device=dev).tril()
            hidden, feats = target(ids, torch.arange(T, device=dev).expand(count, T), view, causal,
                                   self.feature_layers)
            view.keep_prefix(T)  # a hybrid's recurrent state and conv window (hybrids admit one prompt at a time)
            n = torch.tensor(lengths, device=dev)
            view.start.copy_(n)
            bonus = argmax(target.logits(hidden[torch.arange(count, device=dev), n - 1]))      # [count]
            span = slice(first, first + count)
            batch.tokens[span, :T] = ids
            batch.tokens[span].scatter_(1, n[:, None], bonus[:, None])
            bonus = bonus.tolist()
            for i, (_, prompt) in enumerate(items):
                if self.drafter is None:
                    continue
                self.drafter.reset_sequence(first + i, prompt)
                context = None if feats is None else feats[i, :lengths[i]]
                # the draft's prefill; a drafter without one reads the prompt's features in its next proposal
                if context is not None and self.drafter.prefill(context, row=first + i):
                    batch.n_features[first + i] = 0
                elif context is not None:
                    batch.prompt_features[first + i] = context
            sync(dev)
            now = time.perf_counter()
            for i, (index, prompt) in enumerate(items):
                live[first + i] = _Request(index, prompt, [bonus[i]], [], now - submitted, now)  # waiting included

        def admit_together(rows_free: int) -> None:
            """Fill rows 0 .. rows_free - 1 from the queue, prefilling neighbouring prompts together where padding
            at most doubles the work and the causal masks stay small; a hybrid target one prompt at a time (a pad
            would enter its recurrent state)."""
            row = 0
            while row < rows_free and queue:
                lengths = [len(p) for _, p in list(queue)[:rows_free - row]]
                count = 1
                while not target.cfg.hybrid and count < len(lengths):
                    group = lengths[:count + 1]
                    T = max(group)
                    if T * len(group) > 2 * sum(group) or len(group) * T * T > PREFILL_MASK_ENTRIES:
                        break
                    count += 1
                admit(row, count)
                row += count

        def finish(row: int) -> None:
            r = live[row]
            decode_s = time.perf_counter() - r.started
            results[r.index] = GenerationResult(r.out, r.accepted, {}, r.prefill_s, decode_s)
            live[row] = None

        def done(r: _Request) -> bool:
            return len(r.out) >= max_new_tokens or r.out[-1] in stop

        def pack(in_use: int) -> int:
            """Refill free rows from the queue; with the queue empty, move the last rows in use into the free ones.
            The number of rows in use."""
            for row in range(in_use):
                while live[row] is None and queue:
                    admit(row)  # rows free up one at a time, mostly
                    if done(live[row]):
                        finish(row)
            while in_use and live[in_use - 1] is None:
                in_use -= 1
            row = 0
            while row < in_use:
                if live[row] is None:  # the last row in use is live (trailing free rows were dropped)
                    self._move(batch, in_use - 1, row)
                    live[row], live[in_use - 1] = live[in_use - 1], None
                    while in_use and live[in_use - 1] is None:
                        in_use -= 1
                row += 1
            return in_use

        submitted = time.perf_counter()  # every request is submitted at once
        admit_together(rows)
        for row in range(rows):
            if done(live[row]):
                finish(row)
        in_use = pack(rows)
        while in_use:
            out = self._round(batch, in_use, timer)
            n_rounds += 1
            for row in range(in_use):
                r, a = live[row], int(out[row, 0])
                r.accepted.append(a)
                for t in out[row, 1:1 + a].tolist():  # up to the first stop token or the length limit
                    r.out.append(t)
                    if t in stop or len(r.out) == max_new_tokens:
                        break
                if done(r):
                    finish(row)
            in_use = pack(in_use)
        stage_ms = {k: v / max(1, n_rounds) for k, v in timer.totals_ms().items()}
        for r in results:
            r.stage_ms = stage_ms
        return results

    def _move(self, batch: _Batch, src: int, dst: int) -> None:
        """Row src's sequence becomes row dst's: its cache rows, tokens, features and draft state."""
        batch.cache.move_row(src, dst)
        batch.tokens[dst].copy_(batch.tokens[src])
        batch.n_features[dst] = batch.n_features[src]
        if batch.features is not None:
            batch.features[dst].copy_(batch.features[src])
        if self.drafter is not None:
            self.drafter.move_sequence(src, dst)
        if src in batch.prompt_features:
            batch.prompt_features[dst] = batch.prompt_features.pop(src)

    def _round(self, batch: _Batch, B: int, timer: StageTimer) -> torch.Tensor:
        """One round over rows 0 .. B-1: every row's accepted count and committed tokens, [B, 1 + block] on the
        host (the round's one host read)."""
        stages = self._stages(batch, B)
        eager = bool(batch.prompt_features) or not self.cuda_graphs
        replay = not eager and B in batch.graphs
        for name, stage in stages.items():
            with timer.stage(name):
                if replay:
                    batch.graphs[B][name].replay()
                else:
                    stage()
        out = batch.round_out[:B].cpu()
        if not eager and not replay:
            # This batch size's first round ran eagerly over the static buffers (kernels compiled, buffers
            # allocated): capture its stages now for the rounds to come (capturing runs nothing).
            batch.graphs[B] = self._capture(stages)
        return out

    _capture = staticmethod(capture_stages)  # the tests stand in for it on a CPU

    def _stages(self, batch: _Batch, B: int) -> dict:
        """The round's stages over rows 0 .. B-1, reading and writing the batch's buffers and the intermediates
        namespace of this batch size (which a captured graph's tensors stay referenced from)."""
        target, dev, block, nodes, s = self.target, self.target.device, self.block, self.nodes, self.settings
        if B not in batch.stages:  # built here, outside the stages: a capture may not copy host data to the device
            batch.stages[B] = SimpleNamespace(view=batch.cache.rows(0, B), chain=RoundTree.chain(nodes, dev))
        st = batch.stages[B]
        start = st.view.start

        def draft():
            feats = None if batch.features is None else batch.features[:B]  # a drafter that reads no features
            n_feats = batch.n_features[:B]
            if batch.prompt_features:  # a row admitted since the last round drafts from its whole prompt
                wide = max([block] + [f.shape[0] for f in batch.prompt_features.values()])
                feats = torch.cat((feats, feats.new_zeros(B, wide - block, feats.shape[-1])), dim=1)
                n_feats = n_feats.clone()
                for row, f in batch.prompt_features.items():
                    feats[row, :f.shape[0]] = f
                    n_feats[row] = f.shape[0]
                batch.prompt_features.clear()
            st.draft_logits = self.drafter.propose(DraftInput(batch.tokens[:B], start, feats, n_feats,
                                                                      self.one.draft_depth))

        def tree():
            if s.method == "dflash":
                chain = st.chain
                st.tree = RoundTree(argmax(st.draft_logits), chain.parents.expand(B, -1),
                                    chain.depths.expand(B, -1), chain.visible.expand(B, -1, -1),
                                    chain.n_nodes.expand(B))
            else:
                k = min(s.budget, s.topk_cap, st.draft_logits.shape[-1])
                D = st.draft_logits.shape[1]
                logp, ids = topk_logprobs(st.draft_logits.reshape(B * D, -1), k)
                st.tree = RoundTree(*build_tree(logp.view(B, D, k), ids.view(B, D, k), s.budget))

        def verify():
            if self.drafter is None:  # AR: the round verifies the bonus token alone
                empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
                st.tree = RoundTree(empty, empty, empty, torch.ones(B, 1, 1, dtype=torch.bool, device=dev),
                                    torch.zeros(B, dtype=torch.long, device=dev))
            bonus = batch.tokens[:B].gather(1, start[:, None])
            st.verify_ids = torch.cat((bonus, st.tree.tokens), dim=1)                   # [B, 1 + nodes]
            positions = start[:, None] + torch.cat((torch.zeros_like(bonus), st.tree.depths), dim=1)
            schedule = None  # a hybrid's Gated DeltaNet layers: a chain shared by the rows (AR, DFlash), or each tree
            if target.cfg.hybrid and s.method == "ddtree" and self.drafter is not None:
                schedule = [tree_schedule(torch.cat((start.new_full((1,), -1), p)), v, 1 + nodes,
                                          target.cfg.linear_conv_kernel, dev, max_depth=max(1, block - 1))
                            for p, v in zip(st.tree.parents, st.tree.visible)]
            hidden, st.verify_features = target(st.verify_ids, positions, st.view, st.tree.visible,
                                                self.feature_layers, schedule)
            st.posterior = argmax(target.logits(hidden))                                  # [B, 1 + nodes]

        def commit():
            t = st.tree
            path, accepted, new_bonus = walk_tree(st.posterior, t.tokens, t.parents, t.n_nodes, block - 1)
            st.view.keep(path, accepted)
            # committed tokens: the accepted nodes', then the bonus (entries past `accepted` are padding)
            new = torch.cat((st.verify_ids.gather(1, path[:, 1:]), torch.zeros_like(accepted)[:, None]), dim=1)
            new.scatter_(1, (accepted - 1)[:, None], new_bonus[:, None])
            batch.tokens[:B].scatter_(1, start[:, None] + torch.arange(1, block + 1, device=dev), new)
            if batch.features is not None:
                width = batch.features.shape[-1]
                batch.features[:B].copy_(st.verify_features.gather(1, path[..., None].expand(-1, -1, width)))
                batch.n_features[:B].copy_(accepted)
            start.add_(accepted)
            batch.round_out[:B, 0].copy_(accepted)
            batch.round_out[:B, 1:].copy_(new)

        if self.drafter is None:
            return {"verify": verify, "commit": commit}
        return {"draft": draft, "tree": tree, "verify": verify, "commit": commit}
