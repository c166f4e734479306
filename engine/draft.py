"""Drafters: what proposes the next block of tokens.

The decode loop talks to a drafter through `Drafter`: `start` once per sequence, then `propose` once per round.
A proposal is draft logits for the block_size - 1 positions after the bonus token; DFlash verifies their argmax
as a chain, DDTree builds a tree from their top-k.

`DFlashDrafter` runs a DFlash block-diffusion draft model (the public checkpoint format, docs/design.md "DFlash
draft"): one non-causal pass over [context features, bonus, mask, ..., mask], with the target's embedding and LM
head.
It keeps its state on the device and never reads a tensor on the host, so a round can be a CUDA graph.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.int8_linear import Int8Rows, Int8Weight, quantize_int8
from kernels.tree_attention import visible_rows

from .cache import ModelCache
from .config import ModelConfig
from .errors import EngineError
from .model import Block, RMSNorm, Rotary, Transformer, fuse_projections, linear


@dataclass
class DraftInput:
    """What a round knows when it drafts. Tensors live on the target's device; buffers may be longer than used.

    tokens[0, :length + 1] are the committed ids, prompt included; tokens[0, length] is the bonus token the round
    starts from (not yet in the target's cache). features[0, :n_features] are the target's context features
    (outputs of `feature_layers`) of the tokens committed since the previous call; rows past n_features are
    padding.

    Several sequences (batched decoding): row b of tokens and features is sequence b, and length and n_features
    hold one value per sequence ([B]); the proposal is then [B, block_size - 1, vocab].

    depth: the round reads the proposal's first `depth` positions only (a DDTree of budget b reaches depth b); a
    drafter may then return just those ([depth, vocab]), saving their LM head. None: all block_size - 1.
    """
    tokens: torch.Tensor            # [B, capacity] long
    length: torch.Tensor            # 0-d long (one sequence), or [B]
    features: torch.Tensor | None   # [B, n, F]
    n_features: torch.Tensor        # like length, each <= n
    depth: int | None = None


class Drafter(ABC):
    """A source of block proposals. Subclass it to plug in your own drafter."""

    block_size: int                        # tokens per block, the bonus token included
    feature_layers: tuple[int, ...] = ()   # target layers whose outputs `propose` receives as features
    graphable: bool = False                # propose() never syncs with the host: a CUDA graph may capture it

    @abstractmethod
    def start(self, prompt_len: int, capacity: int) -> None:
        """Reset per-sequence state; capacity bounds prompt + output + one block."""

    @abstractmethod
    def propose(self, inp: DraftInput) -> torch.Tensor:
        """Return draft logits [block_size - 1, vocab] for the positions after the bonus token ([B, block_size - 1,
        vocab] for several sequences), or only the first inp.depth positions' where it is set."""

    def prefill(self, features: torch.Tensor, row: int | None = None) -> bool:
        """Take a prompt's context features [n, F] into the drafter's own state now, with the target's prefill (batch
        row `row` in batched decoding), so that the first proposal has no context rows of its own (n_features 0) and
        runs at a round's static shape, in its CUDA graph. False (this default): the drafter cannot; its first
        proposal reads the prompt's features instead."""
        return False

    # Batched decoding (engine/batch.py) starts a drafter with `start(prompt_len, capacity, sequences=B)`, proposes
    # for the first rows in use, and calls these between rounds:
    def reset_sequence(self, row: int, prompt: list[int]) -> None:
        """Row `row` starts a new sequence with this prompt (its context arrives with `prefill` or its next
        proposal)."""
        raise NotImplementedError(f"{type(self).__name__} does not decode several sequences at once")

    def move_sequence(self, src: int, dst: int) -> None:
        """Row src's sequence becomes row dst's."""
        raise NotImplementedError(f"{type(self).__name__} does not decode several sequences at once")


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash draft: Qwen3-style layers plus block size, mask token and the target layers it reads."""

    layers: ModelConfig          # per-layer shapes (hidden, heads, kv heads, head_dim, MLP, eps, RoPE)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding_window: tuple[int | None, ...]  # per draft layer; None = full attention


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers whose outputs feed a draft that names none: the public DFlash rule (layer 1 to layer L - 3,
    evenly spaced). Below 5 target layers that rule leaves the model (layer -1 at 2 layers): ids are clamped into
    it there."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    ids = (round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))
    return [min(max(i, 0), num_target_layers - 1) for i in ids]


def draft_config(target_cfg: ModelConfig, layers: int, block_size: int, mask_token_id: int) -> DraftConfig:
    """A DFlash draft shaped for a target: Qwen3-style layers of the target's width (full attention, also for a hybrid
    target), default target layers."""
    cfg = dataclasses.replace(target_cfg, model_type="qwen3", num_layers=layers, qk_norm=True, qkv_bias=False,
                              o_bias=False, mlp_bias=False, layer_types=(), attn_output_gate=False, norm_offset=False)
    return DraftConfig(cfg, block_size=block_size, mask_token_id=mask_token_id,
                       target_layer_ids=tuple(default_target_layer_ids(target_cfg.num_layers, layers)),
                       sliding_window=(None,) * layers)


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


# the draft's weights as loaded (the target's dtype); int8 (kernels.int8_linear); w8a8: int8 weights, and the rows the
# norms hand to the qkv, gate/up and LM-head GEMMs quantized to int8 in the norms' kernels (integer products)
DRAFT_WEIGHTS = ("model", "int8", "w8a8")


class DFlashDrafter(Drafter):
    graphable = True

    def __init__(self, draft: DFlashDraftModel, target: Transformer, block_size: int | None = None,
                 weights: str = "model"):
        """weights: "model" keeps the draft's weights in the target's dtype; "int8" stores every projection of the
        draft and a copy of the target's LM head as int8 with a scale per output row (`_quantize_int8_weights`);
        "w8a8" also quantizes the normed rows that the qkv, gate/up and LM-head GEMMs read, a scale per row, in the
        norms' kernels (kernels.fused.rmsnorm with an Int8Rows `out`), so those GEMMs multiply integers."""
        if weights not in DRAFT_WEIGHTS:
            raise EngineError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {weights!r}")
        self.draft = draft.eval().requires_grad_(False)
        fuse_projections(draft.layers)
        self.target = target
        self.fc_weight: torch.Tensor | Int8Weight = draft.fc.weight
        self.int8_head: Int8Weight | None = None  # the LM head for the draft's logits (None: the target's own)
        if weights in ("int8", "w8a8"):
            self._quantize_int8_weights()
        self.int8_rows = weights == "w8a8"
        dcfg = draft.dcfg
        self.block_size = dcfg.block_size if block_size is None else block_size
        self.feature_layers = tuple(dcfg.target_layer_ids)
        self.mask_token_id = dcfg.mask_token_id
        self.windows = dcfg.sliding_window
        self.rotary = Rotary(dcfg.layers, target.device)
        self.cache: ModelCache | None = None
        dev = target.device
        self.row_layout = _row_layout(self.block_size, self.block_size, dev)  # later calls' n = block_size rows
        self.block_visible = torch.ones(self.block_size, self.block_size, dtype=torch.bool, device=dev)
        self.block_visible_rows = visible_rows(self.block_visible)  # once, not per layer and round
        self.mask_ids = torch.full((max(self.block_size - 1, 0),), self.mask_token_id, dtype=torch.long, device=dev)

    def _quantize_int8_weights(self) -> None:
        """A draft only proposes: the target's verify decides every token, so int8 weights change its acceptance at
        most, never the output. Its round streams half the bytes (docs/design.md, "Int8 draft weights"). The
        layers then run their projections through kernels.int8_linear (not kernels.skinny_linear's fused norms),
        and the draft's 16-bit weights are released; the target's LM head stays, beside its int8 copy."""
        draft = self.draft
        if any(block.self_attn.tp is not None or block.mlp.tp is not None for block in draft.layers):
            raise EngineError("int8 draft weights need a replicated draft: unset ENGINE_SHARD_DRAFT")
        released = [draft.fc]
        for block in draft.layers:
            attn, mlp = block.self_attn, block.mlp
            attn.qkv_weight = quantize_int8(attn.qkv_weight)
            attn.o_int8 = quantize_int8(attn.o_proj.weight)
            mlp.gate_up_weight = quantize_int8(mlp.gate_up_weight)
            mlp.down_int8 = quantize_int8(mlp.down_proj.weight)
            block.skinny = attn.skinny = mlp.skinny = attn.rope_fused = False
            released += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        self.fc_weight = quantize_int8(draft.fc.weight)
        self.int8_head = quantize_int8(self.target.lm_head.weight)
        for module in released:  # biases and norms stay; nothing reads these weights again
            module.weight.data = module.weight.data.new_empty(0)

    def start(self, prompt_len: int, capacity: int, sequences: int | None = None) -> None:
        """sequences=None: one sequence; B: B sequences, each with its own context length (batched decoding)."""
        batch, own = (1, False) if sequences is None else (sequences, True)
        c = self.cache
        capacity += self.block_size  # slack past the block for the context's padding rows (propose)
        if c is None or c.capacity < capacity or c.k.shape[1] != batch or (c.start.dim() == 1) != own:
            cfg = self.draft.dcfg.layers
            layers = self.draft.layers  # the rank's KV heads, where engine.parallel sharded them
            kv_heads = layers[0].self_attn.num_kv_heads if len(layers) else cfg.num_kv_heads
            self.cache = ModelCache(cfg.num_layers, kv_heads, cfg.head_dim, capacity, self.target.dtype,
                                    self.target.device, batch, own_lengths=own)
        self.cache.reset()

    def reset_sequence(self, row: int, prompt: list[int]) -> None:
        self.cache.start[row] = 0

    def move_sequence(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)

    def _context_rows(self, features: torch.Tensor, block: int) -> tuple[torch.Tensor | Int8Rows, torch.dtype]:
        """hidden_norm(fc(features [B, n, F])) into the first n rows of a [B, n + block, hidden] buffer (propose's
        qkv GEMMs read the context and the block from one buffer), and the rows' dtype."""
        fc_out = linear(features, self.fc_weight, None, False)                # [B, n, hidden]
        B, n, hidden = fc_out.shape
        rows = Int8Rows.empty((B, n + block, hidden), fc_out.dtype, fc_out.device) if self.int8_rows \
            else fc_out.new_empty(B, n + block, hidden)
        self.draft.hidden_norm(fc_out, out=rows[:, :n])
        return rows, fc_out.dtype

    @torch.no_grad()
    def prefill(self, features: torch.Tensor, row: int | None = None) -> bool:
        """Each layer's keys and values of the prompt's context rows into the draft's cache, as propose stores them."""
        cache = self.cache if row is None else self.cache.rows(row, 1)
        rows, dtype = self._context_rows(features[None], 0)
        pos = cache.start.unsqueeze(-1) + torch.arange(features.shape[0], device=features.device)  # [n] or [1, n]
        cos, sin = self.rotary(pos.view(1, -1), dtype, bound=cache.capacity)
        for layer, layer_cache in zip(self.draft.layers, cache.layers):
            attn = layer.self_attn
            attn.heads(linear(rows, attn.qkv_weight, attn.qkv_bias, attn.skinny), cos, sin, layer_cache, pos)
        cache.start.add_(features.shape[0])
        return True

    @torch.no_grad()
    def propose(self, inp: DraftInput) -> torch.Tensor:
        block, draft = self.block_size, self.draft
        # Every layer's qkv GEMM reads the context rows, then the block's normed rows: one buffer, the context
        # written once, each layer's input norm writing the block's part.
        rows_in, dtype = self._context_rows(inp.features, block)
        B, n = inp.features.shape[:2]
        cache = self.cache if inp.length.dim() == 0 or B == self.cache.start.shape[0] else self.cache.rows(0, B)
        # Slot = absolute position: context row j at start + j, block row i at start + n_features + i, where the
        # real context ends. A context padding row (j >= n_features) goes past the block, to start + j + block, in
        # the cache's slack: no one reads it, and one kernel stores every row of a layer without a race.
        offsets, is_block = self.row_layout if n == block else _row_layout(n, block, inp.features.device)
        start, n_features = cache.start.unsqueeze(-1), inp.n_features.unsqueeze(-1)   # [1] or [B, 1]
        pos = start + offsets + torch.where(is_block, n_features, (offsets >= n_features) * block)  # [(B,) n + block]
        cos, sin = self.rotary(pos if pos.dim() == 2 else pos.expand(B, -1), dtype, bound=cache.capacity)
        block_start = cache.start + inp.n_features
        bonus = inp.tokens.gather(1, inp.length.view(-1, 1).expand(B, 1))     # [B, 1]
        x = self.target.embed(torch.cat((bonus, self.mask_ids.expand(B, -1)), dim=1))
        pending = None  # the last MLP output, added to x inside the next norm (as the target's blocks do)
        for layer, layer_cache, window in zip(draft.layers, cache.layers, self.windows):
            attn = layer.self_attn
            _, x = layer.input_layernorm(x, pending, out=rows_in[:, n:])
            # One qkv GEMM, and one kernel for RoPE and the cache store, over the context rows and the block
            qkv = linear(rows_in, attn.qkv_weight, attn.qkv_bias, attn.skinny)
            q = attn.heads(qkv, cos, sin, layer_cache, pos)[0][:, :, n:]  # the block's queries
            if window is None:
                o = attn.attend(q, layer_cache, block_start, self.block_visible, self.block_visible_rows)
            else:
                o = _windowed_attention(q, layer_cache, pos[..., n:], window)
            h, x = layer.post_attention_layernorm(attn.out(o), x, out=self._rows_out(x))
            pending = layer.mlp(h)
        cache.start.add_(inp.n_features)  # keep the context rows, drop the block's
        end = block if inp.depth is None else 1 + inp.depth  # the LM head only over the positions the round reads
        last = pending[:, 1:end]
        logits = self.target.logits(draft.norm(last, x[:, 1:end], out=self._rows_out(last))[0], self.int8_head)
        return logits if inp.length.dim() else logits[0]

    def _rows_out(self, like: torch.Tensor) -> Int8Rows | None:
        """An Int8Rows buffer for a norm's output rows (w8a8), or None (the norm allocates its 16-bit output)."""
        return Int8Rows.empty(like.shape, like.dtype, like.device) if self.int8_rows else None


def _row_layout(n: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For n context rows and the block after them: each row's offset in its part, and whether it is a block row."""
    offsets = torch.cat((torch.arange(n, device=device), torch.arange(block, device=device)))
    return offsets, torch.arange(n + block, device=device) >= n


def _windowed_attention(q, layer_cache, block_pos, window: int) -> torch.Tensor:
    """A sliding-window draft layer: a block query at position p sees keys at positions in (p - window,
    block_start + block size). Masked attention over the whole cache, computed without host reads. block_pos:
    [block], or [B, block] for sequences with their own lengths."""
    keys = torch.arange(layer_cache.k.shape[2], device=q.device)
    end = block_pos[..., -1:] + 1
    mask = (keys < end.unsqueeze(-1)) & (keys > block_pos.unsqueeze(-1) - window)  # [block, K] or [B, block, K]
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)  # one mask per sequence, shared by its heads
    o = F.scaled_dot_product_attention(q.float(), layer_cache.k.float(), layer_cache.v.float(), attn_mask=mask,
                                       enable_gqa=q.shape[1] != layer_cache.k.shape[1])
    return o.to(q.dtype)
