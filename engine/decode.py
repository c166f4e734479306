"""Greedy decoding three ways, one loop: autoregressive, DFlash (a verified chain) and DDTree (a verified tree).

Every round verifies [bonus token, draft nodes...] in one target pass, walks the target's greedy choices
through the draft, keeps the accepted cache rows and one new bonus token. AR is the round with no draft nodes;
DFlash verifies the draft's argmax chain; DDTree verifies a best-first tree. A round is four stages (draft,
tree, verify, commit) that only touch device tensors of fixed shapes, so on a GPU each stage is captured once
as a CUDA graph and replayed; the host reads one small tensor per round (how many tokens were accepted, and
which) to decide when to stop, while the next round already runs on the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kernels import triton_disabled
from kernels.topk import topk_logprobs
from kernels.tree_ops import build_tree, compact_kv, walk_tree

from .draft import DraftInput, Drafter
from .errors import EngineError
from .model import Transformer
from .timing import StageTimer, sync

METHODS = ("ar", "dflash", "ddtree")
STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class GenerationResult:
    tokens: list[int]                 # generated ids, prompt excluded
    acceptance_lengths: list[int]     # per round: accepted draft tokens + the bonus token
    stage_ms: dict[str, float]        # milliseconds per round, per stage
    prefill_s: float                  # time to first token
    decode_s: float                   # time of the rounds after the first token
    margins: list[float] | None = field(default=None, repr=False)  # top-1 minus top-2 logit per token

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, self.rounds)

    @property
    def tok_s(self) -> float:
        """Decode throughput: tokens generated after the first one over the decode time."""
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class DecodeSettings:
    method: str = "ar"
    budget: int = 15        # DDTree: draft nodes per round
    topk_cap: int = 8       # DDTree: candidates per depth

    def validate(self, drafter: Drafter | None) -> None:
        if self.method not in METHODS:
            raise EngineError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.budget < 0:
            raise EngineError(f"budget must be >= 0, got {self.budget}")
        if self.topk_cap < 1:
            raise EngineError(f"topk_cap must be >= 1, got {self.topk_cap}")
        if self.method != "ar":
            if drafter is None:
                raise EngineError(f"method {self.method} needs a draft (--draft)")
            if drafter.block_size < 2:
                raise EngineError(f"block size must be >= 2 for {self.method}, got {drafter.block_size}")


@dataclass
class RoundTree:
    """Draft nodes of one round on the device, padded to a fixed count: node i+1 has tokens[i], parents[i]
    (an index into [root, nodes]) and depths[i]; visible is the ancestor-or-self mask over [root, nodes]."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    visible: torch.Tensor
    count: torch.Tensor

    @classmethod
    def chain(cls, n: int, device) -> "RoundTree":
        """A linear block of n nodes; DFlash fills in the tokens."""
        ar = torch.arange(n + 1, device=device)
        return cls(torch.zeros(n, dtype=torch.long, device=device), ar[:-1].clone(), ar[1:].clone(),
                   torch.ones(n + 1, n + 1, dtype=torch.bool, device=device).tril(),
                   torch.tensor(n, device=device))


class Decoder:
    """Greedy decoding of one target with an optional drafter; CUDA graphs on a GPU."""

    def __init__(self, target: Transformer, drafter: Drafter | None = None, settings: DecodeSettings = DecodeSettings(),
                 cuda_graphs: bool | None = None, run_ahead: bool | None = None):
        settings.validate(drafter)
        self.target, self.settings = target, settings
        self.speculative = settings.method != "ar" and not (settings.method == "ddtree" and settings.budget == 0)
        self.drafter = drafter if self.speculative else None
        self.block = drafter.block_size if self.speculative else 1
        self.nodes = 0 if not self.speculative else self.block - 1 if settings.method == "dflash" else settings.budget
        self.capture = tuple(drafter.feature_layers) if self.speculative else ()
        on_gpu = target.device.type == "cuda"
        # The PyTorch references read lengths on the host, so graphs need the Triton kernels.
        graphable = (not self.speculative or drafter.graphable) and not triton_disabled()
        self.cuda_graphs = (on_gpu and graphable) if cuda_graphs is None else (cuda_graphs and on_gpu and graphable)
        self.capacity = 0
        self.graphs: dict[str, torch.cuda.CUDAGraph] | None = None
        self.graphed_drafter_cache = None  # the drafter buffers the graphs were captured over
        # one round in flight ahead of the host (None: on a GPU; on a CPU it only costs a round at stop tokens)
        self.run_ahead = on_gpu if run_ahead is None else run_ahead

    # ------------------------------------------------------------------------------------------------ buffers

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // 256) * 256  # round up: fewer re-allocations (and graph captures)
        dev, B = self.target.device, self.block
        self.capacity = capacity
        self.cache = self.target.new_cache(capacity)
        self.tokens = torch.zeros(1, capacity + B + 1, dtype=torch.long, device=dev)
        self.round_out = torch.zeros(1 + B, dtype=torch.long, device=dev)   # [accepted, new tokens...]
        self.host_out = torch.zeros(2, 1 + B, dtype=torch.long, pin_memory=dev.type == "cuda")  # read by the host
        self.out_ready = [torch.cuda.Event() for _ in range(2)] if dev.type == "cuda" else None
        self.count = torch.zeros((), dtype=torch.long, device=dev)
        width = len(self.capture) * self.target.cfg.hidden_size
        self.features = torch.zeros(1, B, width, dtype=self.target.dtype, device=dev) if self.capture else None
        self.offsets = torch.arange(B + 1, device=dev)
        self.zero = torch.zeros(1, dtype=torch.long, device=dev)
        self.tree = RoundTree.chain(self.nodes, dev)   # AR: no nodes; DFlash: the chain; DDTree: replaced per round
        self.graphs = None

    def _check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        cfg = self.target.cfg
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise EngineError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        if len(prompt_ids) + max_new_tokens > cfg.max_position:
            raise EngineError(f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                              f"the target's position limit of {cfg.max_position}")

    # ------------------------------------------------------------------------------------------------ stages

    def _stage_draft(self) -> None:
        self.draft_logits = self.drafter.propose(self.draft_input)

    def _stage_tree(self) -> None:
        if self.settings.method == "dflash":
            self.tree.tokens.copy_(self.draft_logits.argmax(-1))
            return
        k = min(self.settings.budget, self.settings.topk_cap, self.draft_logits.shape[-1])
        logp, ids = topk_logprobs(self.draft_logits, k)
        self.tree = RoundTree(*build_tree(logp, ids, self.settings.budget))

    def _stage_verify(self) -> None:
        tree, start = self.tree, self.cache.start
        bonus = self.tokens[0].index_select(0, start.view(1))
        self.verify_ids = torch.cat((bonus, tree.tokens))
        positions = start + torch.cat((self.zero, tree.depths))
        hidden, self.verify_features = self.target(self.verify_ids[None], positions[None], self.cache, tree.visible,
                                                   self.capture)
        self.verify_logits = self.target.logits(hidden[0])
        self.posterior = self.verify_logits.argmax(-1)

    def _stage_commit(self) -> None:
        tree, cache, B = self.tree, self.cache, self.block
        self.path, accepted, bonus = walk_tree(self.posterior, tree.tokens, tree.parents, tree.count, B - 1)
        compact_kv(cache.k, cache.v, cache.start, self.path, accepted)
        # New tokens: the accepted nodes' tokens, then the bonus (entries past `accepted` are padding).
        new = torch.cat((self.verify_ids.index_select(0, self.path[1:]), self.zero))
        new.index_copy_(0, (accepted - 1).view(1), bonus.view(1))
        self.tokens[0].index_copy_(0, cache.start + 1 + self.offsets[:B], new)
        if self.capture:
            self.features[0].copy_(self.verify_features[0].index_select(0, self.path))
            self.count.copy_(accepted)
        cache.start.add_(accepted)
        self.round_out.copy_(torch.cat((accepted.view(1), new)))

    def _stages(self) -> dict:
        stages = {"verify": self._stage_verify, "commit": self._stage_commit}
        if self.speculative:
            stages = {"draft": self._stage_draft, "tree": self._stage_tree, **stages}
        return stages

    def _capture(self) -> None:
        """Record each stage once as a CUDA graph over the static buffers (after an eager warm-up round)."""
        pool = torch.cuda.graph_pool_handle()
        self.graphs = {}
        self.graphed_drafter_cache = getattr(self.drafter, "cache", None)
        for name, stage in self._stages().items():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                stage()
            self.graphs[name] = graph

    # ------------------------------------------------------------------------------------------------ decode

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids=(), record_margins: bool = False
                 ) -> GenerationResult:
        self._check(prompt_ids, max_new_tokens)
        target, dev = self.target, self.target.device
        stop = set(stop_ids)
        n_prompt = len(prompt_ids)
        needed = n_prompt + max_new_tokens + 2 * (self.nodes + self.block) + 1  # room for a round run ahead
        if needed > self.capacity:
            self._allocate(needed)
        self.cache.reset()
        if self.speculative:
            self.drafter.start(n_prompt, self.capacity)
            # Decoders may share a drafter, and another's longer request may have re-allocated its buffers since
            # this one captured its graphs: graphs over the old buffers would read freed memory.
            if getattr(self.drafter, "cache", None) is not self.graphed_drafter_cache:
                self.graphs = None
        use_graphs = self.cuda_graphs and not record_margins
        timer = StageTimer(dev)
        margins: list[float] = []

        sync(dev)
        t0 = time.perf_counter()
        prompt = torch.tensor(prompt_ids, device=dev)
        self.tokens[0, :n_prompt] = prompt
        causal = torch.ones(n_prompt, n_prompt, dtype=torch.bool, device=dev).tril()
        hidden, features = target(prompt[None], torch.arange(n_prompt, device=dev)[None], self.cache, causal,
                                  self.capture)
        self.cache.start.fill_(n_prompt)
        logits = target.logits(hidden[0, -1:])
        bonus = logits.argmax(-1)
        self.tokens[0, n_prompt] = bonus[0]
        out, accepted_lengths = [int(bonus)], []
        if record_margins:
            margins += _margins(logits)
        sync(dev)
        t1 = time.perf_counter()

        if self.speculative:  # the first round reads the prompt's features; later rounds the static buffer
            self.draft_input = DraftInput(self.tokens, self.cache.start, features,
                                          torch.tensor(n_prompt, device=dev))
        # On a GPU the host reads a round's result (accepted count and tokens) through a pinned double buffer
        # while the next round already runs: once the graphs exist, one round is in flight ahead of the host, so
        # the GPU does not wait for Python between rounds. Every round commits at least one token, so no round is
        # launched that the length limit makes useless; one past a stop token is simply not read.
        run_ahead = self.run_ahead and not record_margins
        launched, pending = 0, []
        done = len(out) >= max_new_tokens or out[-1] in stop
        while not done:
            # Round 0 reads the prompt's features, round 1 warms up the static buffers, then graphs take over.
            if use_graphs and launched == 2 and self.graphs is None:
                self._capture()
            replay = use_graphs and launched >= 1 and self.graphs is not None
            for name, stage in self._stages().items():
                with timer.stage(name):
                    if replay:
                        self.graphs[name].replay()
                    else:
                        stage()
            if self.speculative and launched == 0:
                self.draft_input = DraftInput(self.tokens, self.cache.start, self.features, self.count)
            slot = launched % 2
            self.host_out[slot].copy_(self.round_out, non_blocking=True)
            if self.out_ready is not None:
                self.out_ready[slot].record()
            pending.append(slot)
            launched += 1
            while pending and not done:
                ahead_ok = run_ahead and launched > 2 and len(out) + len(pending) < max_new_tokens
                if len(pending) <= (1 if ahead_ok else 0):  # (none in flight before the graphs are captured)
                    break
                slot = pending.pop(0)
                if self.out_ready is not None:
                    self.out_ready[slot].synchronize()  # the round's one host synchronisation
                result = self.host_out[slot].tolist()
                accepted, new = result[0], result[1:1 + result[0]]
                accepted_lengths.append(accepted)
                if record_margins:
                    margins += _margins(self.verify_logits.index_select(0, self.path[:accepted]))
                for t in new:  # commit up to the first stop token or the length limit
                    out.append(t)
                    if t in stop or len(out) == max_new_tokens:
                        break
                done = len(out) >= max_new_tokens or out[-1] in stop
        sync(dev)
        t2 = time.perf_counter()
        per_round = max(1, launched)  # the stage timer saw every launched round
        stage_ms = {k: v / per_round for k, v in timer.totals_ms().items()}
        return GenerationResult(out, accepted_lengths, stage_ms, t1 - t0, t2 - t1,
                                margins[:len(out)] if record_margins else None)


def _margins(logits: torch.Tensor) -> list[float]:
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()
