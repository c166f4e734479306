"""Greedy decoding three ways, one loop: autoregressive, DFlash (a verified chain) and DDTree (a verified tree).

Every round verifies [bonus token, draft nodes...] in one target pass, walks the target's greedy choices
through the draft, commits the accepted rows of the cache and one new bonus token. Autoregressive decoding is
the round with no draft nodes; DFlash verifies the draft's argmax chain; DDTree verifies a best-first tree.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .draft import DraftInput, Drafter
from .errors import EngineError
from .model import Transformer
from .timing import StageTimer, sync
from .tree import DraftTree, build_tree, chain

METHODS = ("ar", "dflash", "ddtree")


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


def causal_mask(prefix: int, local: torch.Tensor) -> torch.Tensor:
    """[T, prefix + T] mask: every new token sees the committed prefix, and the new tokens `local` allows."""
    t = local.shape[0]
    return torch.cat((torch.ones(t, prefix, dtype=torch.bool, device=local.device), local), dim=1)


class Decoder:
    """Greedy decoding of one target with an optional drafter."""

    def __init__(self, target: Transformer, drafter: Drafter | None = None, settings: DecodeSettings = DecodeSettings()):
        settings.validate(drafter)
        self.target, self.drafter, self.settings = target, drafter, settings
        self.speculative = settings.method != "ar" and not (settings.method == "ddtree" and settings.budget == 0)
        self.capture = tuple(drafter.feature_layers) if self.speculative else ()
        self._cache = None

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

    def _draft_tree(self, tokens: torch.Tensor, features, timer: StageTimer) -> DraftTree:
        if not self.speculative:
            return DraftTree([], [], [])
        with timer.stage("draft"):
            logits = self.drafter.propose(DraftInput(tokens, features))
        with timer.stage("tree"):
            if self.settings.method == "dflash":
                return chain(logits.argmax(-1).tolist())
            return build_tree(logits, self.settings.budget, self.settings.topk_cap)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids=(), record_margins: bool = False
                 ) -> GenerationResult:
        self._check(prompt_ids, max_new_tokens)
        target, dev = self.target, self.target.device
        stop = set(stop_ids)
        n_prompt = len(prompt_ids)
        slack = (self.settings.budget if self.settings.method == "ddtree" else 0) + \
            (self.drafter.block_size if self.speculative else 0) + 1
        capacity = n_prompt + max_new_tokens + slack
        if self._cache is None or self._cache.capacity < capacity:
            self._cache = target.new_cache(capacity)
        cache = self._cache
        cache.rollback(0)
        if self.speculative:
            self.drafter.start(n_prompt, capacity)
        timer = StageTimer(dev)
        tokens = torch.zeros(1, capacity, dtype=torch.long, device=dev)  # committed ids, then the bonus
        tokens[0, :n_prompt] = torch.tensor(prompt_ids, device=dev)
        margins: list[float] = []

        sync(dev)
        t0 = time.perf_counter()
        positions = torch.arange(n_prompt, device=dev)[None]
        local = torch.ones(n_prompt, n_prompt, dtype=torch.bool, device=dev).tril()
        hidden, features = target(tokens[:, :n_prompt], positions, cache, causal_mask(0, local), self.capture)
        cache.commit(n_prompt)
        logits = target.logits(hidden[0, -1:])
        bonus = int(logits.argmax(-1))
        if record_margins:
            margins += _margins(logits)
        out, accepted_lengths = [bonus], []
        tokens[0, n_prompt] = bonus
        sync(dev)
        t1 = time.perf_counter()

        while len(out) < max_new_tokens and out[-1] not in stop:
            length = cache.length
            tree = self._draft_tree(tokens[:, :length + 1], features, timer)
            with timer.stage("verify"):
                ids = torch.tensor([bonus] + tree.tokens, device=dev)[None]
                positions = length + torch.tensor([0] + tree.depths, device=dev)[None]
                mask = causal_mask(length, tree.ancestor_mask(dev)) if len(tree) else None
                hidden, all_features = target(ids, positions, cache, mask, self.capture)
                logits = target.logits(hidden[0])
                posterior = logits.argmax(-1).tolist()
            with timer.stage("commit"):
                path, bonus = tree.walk(posterior)
                cache.keep(path)
                features = all_features[:, path] if self.capture else None
                new = [tree.tokens[i - 1] for i in path[1:]] + [bonus]
                tokens[0, length + 1:length + 1 + len(new)] = torch.tensor(new, device=dev)
            accepted_lengths.append(len(path))
            if record_margins:
                margins += _margins(logits[path])
            for t in new:  # commit up to the first stop token or the length limit
                out.append(t)
                if t in stop or len(out) == max_new_tokens:
                    break
        sync(dev)
        t2 = time.perf_counter()
        rounds = max(1, len(accepted_lengths))
        stage_ms = {k: v / rounds for k, v in timer.totals_ms().items()}
        return GenerationResult(out, accepted_lengths, stage_ms, t1 - t0, t2 - t1,
                                margins[:len(out)] if record_margins else None)


def _margins(logits: torch.Tensor) -> list[float]:
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()
