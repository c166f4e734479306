"""Greedy decoding three ways, one loop: autoregressive, DFlash (a verified chain) and DDTree (a verified tree).

Every round verifies [bonus token, draft nodes...] in one target pass, walks the target's greedy choices
through the draft, keeps the accepted cache rows and one new bonus token. AR is the round with no draft nodes;
DFlash verifies the draft's argmax chain; DDTree verifies a best-first tree. A round is four stages that only
touch device tensors of fixed shapes, so on a GPU each stage is captured once as a CUDA graph and replayed; the
host reads one small tensor per round (how many tokens were accepted, and which) to decide when to stop, while
the next round already runs on the device (docs/design.md, "The decode round").

What each stage reads and writes (`Sequence`: the sequence's buffers, `Round`: what a round's stages hand on):

    stage    reads                                                writes
    draft    draft_input (Sequence.tokens, cache.start, features) Round.draft_logits
    tree     Round.draft_logits                                   Round.tree
    verify   Round.tree, Sequence.tokens, cache                   Round.verify_ids/_logits/_features, posterior;
                                                                  the nodes' cache rows
    commit   Round.tree, posterior, verify_ids, verify_features   Round.path; cache (the accepted path kept, start),
                                                                  tokens, features, n_features, round_out
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from kernels import triton_disabled
from kernels.argmax import argmax
from kernels.gated_delta import tree_schedule
from kernels.topk import topk_logprobs
from kernels.tree_attention import MAX_TRITON_T
from kernels.tree_ops import build_tree, commit_tokens, walk_tree

from .cache import ModelCache
from .draft import DraftInput, Drafter
from .errors import EngineError
from .memory import available_bytes, gib
from .model import Transformer
from .plant import planted_slowdown
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

    @property
    def speculative(self) -> bool:
        """A drafter proposes: not AR, nor DDTree with a budget of 0 (a tree of no nodes, which is AR)."""
        return self.method != "ar" and not (self.method == "ddtree" and self.budget == 0)

    def validate(self, drafter: Drafter | None) -> None:
        if self.method not in METHODS:
            raise EngineError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.budget < 0:
            raise EngineError(f"budget must be >= 0, got {self.budget}")
        if self.topk_cap < 1:
            raise EngineError(f"topk_cap must be >= 1, got {self.topk_cap}")
        if self.speculative:
            if drafter is None:
                raise EngineError(f"method {self.method} needs a draft (--draft)")
            if drafter.block_size < 2:
                raise EngineError(f"block size must be >= 2 for {self.method}, got {drafter.block_size}")


def draft_depth(method: str, budget: int, block_size: int) -> int | None:
    """The draft positions a round reads: a DDTree of budget b reaches depth b, so a smaller budget than the block
    needs the draft's LM head over b positions only (DraftInput.depth); None: the whole block."""
    return budget if method == "ddtree" and 0 < budget < block_size - 1 else None


def capture_stages(stages: dict) -> dict:
    """Each stage of a round recorded once as a CUDA graph (capturing runs nothing), all in one memory pool: the
    stages run one after another, so one's temporaries can reuse another's."""
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for name, stage in stages.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            stage()
        graphs[name] = graph
    return graphs


@dataclass
class RoundTree:
    """Draft nodes of one round on the device, padded to a fixed number: node i+1 has tokens[i], parents[i]
    (an index into [root, nodes]) and depths[i]; visible is the ancestor-or-self mask over [root, nodes];
    n_nodes (0-d) counts the real nodes."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    visible: torch.Tensor
    n_nodes: torch.Tensor

    @classmethod
    def chain(cls, n: int, device) -> "RoundTree":
        """A linear block of n nodes; DFlash fills in the tokens."""
        ar = torch.arange(n + 1, device=device)
        return cls(torch.zeros(n, dtype=torch.long, device=device), ar[:-1].clone(), ar[1:].clone(),
                   torch.ones(n + 1, n + 1, dtype=torch.bool, device=device).tril(),
                   torch.tensor(n, device=device))


@dataclass
class Sequence:
    """The device state of the sequence being decoded, allocated once per capacity: CUDA graphs are captured over
    these tensors. Batch dimensions are kept (batch 1 today)."""
    cache: ModelCache
    tokens: torch.Tensor             # [1, capacity + block + 1]: prompt and committed ids, then the next bonus token
    features: torch.Tensor | None    # [1, block, F]: context features of the tokens the last round committed
    n_features: torch.Tensor         # 0-d: how many rows of `features` are real (the last round's commit)
    round_out: torch.Tensor          # [1 + block]: the last round's accepted count, then its committed tokens
    host_out: torch.Tensor           # [2, 1 + block] (pinned on a GPU): round_out copied for the host, two slots
    out_ready: list | None           # a CUDA event per host_out slot (None on a CPU)
    zero: torch.Tensor               # [0]


@dataclass
class Round:
    """What one round's stages hand on to the next (see the module's table)."""
    tree: RoundTree                              # the nodes to verify: fixed for AR and DFlash, built for DDTree
    draft_logits: torch.Tensor | None = None     # [block - 1, vocab]
    verify_ids: torch.Tensor | None = None       # [1 + nodes]: the root (the bonus token), then the nodes' tokens
    verify_logits: torch.Tensor | None = None    # [1 + nodes, vocab] float32
    verify_features: torch.Tensor | None = None  # [1, 1 + nodes, F]: context features of every verified row
    posterior: torch.Tensor | None = None        # [1 + nodes]: the target's greedy token after each row
    path: torch.Tensor | None = None             # [block]: the accepted rows, root first, padded with 0


class Decoder:
    """Greedy decoding of one target with an optional drafter; CUDA graphs on a GPU."""

    def __init__(self, target: Transformer, drafter: Drafter | None = None, settings: DecodeSettings = DecodeSettings(),
                 cuda_graphs: bool | None = None, run_ahead: bool | None = None):
        settings.validate(drafter)
        target.fold_norms()  # before the first pass: two kernels fewer a layer where the target allows it
        self.target, self.settings = target, settings
        self.speculative = settings.speculative
        self.drafter = drafter if self.speculative else None
        self.block_size = drafter.block_size if self.speculative else 1
        self.nodes = 0 if not self.speculative else self.block_size - 1 if settings.method == "dflash" \
            else settings.budget
        self.feature_layers = tuple(drafter.feature_layers) if self.speculative else ()
        self.draft_depth = draft_depth(settings.method, settings.budget, self.block_size)
        on_gpu = target.device.type == "cuda"
        # The PyTorch references read lengths on the host, so graphs need the Triton kernels, and tree attention
        # has its kernel up to MAX_TRITON_T verified rows (a larger DDTree budget runs eagerly).
        graphable = ((not self.speculative or drafter.graphable) and not triton_disabled()
                     and 1 + self.nodes <= MAX_TRITON_T)
        self.cuda_graphs = (on_gpu and graphable) if cuda_graphs is None else (cuda_graphs and on_gpu and graphable)
        # one round in flight ahead of the host (None: on a GPU; on a CPU it only costs a round at stop tokens)
        self.run_ahead = on_gpu if run_ahead is None else run_ahead
        self.capacity = 0
        self.seq: Sequence | None = None
        self.round: Round | None = None
        self.chain_schedule = None  # a hybrid target's schedule of the AR / DFlash verify chain
        self.draft_input: DraftInput | None = None
        self.graphs: dict[str, torch.cuda.CUDAGraph] | None = None
        self.graphed_drafter_cache = None  # the drafter buffers the graphs were captured over

    # ------------------------------------------------------------------------------------------------ buffers

    def round_bytes(self, capacity: int) -> dict[str, int]:
        """An estimate of the memory a request of `capacity` tokens takes, by part: the target's cache, the verify
        pass (logits, MLP activations, attention scores, the node mask), a hybrid's recurrent rows and the draft
        (logits, its cache)."""
        cfg, dtype_size = self.target.cfg, self.target.dtype.itemsize
        rows = 1 + self.nodes
        parts = dict(
            cache=2 * cfg.num_layers * self.target.num_kv_heads * cfg.head_dim * capacity * dtype_size,
            verify=rows * (2 * cfg.vocab_size * 4 + 3 * cfg.intermediate_size * dtype_size
                           + cfg.num_heads * capacity * 4) + rows * rows)
        if cfg.hybrid:
            # Each Gated DeltaNet layer keeps its rows' projection output (conv input, z, a, b) and conv output for
            # commit. No per-row state is stored on a GPU (the kernel keeps states on chip); the CPU reference holds
            # every row's state of one layer at a time.
            linear = cfg.layer_types.count("linear_attention")
            heads, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            channels = 2 * cfg.linear_num_key_heads * dk + heads * dv
            parts["recurrent"] = linear * rows * (2 * channels + heads * (dv + 2)) * dtype_size
            if self.target.device.type != "cuda":
                parts["recurrent"] += 4 * heads * (rows + 1) * dk * dv
        if self.speculative:
            draft = getattr(self.drafter, "draft", None)
            draft_cache = 0 if draft is None else 2 * draft.dcfg.layers.num_layers * draft.dcfg.layers.num_kv_heads \
                * draft.dcfg.layers.head_dim * (capacity + self.block_size) * dtype_size  # (DFlashDrafter.start)
            parts["draft"] = 3 * (self.block_size - 1) * cfg.vocab_size * 4 + draft_cache
        return parts

    def _capacity(self, n_prompt: int, max_new_tokens: int) -> int:
        """Cache slots a request needs: room for one round run ahead past the length limit, rounded up (fewer
        re-allocations and graph captures)."""
        needed = n_prompt + max_new_tokens + 2 * (self.nodes + self.block_size) + 1
        return -(-needed // 256) * 256

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Refuse a request that the position limit or the device's memory cannot hold, with the numbers, before
        anything runs or is allocated."""
        cfg = self.target.cfg
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if n_prompt + max_new_tokens > cfg.max_position:
            raise EngineError(f"prompt ({n_prompt} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                              f"the target's position limit of {cfg.max_position}")
        capacity = self._capacity(n_prompt, max_new_tokens)
        if capacity <= self.capacity:
            return  # already allocated
        parts = self.round_bytes(capacity)
        need, free = sum(parts.values()), available_bytes(self.target.device)
        if free is not None and need > free:
            what = ", ".join(f"{name} {gib(n)}" for name, n in parts.items())
            raise EngineError(f"{self.settings.method} with {self.nodes} draft nodes per round, block size "
                              f"{self.block_size} and {capacity} tokens of cache needs about {gib(need)} ({what}); "
                              f"{self.target.device} has {gib(free)} available")

    def _allocate(self, capacity: int) -> None:
        dev, block = self.target.device, self.block_size
        self.capacity = capacity
        width = len(self.feature_layers) * self.target.cfg.hidden_size
        self.seq = Sequence(
            cache=self.target.new_cache(capacity),
            tokens=torch.zeros(1, capacity + block + 1, dtype=torch.long, device=dev),
            features=torch.zeros(1, block, width, dtype=self.target.dtype, device=dev) if self.feature_layers
            else None,
            n_features=torch.zeros((), dtype=torch.long, device=dev),
            round_out=torch.zeros(1 + block, dtype=torch.long, device=dev),
            host_out=torch.zeros(2, 1 + block, dtype=torch.long, pin_memory=dev.type == "cuda"),
            out_ready=[torch.cuda.Event() for _ in range(2)] if dev.type == "cuda" else None,
            zero=torch.zeros(1, dtype=torch.long, device=dev))
        # AR: no nodes; DFlash: the chain, its tokens filled in per round; DDTree: replaced per round
        self.round = Round(RoundTree.chain(self.nodes, dev))
        # AR and DFlash verify the same chain every round: its Gated DeltaNet schedule is built once
        self.chain_schedule = self._tree_schedule(self.round.tree) if self.target.cfg.hybrid else None
        self.graphs = None

    def _tree_schedule(self, tree: "RoundTree"):
        """How Gated DeltaNet layers run the verify rows: each row from its parent's state (the root's: the committed
        state)."""
        cfg, zero = self.target.cfg, self.seq.zero
        return tree_schedule(torch.cat((zero - 1, tree.parents)), tree.visible, 1 + self.nodes, cfg.linear_conv_kernel,
                             zero.device, max_depth=max(1, self.block_size - 1))

    def _check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        vocab = self.target.cfg.vocab_size
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.check_fits(len(prompt_ids), max_new_tokens)

    # ------------------------------------------------------------------------------------------------ stages

    def _stage_draft(self) -> None:
        self.round.draft_logits = self.drafter.propose(self.draft_input)

    def _stage_tree(self) -> None:
        r = self.round
        if self.settings.method == "dflash":
            r.tree.tokens.copy_(argmax(r.draft_logits))
            return
        k = min(self.settings.budget, self.settings.topk_cap, r.draft_logits.shape[-1])
        logp, ids = topk_logprobs(r.draft_logits, k)
        r.tree = RoundTree(*build_tree(logp, ids, self.settings.budget))

    def _stage_verify(self) -> None:
        s, r = self.seq, self.round
        schedule = self.chain_schedule
        if self.target.cfg.hybrid and self.settings.method == "ddtree":
            schedule = self._tree_schedule(r.tree)
        # [bonus, nodes...] at positions start + [0, depths...]
        r.verify_ids, hidden, r.verify_features = self.target.verify(
            s.tokens[0], r.tree.tokens, r.tree.depths, r.tree.visible, s.cache, self.feature_layers, schedule)
        r.verify_logits = self.target.logits(hidden[0])
        r.posterior = argmax(r.verify_logits)

    def _stage_commit(self) -> None:
        s, r, block = self.seq, self.round, self.block_size
        cache = s.cache
        r.path, accepted, bonus = walk_tree(r.posterior, r.tree.tokens, r.tree.parents, r.tree.n_nodes, block - 1)
        if self.nodes or cache.recurrent:  # AR's one row is already in place; a hybrid's recurrent state moves on
            cache.keep(r.path, accepted)
        if self.feature_layers:
            torch.index_select(r.verify_features[0], 0, r.path, out=s.features[0])
        # the accepted nodes' tokens and the bonus into tokens and round_out, start += accepted: one kernel
        commit_tokens(r.path, accepted, bonus, r.verify_ids, cache.start, s.tokens[0], s.round_out,
                      s.n_features if self.feature_layers else None)

    def _stages(self) -> dict:
        stages = {"verify": self._stage_verify, "commit": self._stage_commit}
        if self.speculative:
            stages = {"draft": self._stage_draft, "tree": self._stage_tree, **stages}
        return stages

    def _capture_graphs(self) -> None:
        """Record each stage once as a CUDA graph over the static buffers (after an eager warm-up round)."""
        self.graphed_drafter_cache = getattr(self.drafter, "cache", None)
        self.graphs = capture_stages(self._stages())
        self.captured_round = replace(self.round)  # the tensors the graphs write

    # ------------------------------------------------------------------------------------------------ decode

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids=(), record_margins: bool = False
                 ) -> GenerationResult:
        self._check(prompt_ids, max_new_tokens)
        target, dev = self.target, self.target.device
        stop = set(stop_ids)
        n_prompt = len(prompt_ids)
        if self._capacity(n_prompt, max_new_tokens) > self.capacity:
            self._allocate(self._capacity(n_prompt, max_new_tokens))
        s = self.seq
        s.cache.reset()
        if self.speculative:
            self.drafter.start(n_prompt, self.capacity)
            # Decoders may share a drafter, and another's longer request may have re-allocated its buffers since
            # this one captured its graphs: graphs over the old buffers would read freed memory.
            if getattr(self.drafter, "cache", None) is not self.graphed_drafter_cache:
                self.graphs = None
        use_graphs = self.cuda_graphs  # with margins too: the host reads each round's logits before the next launch
        timer = StageTimer(dev)
        margins: list[float] = []

        sync(dev)
        t0 = time.perf_counter()
        prompt = torch.tensor(prompt_ids, device=dev)
        s.tokens[0, :n_prompt] = prompt
        causal = torch.ones(n_prompt, n_prompt, dtype=torch.bool, device=dev).tril()
        hidden, prompt_features = target(prompt[None], torch.arange(n_prompt, device=dev)[None], s.cache, causal,
                                         self.feature_layers)
        s.cache.keep_prefix(n_prompt)
        s.cache.start.fill_(n_prompt)
        logits = target.logits(hidden[0, -1:])
        bonus = argmax(logits)
        s.tokens[0, n_prompt] = bonus[0]
        out, accepted_lengths = [int(bonus)], []
        if record_margins:
            margins += _margins(logits)
        # The draft's prefill: where the drafter takes the prompt's context now, every round drafts from the
        # static buffers (round 0 with no context rows); else round 0 reads the prompt's features.
        drafted_prompt = self.speculative and prompt_features is not None and self.drafter.prefill(prompt_features[0])
        if drafted_prompt:
            s.n_features.zero_()
            self.draft_input = DraftInput(s.tokens, s.cache.start, s.features, s.n_features, self.draft_depth)
        elif self.speculative:
            self.draft_input = DraftInput(s.tokens, s.cache.start, prompt_features,
                                          torch.tensor(n_prompt, device=dev), self.draft_depth)
        sync(dev)
        t1 = time.perf_counter()

        # On a GPU the host reads a round's result (accepted count and tokens) through a pinned double buffer
        # while the next round already runs: once the graphs exist, one round is in flight ahead of the host, so
        # the GPU does not wait for Python between rounds. Every round commits at least one token, so no round is
        # launched that the length limit makes useless; one past a stop token is simply not read.
        run_ahead = self.run_ahead and not record_margins  # margins read this round's logits buffer
        launched, pending = 0, []
        done = len(out) >= max_new_tokens or out[-1] in stop
        plant = planted_slowdown(dev)  # ENGINE_PLANT_SLOWDOWN: the perf gate's calibrated test regression
        while not done:
            # The first call runs rounds 0 and 1 eagerly (round 1 warms up the static buffers), then captures the
            # graphs. From then on every round replays them, round 0 too, but for its draft where the drafter took
            # no prefill: that reads the prompt's features, a shape of its own, so it runs eagerly and its logits go
            # into the buffer the graphs read.
            if use_graphs and launched == 2 and self.graphs is None:
                self._capture_graphs()
            replay = use_graphs and self.graphs is not None
            if replay:  # an eager round re-points the fields; the host reads what graphs write
                self.round = replace(self.captured_round)
            for name, stage in self._stages().items():
                with timer.stage(name):
                    if replay and not (name == "draft" and launched == 0 and not drafted_prompt):
                        self.graphs[name].replay()
                    else:
                        stage()
                        if replay:
                            self.round.draft_logits = self.captured_round.draft_logits.copy_(self.round.draft_logits)
            if self.speculative and launched == 0 and not drafted_prompt:
                self.draft_input = DraftInput(s.tokens, s.cache.start, s.features, s.n_features, self.draft_depth)
            slot = launched % 2
            s.host_out[slot].copy_(s.round_out, non_blocking=True)
            if s.out_ready is not None:
                s.out_ready[slot].record()
            pending.append(slot)
            launched += 1
            if plant is not None:
                plant.after_round()
            while pending and not done:
                ahead_ok = run_ahead and launched > 2 and len(out) + len(pending) < max_new_tokens
                if len(pending) <= (1 if ahead_ok else 0):  # (none in flight before the graphs are captured)
                    break
                slot = pending.pop(0)
                if s.out_ready is not None:
                    s.out_ready[slot].synchronize()  # the round's one host synchronisation
                result = s.host_out[slot].tolist()
                accepted, new = result[0], result[1:1 + result[0]]
                accepted_lengths.append(accepted)
                if record_margins:
                    margins += _margins(self.round.verify_logits.index_select(0, self.round.path[:accepted]))
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
