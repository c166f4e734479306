"""The engine's own Llama/Qwen-family decoder: GQA attention over a preallocated cache, RoPE, SwiGLU MLP.

Parameter names follow the Hugging Face checkpoints (minus the leading "model."), so a safetensors state dict
loads directly. New tokens see the whole committed prefix plus the new rows their `node_mask` allows: causal
for prefill and linear verification, ancestor-only for tree verification (kernels/tree_attention.py). Without a
node_mask the tokens are whole sequences from an empty cache (draft training's features): plain causal attention.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused import qk_norm_rope_store, rmsnorm, sigmoid_mul, silu_mul
from kernels.gated_delta import TreeSchedule, chain_schedule
from kernels.int8_linear import Int8Rows, Int8Weight, int8_linear
from kernels.skinny_linear import (MAX_ROWS as SKINNY_MAX_ROWS, rope_fusable, skinny_linear, skinny_linear_applies,
                                   skinny_qkv_rope)
from kernels.tree_attention import tree_attention, visible_rows
from kernels.verify_rows import verify_rows

from .cache import AttentionLayerCache, ModelCache
from .config import HYBRID_MODEL_TYPES, ModelConfig, rope_inv_freq
from .errors import env_switch
from .parallel import ATTENTION_SLOT, MLP_SLOT, Partial


@functools.cache
def _has_mm_out_dtype() -> bool:
    """torch.mm(a, b, out_dtype=float32) with bf16 inputs (cuBLAS, torch >= 2.8 on CUDA)."""
    if not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the residual add is fused into the norm's kernel, and under
        tensor parallelism the all-reduce of a Partial x too (engine.parallel). `out`, if given, receives the norm."""
        if isinstance(x, Partial):
            y, h = x.tp.all_reduce_rmsnorm(x, self.weight, self.eps, residual)
            return (y, h) if out is None else (out.copy_(y), h)
        return rmsnorm(x, self.weight, self.eps, residual, out=out)

    def linear(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
               glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual) in one kernel (kernels.skinny_linear); glu: silu(gate) * up of
        the gate/up projection."""
        y, h = skinny_linear(x, weight, bias, norm=self.weight, eps=self.eps, residual=residual, glu=glu)
        return y, x if h is None else h

    def qkv_rope(self, x: torch.Tensor, residual: torch.Tensor | None, attn: "Attention", rows: "Rows",
                 layer_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries, x + residual): `linear` into attn's qkv projection with RoPE and the k/v cache store in the
        same kernel (kernels.skinny_linear.skinny_qkv_rope)."""
        q, h = skinny_qkv_rope(x, attn.qkv_weight, attn.qkv_bias, self.weight, self.eps, residual, attn.num_heads,
                               attn.num_kv_heads, attn.head_dim, rows.cos, rows.sin, layer_cache.k, layer_cache.v,
                               rows.slots)
        return q, x if h is None else h


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None, skinny: bool
           ) -> torch.Tensor:
    """F.linear, kernels.skinny_linear on the layers of a launch-bound model (Block.skinny), or kernels.int8_linear
    for an int8 weight (a draft's, engine.draft)."""
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    return skinny_linear(x, weight, bias)[0] if skinny_rows(skinny, x) else F.linear(x, weight, bias)


def add_linear(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h += linear(x, weight) in place, in the GEMM (cuBLAS's beta = 1): a folded block's residual add. Returns h."""
    h.view(-1, h.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return h


def skinny_rows(skinny: bool, x: torch.Tensor) -> bool:
    """A skinny layer's call with few rows per sequence (x [..., T, width]): decode, verify, a draft block. Longer
    calls (a prompt's prefill) use cuBLAS, whose large tiles read each weight once, as tree attention uses its
    reference past the same row count."""
    return skinny and x.shape[-2] <= SKINNY_MAX_ROWS


class Rotary:
    """cos/sin tables for absolute positions, computed from transformers' RoPE parameters of the config."""

    def __init__(self, cfg: ModelConfig, device):
        partial = cfg.model_type in HYBRID_MODEL_TYPES
        inv_freq, self.scale, self.dim = rope_inv_freq(cfg.hf, cfg.head_dim, partial)
        self.inv_freq = inv_freq.to(device)
        self.tables: dict[torch.dtype, list[torch.Tensor]] = {}  # per dtype, [2, n, rot_dim] tables, largest last

    def compute(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, rot_dim], computed."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def __call__(self, positions: torch.Tensor, dtype, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, rot_dim]. With `bound`, which the positions are known to stay below (a
        cache's capacity), they are gathered from a table of positions 0..n-1 computed once by the same formula: the
        same values in one kernel instead of nine per forward pass."""
        if bound is None:
            return self.compute(positions, dtype)
        both = self.table(dtype, bound)[:, positions]
        return both[0], both[1]

    def table(self, dtype, bound: int) -> torch.Tensor:
        """[2, n, rot_dim]: cos and sin of positions 0..n-1 (n >= bound), computed once per dtype and size."""
        tables = self.tables.setdefault(dtype, [])
        if not tables or tables[-1].shape[1] < bound:
            n = max(256, 1 << (bound - 1).bit_length())
            # Earlier tables stay allocated: CUDA graphs captured over them (another decoder's) keep their addresses.
            tables.append(torch.stack(self.compute(torch.arange(n, device=self.inv_freq.device), dtype)))
        return tables[-1]


@dataclass
class Rows:
    """The new rows of a forward pass: their rotary tables and cache slots, and what each of them sees."""
    cos: torch.Tensor                 # [B, T, rotary dims] at the rows' positions
    sin: torch.Tensor
    slots: torch.Tensor               # [T] (or [B, T]: sequences with their own lengths): start .. start + T - 1
    start: torch.Tensor               # 0-d: the committed length (or [B]: one per sequence)
    node_mask: torch.Tensor | None    # [T, T]: the new rows each row sees; None: whole sequences from slot 0
    schedule: TreeSchedule | None     # hybrids: how Gated DeltaNet layers visit the rows (a chain or a tree)
    visible: torch.Tensor | None = None  # node_mask as lists of the rows each row sees (tree attention on a GPU)


class Attention(nn.Module):
    """GQA attention over the cache. With cfg.attn_output_gate (Qwen3.5), q_proj also yields a per-head gate and the
    output is attention * sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.output_gate = cfg.attn_output_gate
        self.q_proj = nn.Linear(h, cfg.num_heads * d * (2 if self.output_gate else 1), bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.tp = None  # engine.parallel.TensorParallel once sharded: o_proj is row-parallel
        self.defer_reduce = False  # once sharded: return a Partial, all-reduced by the next norm
        self.skinny = False  # set by fuse_projections: kernels.skinny_linear for the projections
        self.rope_fused = False  # set by fuse_projections: RoPE and the cache store in the skinny qkv GEMM
        self.o_int8: Int8Weight | None = None  # o_proj's weight in int8 (a draft's, engine.draft)

    def fuse(self) -> None:
        """One GEMM for q, k and v (and the output gate): the weights become views of one concatenated matrix. A
        gated q_proj interleaves each head's query and gate rows; they are regrouped (once) as all queries, then all
        gates, so that the GEMM's output is [q | gate | k | v]."""
        if self.output_gate and not getattr(self, "gate_rows_grouped", False):
            H, D = self.num_heads, self.head_dim
            for name in ("weight", "bias"):
                t = getattr(self.q_proj, name)
                if t is not None:
                    t.data = t.data.view(H, 2, D, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()
            self.gate_rows_grouped = True
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _fused(projections, "weight")
        self.qkv_bias = _fused(projections, "bias")

    def project(self, x, cos, sin, layer_cache: AttentionLayerCache, slots
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Project [B, T, hidden]; store the (normed, rotated) keys and the values at the cache slots [T]; return the
        (normed, rotated) queries [B, heads, T, head_dim] and the output gate [B, T, heads * head_dim] (or None)."""
        return self.heads(linear(x, self.qkv_weight, self.qkv_bias, self.skinny), cos, sin, layer_cache, slots)

    def heads(self, qkv, cos, sin, layer_cache: AttentionLayerCache, slots, norm_input: torch.Tensor | None = None,
              norm_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`project` after its GEMM: qkv [B, T, (q [+ gate] + k + v) widths] -> (queries, gate). norm_input: the rows
        the GEMM read, when the norm before it is folded into its weight (Block.forward_folded)."""
        width = self.num_heads * self.head_dim
        gate = qkv[..., width:2 * width] if self.output_gate else None  # read in place: [q | gate | k | v]
        q = qk_norm_rope_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                               None if self.q_norm is None else self.q_norm.weight,
                               None if self.k_norm is None else self.k_norm.weight,
                               self.eps, cos, sin, layer_cache.k, layer_cache.v, slots, gated=self.output_gate,
                               norm_input=norm_input, norm_eps=norm_eps)
        return q, gate

    def attend(self, q: torch.Tensor, layer_cache: AttentionLayerCache, start, node_mask: torch.Tensor,
               visible: torch.Tensor | None = None) -> torch.Tensor:
        """Tree attention of the queries [B, H, T, D] over the cache, written into [B, T, H, D] memory: `out` then
        flattens the heads as a view (a transposing copy per layer otherwise, 2 us on the H200)."""
        B, H, T, D = q.shape
        o = q.new_empty(B, T, H, D).transpose(1, 2)
        return tree_attention(q, layer_cache.k, layer_cache.v, start, node_mask, rows=visible, out=o)

    def out(self, o: torch.Tensor, gate: torch.Tensor | None = None, residual: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Attention output [B, H, T, D] (times sigmoid(gate) when gated) -> [B, T, hidden]; with `residual` (a folded
        block's), o_proj's output is added into it in place and it is returned."""
        o = o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)
        if gate is not None:
            o = sigmoid_mul(o, gate)
        if residual is not None:
            return add_linear(residual, o, self.o_proj.weight)
        if self.defer_reduce:
            return self.tp.row_parallel(o, self.o_proj.weight, self.o_proj.bias, ATTENTION_SLOT)
        out = linear(o, self.o_proj.weight if self.o_int8 is None else self.o_int8, self.o_proj.bias, self.skinny)
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward(self, x, rows: Rows, layer_cache: AttentionLayerCache) -> torch.Tensor:
        return self.from_qkv(linear(x, self.qkv_weight, self.qkv_bias, self.skinny), rows, layer_cache)

    def from_qkv(self, qkv: torch.Tensor, rows: Rows, layer_cache: AttentionLayerCache) -> torch.Tensor:
        """`forward` after its GEMM (which Block may have fused with the norm before it)."""
        return self.from_q(*self.heads(qkv, rows.cos, rows.sin, layer_cache, rows.slots), rows, layer_cache)

    def from_q(self, q: torch.Tensor, gate: torch.Tensor | None, rows: Rows, layer_cache: AttentionLayerCache,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """`from_qkv` after its RoPE and cache store: attention of the queries [B, H, T, D], then o_proj (added
        into `residual` in place, if given: see `out`)."""
        if rows.node_mask is None:  # whole sequences from slot 0: causal over the rows just stored, no host read
            T = q.shape[2]
            o = F.scaled_dot_product_attention(q, layer_cache.k[:, :, :T], layer_cache.v[:, :, :T], is_causal=True,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            return self.out(o, gate, residual)
        return self.out(self.attend(q, layer_cache, rows.start, rows.node_mask, rows.visible), gate, residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.tp = None  # once sharded: down_proj is row-parallel
        self.defer_reduce = False  # once sharded: return a Partial, all-reduced by the next norm
        self.skinny = False  # set by fuse_projections: kernels.skinny_linear for the projections
        self.down_int8: Int8Weight | None = None  # down_proj's weight in int8 (a draft's, engine.draft)

    def fuse(self) -> None:
        """One GEMM for gate and up: both weights become views of one concatenated matrix."""
        self.gate_up_weight = _fused((self.gate_proj, self.up_proj), "weight")
        self.gate_up_bias = _fused((self.gate_proj, self.up_proj), "bias")

    def forward(self, x):
        if skinny_rows(self.skinny, x):
            return self.down(skinny_linear(x, self.gate_up_weight, self.gate_up_bias, glu=True)[0])
        return self.down(silu_mul(linear(x, self.gate_up_weight, self.gate_up_bias, False)))

    def down(self, act: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The down projection of act = silu(gate) * up [..., intermediate]; with `residual` (a folded block's),
        added into it in place, which is returned."""
        if residual is not None:
            return add_linear(residual, act, self.down_proj.weight)
        if self.defer_reduce:
            return self.tp.row_parallel(act, self.down_proj.weight, self.down_proj.bias, MLP_SLOT)
        weight = self.down_proj.weight if self.down_int8 is None else self.down_int8
        out = linear(act, weight, self.down_proj.bias, self.skinny)
        return out if self.tp is None else self.tp.all_reduce(out)


def _fused(linears, name: str) -> torch.Tensor | None:
    """Concatenate a parameter of several linears along the output dimension and re-point each at its slice."""
    if getattr(linears[0], name) is None:
        return None
    fused = torch.cat([getattr(m, name).data for m in linears])
    offset = 0
    for m in linears:
        part = getattr(m, name)
        part.data = fused[offset:offset + part.shape[0]]
        offset += part.shape[0]
    return fused


class Block(nn.Module):
    """A pre-norm decoder block: a token mixer (attention, or Gated DeltaNet in a hybrid's linear-attention layers,
    named as the checkpoints name them) and the MLP."""

    def __init__(self, cfg: ModelConfig, layer_type: str = "full_attention"):
        super().__init__()
        if layer_type == "linear_attention":
            from .gated_delta import GatedDeltaNet

            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.skinny = False  # set by fuse_projections: the norms run inside the projections' kernels

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def foldable(self) -> bool:
        """Whether Transformer.fold_norms can fold this block: plain attention and MLP, unsharded, 16- or 32-bit
        weights, no biases (a bias would be scaled by the norm with the GEMM's output), and not skinny (whose
        kernels run the norms already)."""
        attn, mlp = self.mixer, self.mlp
        return (isinstance(attn, Attention) and not attn.output_gate and not self.skinny
                and attn.tp is None and mlp.tp is None and attn.o_int8 is None and mlp.down_int8 is None
                and all(isinstance(w, torch.Tensor) and w.is_floating_point()
                        for w in (attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight, mlp.down_proj.weight))
                and attn.qkv_bias is None and attn.o_proj.bias is None and mlp.gate_up_bias is None
                and mlp.down_proj.bias is None)

    def fold_norm_gains(self) -> None:
        """Multiply the input columns of the qkv and gate/up weights by the gains of the norms before them, in place
        (once): linear(RMSNorm(h), W) = linear(h, W * gain) / rms(h) per row."""
        self.self_attn.qkv_weight.mul_(self.input_layernorm.weight)
        self.mlp.gate_up_weight.mul_(self.post_attention_layernorm.weight)

    def forward_folded(self, h: torch.Tensor, rows: Rows, layer_cache) -> torch.Tensor:
        """The block after fold_norm_gains, on the whole residual stream h [B, T, hidden], updated in place and
        returned. The qkv and gate/up GEMMs read h itself; the kernel after each (qk_norm_rope_store, silu_mul)
        scales its rows by 1/rms(h), and o_proj and down_proj add into h in their GEMMs: seven kernels a layer, no
        RMSNorm kernel, and the same arithmetic as `forward` but for rounding."""
        attn, mlp = self.self_attn, self.mlp
        q, _ = attn.heads(F.linear(h, attn.qkv_weight), rows.cos, rows.sin, layer_cache, rows.slots,
                          norm_input=h, norm_eps=self.input_layernorm.eps)
        attn.from_q(q, None, rows, layer_cache, residual=h)
        act = silu_mul(F.linear(h, mlp.gate_up_weight), norm_input=h, norm_eps=self.post_attention_layernorm.eps)
        return mlp.down(act, residual=h)

    def forward(self, pending, residual, rows: Rows, layer_cache):
        """The residual stream arrives as residual + pending, `pending` being the previous block's MLP output not
        yet added: the add is fused into this block's first norm. Returns (this block's MLP output, the residual
        stream before it) in the same form."""
        if skinny_rows(self.skinny, pending):  # norms in GEMM prologues, SiLU * up in an epilogue: six kernels a
            # layer, five where RoPE and the cache store run in the qkv GEMM's epilogue too
            attn, mlp = self.self_attn, self.mlp
            if attn.rope_fused and rows.cos.shape[-1] == attn.head_dim:
                q, residual = self.input_layernorm.qkv_rope(pending, residual, attn, rows, layer_cache)
                mixed = attn.from_q(q, None, rows, layer_cache)
            else:
                qkv, residual = self.input_layernorm.linear(pending, residual, attn.qkv_weight, attn.qkv_bias)
                mixed = attn.from_qkv(qkv, rows, layer_cache)
            act, residual = self.post_attention_layernorm.linear(mixed, residual, mlp.gate_up_weight,
                                                                 mlp.gate_up_bias, glu=True)
            return mlp.down(act), residual
        h, residual = self.input_layernorm(pending, residual)
        h, residual = self.post_attention_layernorm(self.mixer(h, rows, layer_cache), residual)
        return self.mlp(h), residual


def fuse_projections(blocks) -> None:
    """One GEMM for q, k, v and one for gate, up; kernels.skinny_linear where the model is launch-bound."""
    # read at each kernel launch: a bad value fails here, once
    for name in ("ENGINE_PDL", "ENGINE_SKINNY_PREFETCH", "ENGINE_ATTN_PREFETCH", "ENGINE_TRITON_ARGMAX"):
        env_switch(name)
    forced = skinny_forced()
    rope = env_switch("ENGINE_SKINNY_ROPE") is not False  # 0: RoPE and the cache store in their own kernel (A/B)
    for block in blocks:
        block.mixer.fuse()
        block.mlp.fuse()
        mixer = block.mixer
        skinny = (isinstance(mixer, Attention) and not mixer.output_gate
                  and skinny_linear_applies(block.mlp.gate_up_weight, forced))
        block.skinny = mixer.skinny = block.mlp.skinny = skinny
        if isinstance(mixer, Attention):
            # RoPE on every dim is checked per call (Block.forward): the tables' width is the rotary width
            mixer.rope_fused = (skinny and rope and mixer.tp is None and rope_fusable(
                mixer.qkv_weight, mixer.head_dim, mixer.head_dim, mixer.q_norm is not None))


def skinny_forced() -> bool | None:
    """ENGINE_SKINNY_LINEAR=0 or 1 (read when a model's projections are fused) turns kernels.skinny_linear off or
    on whatever the model's width, for A/B runs; unset or auto: by width."""
    return env_switch("ENGINE_SKINNY_LINEAR")


class Transformer(nn.Module):
    """A decoder-only target model. `forward` runs new tokens against the cache; `logits` applies the LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, cfg.layer_type(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: Rotary | None = None  # built by `ready`, once the model sits on its device
        # tensor parallelism (engine.parallel.shard_target): this rank's vocabulary slice and KV heads
        self.tp = None
        self.vocab_start, self.vocab_per_rank, self.num_kv_heads = 0, cfg.vocab_size, cfg.num_kv_heads
        self.norms_folded = False  # set by fold_norms

    def ready(self) -> "Transformer":
        """Called once the weights are in place: fuse projections, build the RoPE tables."""
        self.rotary = Rotary(self.cfg, self.embed_tokens.weight.device)
        fuse_projections(self.layers)
        return self.eval().requires_grad_(False)

    def fold_norms(self) -> bool:
        """Fold every block's two RMSNorms into the GEMMs after them (Block.forward_folded), once, in place: two
        kernels fewer a layer in every forward pass from then on. Called by engine.decode.Decoder before its first
        pass; applies where every block is foldable (Block.foldable), the model is not sharded and
        ENGINE_FOLD_NORMS=0 (for A/B runs) is not set. Returns whether the norms are folded."""
        if not self.norms_folded and env_switch("ENGINE_FOLD_NORMS") is not False and self.tp is None \
                and all(block.foldable() for block in self.layers):
            for block in self.layers:
                block.fold_norm_gains()
            self.norms_folded = True
        return self.norms_folded

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, capacity: int, batch: int = 1, own_lengths: bool = False) -> ModelCache:
        """A cache of `capacity` slots for `batch` rows; own_lengths: each row a separate sequence with its own
        committed length (batched decoding)."""
        c = self.cfg
        recurrent = tuple(i for i in range(c.num_layers) if c.layer_type(i) == "linear_attention")
        # from the layer, not the config: under tensor parallelism it holds only this rank's heads and channels
        shape = self.layers[recurrent[0]].linear_attn.state_shape() if recurrent else None
        return ModelCache(c.num_layers, self.num_kv_heads, c.head_dim, capacity, self.dtype, self.device, batch,
                          recurrent_layers=recurrent, recurrent=shape, own_lengths=own_lengths)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings; vocabulary-parallel under tensor parallelism (the owning rank's row, all-reduced)."""
        if self.tp is None:
            return self.embed_tokens(tokens)
        local = tokens - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_per_rank)
        x = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.embed_tokens.weight)
        return self.tp.all_reduce(x * inside[..., None].to(x.dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: ModelCache, node_mask: torch.Tensor | None,
                capture: tuple[int, ...] = (), schedule: TreeSchedule | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T new tokens after the cache's committed prefix.

        tokens, positions [B, T]; node_mask [T, T] bool: the new rows each new row sees (every new row sees the
        whole committed prefix), or [B, T, T] when each sequence has its own tree (a cache with own lengths);
        schedule: what Gated DeltaNet layers follow instead of the mask (a tree's, kernels.gated_delta.tree_schedule;
        None: a chain). Writes the new rows at slots start..start+T-1 (keeping them is the caller's business:
        cache.keep). Returns the final-normed hidden states [B, T, hidden] and the concatenated outputs of the
        `capture` layers [B, T, len(capture) * hidden] (None when nothing is captured). A single sequence's verify
        pass goes through `verify`, whose inputs come from one kernel.
        """
        start = cache.start
        x = self.embed(tokens)
        cos, sin = self.rotary(positions, x.dtype, bound=cache.capacity)  # a row's position <= its cache slot
        T = tokens.shape[1]
        visible = visible_rows(node_mask) if node_mask is not None and tokens.is_cuda else None  # once, all layers
        slots = start.unsqueeze(-1) + torch.arange(T, device=tokens.device)  # [T], or [B, T] with own lengths
        return self.run(x, Rows(cos, sin, slots, start, node_mask, schedule, visible), cache, capture)

    def verify(self, tokens: torch.Tensor, tree_tokens: torch.Tensor, tree_depths: torch.Tensor,
               node_mask: torch.Tensor, cache: ModelCache, capture: tuple[int, ...] = (),
               schedule: TreeSchedule | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A verify pass of one sequence: `forward` over ids = [tokens[start], tree_tokens...] (tokens [C]: the
        sequence's ids, the next bonus token at the committed length) at positions start + [0, tree_depths...],
        node_mask [T, T]. Its inputs (ids, embeddings, rotary rows, slots, visible lists) come from one kernel
        (kernels.verify_rows). Returns (ids, hidden, features)."""
        embed = self.embed_tokens.weight if self.tp is None else None  # tensor parallel: a vocab-parallel embedding
        ids, x, cos, sin, slots, visible = verify_rows(tokens, cache.start, tree_tokens, tree_depths, node_mask,
                                                       embed, self.rotary.table(self.dtype, cache.capacity))
        if x is None:
            x = self.embed(ids[None])
        rows = Rows(cos, sin, slots, cache.start, node_mask, schedule, visible if ids.is_cuda else None)
        return ids, *self.run(x, rows, cache, capture)

    def run(self, x: torch.Tensor, rows: Rows, cache: ModelCache, capture: tuple[int, ...] = ()
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over the embedded rows x [B, T, hidden] (`forward` after its inputs)."""
        if self.cfg.hybrid and rows.schedule is None:
            rows = replace(rows, schedule=chain_schedule(x.shape[1], self.cfg.linear_conv_kernel, x.device))
        if self.norms_folded:  # the blocks add into x, the residual stream, in place
            width = x.shape[-1]
            features = x.new_empty(*x.shape[:-1], len(capture) * width) if capture else None
            for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers)):
                layer.forward_folded(x, rows, layer_cache)
                if i in capture:  # the layer's output (HF hidden_states[i + 1])
                    j = capture.index(i)
                    features[..., j * width:(j + 1) * width].copy_(x)
            return self.norm(x)[0], features
        captured = {}
        pending, residual = x, None  # the embeddings enter as the first pending output
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers)):
            pending, residual = layer(pending, residual, rows, layer_cache)
            if i in capture:
                full = pending.reduced() if isinstance(pending, Partial) else pending
                captured[i] = residual + full   # the layer's output (HF hidden_states[i + 1])
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return self.norm(pending, residual)[0], features

    def logits(self, hidden: torch.Tensor, int8_head: Int8Weight | None = None) -> torch.Tensor:
        """LM-head logits in float32. From bf16 weights they are accumulated and kept in float32: rounding them
        to bf16 (an ulp of 0.06 to 0.125 at typical magnitudes) would turn real margins into ties. int8_head: an
        int8 copy of the LM head (a draft's, engine.draft) used instead, also on int8 rows (Int8Rows)."""
        # int8 rows go to int8_linear as they are (any leading dims)
        flat = hidden if isinstance(hidden, Int8Rows) else hidden.reshape(-1, hidden.shape[-1])
        if int8_head is not None:
            out = int8_linear(flat, int8_head, out_dtype=torch.float32)
        elif hidden.dtype == torch.float32:
            out = F.linear(flat, self.lm_head.weight)
        elif hidden.is_cuda and _has_mm_out_dtype():
            out = torch.mm(flat, self.lm_head.weight.t(), out_dtype=torch.float32)
        else:  # no mixed-precision GEMM here: upcast (slower, same result)
            out = F.linear(flat.float(), self.lm_head.weight.float())
        if self.tp is not None:  # every rank gets the full logits: the same decisions everywhere
            out = self.tp.all_gather_last(out)[..., :self.cfg.vocab_size]
        return out.view(*hidden.shape[:-1], -1)
