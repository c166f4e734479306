"""Drafters: what proposes the next block of tokens.

The decode loop talks to a drafter through `Drafter`: `start` once per sequence, then `propose` once per round
with the committed tokens (the last one is the bonus token the round starts from) and the target's context
features of the tokens committed since the previous call. It returns draft logits for the block_size - 1
positions after the bonus; DFlash verifies their argmax as a chain, DDTree builds a tree from their top-k.

`DFlashDrafter` runs a DFlash block-diffusion draft model (public checkpoint format, DESIGN.md section 2):
one non-causal pass over [context features, bonus, mask, ..., mask], with the target's embedding and LM head.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from .cache import ModelCache, attention_cache
from .config import ModelConfig
from .model import Block, RMSNorm, Rotary, Transformer


@dataclass
class DraftInput:
    tokens: torch.Tensor            # [1, n] committed ids, prompt included; tokens[:, -1] is the bonus token
    features: torch.Tensor | None   # [1, m, F] target features of the m tokens before the bonus not yet seen


class Drafter(ABC):
    """A source of block proposals. Subclass it to plug in your own drafter."""

    block_size: int                        # tokens per block, the bonus token included
    feature_layers: tuple[int, ...] = ()   # target layers whose outputs `propose` receives as features

    @abstractmethod
    def start(self, prompt_len: int, capacity: int) -> None:
        """Reset per-sequence state; capacity bounds prompt + output + one block."""

    @abstractmethod
    def propose(self, inp: DraftInput) -> torch.Tensor:
        """Return draft logits [block_size - 1, vocab] for the positions after the bonus token."""


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash draft: Qwen3-style layers plus block size, mask token and the target layers it reads."""

    layers: ModelConfig          # per-layer shapes (hidden, heads, kv heads, head_dim, MLP, eps, RoPE)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding_window: tuple[int | None, ...]  # per draft layer; None = full attention


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class DFlashDraftModel(nn.Module):
    """Parameters of a DFlash draft, named as in the public checkpoints (no embedding, no LM head)."""

    def __init__(self, dcfg: DraftConfig):
        super().__init__()
        cfg = dcfg.layers
        self.dcfg = dcfg
        self.fc = nn.Linear(len(dcfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Same parameters as a target block; DFlashDrafter.propose runs them with context keys and values.
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDrafter(Drafter):
    def __init__(self, draft: DFlashDraftModel, target: Transformer, block_size: int | None = None):
        self.draft = draft.eval().requires_grad_(False)
        self.target = target
        dcfg = draft.dcfg
        self.block_size = dcfg.block_size if block_size is None else block_size
        self.feature_layers = tuple(dcfg.target_layer_ids)
        self.mask_token_id = dcfg.mask_token_id
        self.windows = dcfg.sliding_window
        self.rotary = Rotary(dcfg.layers.hf, dcfg.layers.head_dim, target.device)
        self.cache: ModelCache | None = None

    def start(self, prompt_len: int, capacity: int) -> None:
        if self.cache is None or self.cache.capacity < capacity:
            cfg = self.draft.dcfg.layers
            self.cache = attention_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity,
                                         self.target.dtype, self.target.device)
        self.cache.rollback(0)

    @torch.no_grad()
    def propose(self, inp: DraftInput) -> torch.Tensor:
        cache, B = self.cache, self.block_size
        ctx = self.draft.hidden_norm(self.draft.fc(inp.features))             # [1, m, hidden]
        m, start = ctx.shape[1], cache.length
        cache.check_room(m + B)
        block = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=ctx.device)
        block[:, 0] = inp.tokens[:, -1]
        x = self.target.embed_tokens(block)
        positions = torch.arange(start, start + m + B, device=ctx.device)[None]
        cos, sin = self.rotary(positions, x.dtype)
        q_cos, q_sin = cos[:, :, m:], sin[:, :, m:]
        for layer, layer_cache, window in zip(self.draft.layers, cache.layers, self.windows):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = attn.key_value(torch.cat((ctx, h), dim=1), cos, sin)
            k, v = layer_cache.store(start, k, v)
            mask = None
            if window is not None:  # a query at position p sees keys at positions > p - window
                key_pos = torch.arange(start + m + B, device=x.device)
                mask = key_pos[None, :] > positions[0, m:, None] - window
            x = x + attn.attend(attn.query(h, q_cos, q_sin), k, v, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.commit(m)  # keep the context entries, drop the block's
        return self.target.logits(self.draft.norm(x[0, 1:]))

