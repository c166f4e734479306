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

from kernels.gated_delta import DeltaDims, RecurrentRows, causal_conv, gated_delta_rule, gated_rmsnorm

from .cache import RecurrentLayerCache, RecurrentShape
from .config import ModelConfig


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output, then times SiLU(z) (its weight is a plain scale, not an offset from 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D], z [B, T, H * D] -> [B, T, H, D]."""
        return gated_rmsnorm(x, z, self.weight, self.eps)


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
        self.tp = None  # once sharded by heads (engine.parallel): out_proj is row-parallel

    def state_shape(self) -> RecurrentShape:
        """The cache's state and conv window for this layer: its own heads and channels (a rank's share once
        sharded)."""
        return RecurrentShape(self.value_heads, self.key_dim, self.value_dim, sum(self.split),
                              self.conv1d.kernel_size[0])

    def fuse(self) -> None:
        """One GEMM for qkv, z, b and a: the four weights become views of one concatenated matrix."""
        from .model import _fused

        self.in_weight = _fused((self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a), "weight")

    def forward(self, x: torch.Tensor, rows, layer_cache: RecurrentLayerCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. rows.schedule: how the rows hang together (kernels/gated_delta.py,
        a chain or a tree; a list of one per batch row where each row is its own sequence with its own tree);
        rows.node_mask None: whole sequences from an empty state (draft training's features)."""
        B, T, _ = x.shape
        conv_in, z, b, a = F.linear(x, self.in_weight).split(
            [sum(self.split), self.value_heads * self.value_dim, self.value_heads, self.value_heads], dim=-1)
        fresh = rows.node_mask is None
        window = torch.zeros_like(layer_cache.window) if fresh else layer_cache.window
        state = torch.zeros_like(layer_cache.state) if fresh else layer_cache.state
        schedule = rows.schedule
        dims = DeltaDims(self.key_heads, self.key_dim, self.value_heads, self.value_dim)
        if isinstance(schedule, list):  # one sequence at a time (a batched kernel over such trees is future work)
            parts = [self._mix(conv_in[i:i + 1], a[i:i + 1], b[i:i + 1], window[i:i + 1], state[i:i + 1], dims,
                               schedule[i], keep_last=False) for i in range(B)]
            mixed, out = torch.cat([m for m, _, _ in parts]), torch.cat([o for _, o, _ in parts])
            last_state = None
        else:
            mixed, out, last_state = self._mix(conv_in, a, b, window, state, dims, schedule, keep_last=not fresh)
        if not fresh:
            layer_cache.rows = RecurrentRows(conv_in, mixed, a, b, self.A_log, self.dt_bias, dims, last_state)
        out = self.norm(out, z)
        out = self.out_proj(out.reshape(B, T, -1))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _mix(self, conv_in, a, b, window, state, dims: DeltaDims, schedule, keep_last: bool):
        """The conv and the delta rule over one schedule: (conv output, delta rule output, the state after a chain's
        last row if keep_last and the schedule is a chain, else None)."""
        mixed = causal_conv(conv_in, self.conv1d.weight[:, 0], window, schedule)
        last_state = torch.empty_like(state) if keep_last and schedule.parents is None else None  # a prompt: kept
        out = gated_delta_rule(mixed, a, b, self.A_log, self.dt_bias, dims, state, schedule, last_state)
        return mixed, out, last_state
