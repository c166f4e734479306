"""Preallocated per-layer caches with append, rollback and compaction.

A round writes its candidate tokens after the committed prefix (slots length .. length+T-1) in every layer, then
`keep` commits the accepted ones: it moves their rows to contiguous slots and drops the rest. Rolling back is
just not committing. Each layer owns its storage so that a layer can later hold other state (a recurrent state
and a conv window for linear-attention layers) behind the same `store`/`keep` operations. Tensors keep a batch
dimension even though decoding uses batch 1 today.
"""
from __future__ import annotations

import torch


class AttentionLayerCache:
    """Keys and values of one attention layer: [batch, kv_heads, capacity, head_dim]."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new rows at slots start.. and return keys and values of slots 0..start+T-1."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Move rows start+offsets[i] to start+i (offsets increasing, so rows only move down)."""
        n = offsets.numel()
        src = offsets + start
        self.k[:, :, start:start + n] = self.k.index_select(2, src)
        self.v[:, :, start:start + n] = self.v.index_select(2, src)


class ModelCache:
    """The caches of all layers of one model plus the committed length they share."""

    def __init__(self, layers: list, capacity: int):
        self.layers = layers
        self.capacity = capacity
        self.length = 0

    def check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise RuntimeError(f"cache overflow: {self.length} + {n} > capacity {self.capacity}")

    def commit(self, n: int) -> None:
        """Accept the first n rows written after the committed prefix (a linear prefix: no copy)."""
        self.length += n

    def keep(self, offsets: list[int]) -> None:
        """Accept the written rows at these offsets after the committed prefix, in order, and drop the rest."""
        if offsets != list(range(len(offsets))):
            idx = torch.tensor(offsets, device=self.layers[0].k.device)
            for layer in self.layers:
                layer.keep(self.length, idx)
        self.length += len(offsets)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length


def attention_cache(num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device,
                    batch: int = 1) -> ModelCache:
    """A cache for a stack of attention layers."""
    return ModelCache([AttentionLayerCache(batch, kv_heads, capacity, head_dim, dtype, device)
                       for _ in range(num_layers)], capacity)
