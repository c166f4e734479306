"""Preallocated caches with append, rollback and compaction, their committed length kept on the device.

A round writes its candidate rows after the committed prefix (slots start .. start+T-1) in every layer; the
walk then keeps the accepted ones: `kernels.compact_kv` moves their rows to contiguous slots, and `start`
advances. Rolling back is just not advancing. `start` is a device tensor so that a whole round can run inside a
CUDA graph, and nothing reads it on the host inside a round. The keys and values of all
layers sit in one tensor each ([layers, batch, kv_heads, capacity, head_dim]) so that compaction is one launch;
a layer's view can later sit beside other per-layer state (a recurrent state and a conv window for
linear-attention layers). Tensors keep a batch dimension even though decoding uses batch 1 today.
"""
from __future__ import annotations

import torch


class AttentionLayerCache:
    """One attention layer's view of the stacked keys and values: [batch, kv_heads, capacity, head_dim]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


class ModelCache:
    """The caches of all layers of one model plus the committed length they share."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device, batch: int = 1):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [AttentionLayerCache(self.k[i], self.v[i]) for i in range(num_layers)]
        self.capacity = capacity
        self.start = torch.zeros((), dtype=torch.long, device=device)  # committed rows, on the device

    def reset(self) -> None:
        self.start.zero_()
