"""The Gated DeltaNet token mixer of hybrid targets (Qwen3.5 "linear_attention" layers), verified tree-safely.

Parameter names follow transformers' `Qwen3_5GatedDeltaNet`: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d
(depthwise, kernel 4, SiLU), dt_bias, A_log, norm (an RMSNorm gated by z) and out_proj. Per new row: the projections,
the causal conv over the row's own ancestors' inputs, l2-normed q and k (grouped: each key head serves
value_heads / key_heads consecutive value heads), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the
gated delta rule from its parent's state (kernels/gated_delta.py), the gated norm and the output projection. The
layer cache records the rows' inputs so that the decoder's keep() can commit the accepted path's state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gated_delta import tree_causal_conv_reference, tree_gated_delta_reference

from .cache import RecurrentLayerCache, RecurrentRows, RecurrentShape
from .config import ModelConfig


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output, then times SiLU(z) (its weight is a plain scale, not an offset from 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.key_heads, self.value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.split = (keys, keys, values)  # the conv's channels: q, k, v
        channels = 2 * keys + values
        self.in_proj_qkv = nn.Linear(h, channels, bias=False)
        self.in_proj_z = nn.Linear(h, values, bias=False)
        self.in_proj_b = nn.Linear(h, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.value_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, cfg.linear_conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(values, h, bias=False)
        self.tp = None  # tensor parallelism of these layers is not supported yet (engine.parallel refuses it)

    @staticmethod
    def state_shape(cfg: ModelConfig) -> RecurrentShape:
        keys, values = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * \
            cfg.linear_value_head_dim
        return RecurrentShape(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                              2 * keys + values, cfg.linear_conv_kernel)

    def fuse(self) -> None:
        """One GEMM for qkv, z, b and a: the four weights become views of one concatenated matrix."""
        from .model import _fused

        self.in_weight = _fused((self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a), "weight")

    def forward(self, x: torch.Tensor, rows, layer_cache: RecurrentLayerCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. rows.parents: each row's parent row (-1: the committed state), None for
        a chain; rows.node_mask None: whole sequences from an empty state (draft training's features)."""
        B, T, _ = x.shape
        conv_in, z, b, a = F.linear(x, self.in_weight).split(
            [sum(self.split), self.value_heads * self.value_dim, self.value_heads, self.value_heads], dim=-1)
        fresh = rows.node_mask is None
        window = torch.zeros_like(layer_cache.window) if fresh else layer_cache.window
        state = torch.zeros_like(layer_cache.state) if fresh else layer_cache.state
        mixed = tree_causal_conv_reference(conv_in, self.conv1d.weight[:, 0], window, rows.parents)
        q, k, v = mixed.split(self.split, dim=-1)
        groups = self.value_heads // self.key_heads
        q = (l2norm(q.view(B, T, self.key_heads, self.key_dim).float()) * self.key_dim ** -0.5)
        k = l2norm(k.view(B, T, self.key_heads, self.key_dim).float())
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        v = v.reshape(B, T, self.value_heads, self.value_dim)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out, last_state = tree_gated_delta_reference(q, k, v, g, beta, rows.parents, state)
        if not fresh:
            layer_cache.rows = RecurrentRows(conv_in, k, v, g, beta, last_state)
        out = self.norm(out.to(x.dtype), z.reshape(B, T, self.value_heads, self.value_dim))
        return self.out_proj(out.reshape(B, T, -1))
