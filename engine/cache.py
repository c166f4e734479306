"""Preallocated per-layer caches with append, rollback and keep-the-accepted-path, their committed length on the device.

A round writes its candidate rows after the committed prefix (slots start .. start+T-1); once the walk has chosen the
accepted path, the decoder asks the cache once to keep it (`keep`) and then advances `start`. Rolling back is just not
advancing. `start` is a device tensor so that a whole round can run inside a CUDA graph, and nothing reads it on the
host inside a round.

Two kinds of layer share these operations (docs/design.md, "The per-layer cache"):
- attention layers keep keys and values. Those of all attention layers sit in one tensor each ([layers, batch,
  kv_heads, capacity, head_dim]), so keeping the accepted rows (`kernels.compact_kv`: moved to contiguous slots) is
  one launch;
- Gated DeltaNet layers keep a recurrent state [batch, heads, dk, dv] (float32) and a conv window [batch, channels,
  kernel - 1]. A round records its rows' inputs; keeping the path replays them along it from the committed state, so
  the state never depends on a sibling, with the verify pass's own kernel (kernels/gated_delta.py).
Tensors keep a batch dimension even though decoding uses batch 1 today.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gated_delta import RecurrentRows, conv_window, keep_recurrent, path_schedule
from kernels.tree_ops import compact_kv


class AttentionLayerCache:
    """One attention layer's view of the stacked keys and values: [batch, kv_heads, capacity, head_dim]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


@dataclass(frozen=True)
class RecurrentShape:
    """A Gated DeltaNet layer's state: heads x [key_dim, value_dim], and a conv over `channels` of width `kernel`."""
    heads: int
    key_dim: int
    value_dim: int
    channels: int
    kernel: int


class RecurrentLayerCache:
    """One Gated DeltaNet layer's committed state and conv window, and the last forward's rows."""

    def __init__(self, shape: RecurrentShape, batch: int, dtype, device):
        self.state = torch.zeros(batch, shape.heads, shape.key_dim, shape.value_dim, dtype=torch.float32, device=device)
        self.window = torch.zeros(batch, shape.channels, shape.kernel - 1, dtype=dtype, device=device)
        self.rows: RecurrentRows | None = None

    def reset(self) -> None:
        self.state.zero_()
        self.window.zero_()

    def keep(self, path: torch.Tensor, accepted: torch.Tensor, schedule=None) -> None:
        """path [P] and accepted (0-d) for every batch row; or [B, P] and [B], each row its own sequence (schedule:
        a list of one per row)."""
        if path.dim() == 1:
            keep_recurrent(self.rows, self.state, self.window, path, accepted, schedule)
            return
        for b in range(path.shape[0]):  # one sequence at a time (a batched replay kernel is future work)
            one = slice(b, b + 1)
            keep_recurrent(self.rows.row(b), self.state[one], self.window[one], path[b], accepted[b],
                           None if schedule is None else schedule[b])

    def view(self, first: int, end: int) -> "RecurrentLayerCache":
        """Batch rows first .. end - 1 (views of the state and window)."""
        view = object.__new__(RecurrentLayerCache)
        view.state, view.window, view.rows = self.state[first:end], self.window[first:end], None
        return view

    def keep_prefix(self, n: int) -> None:
        """Commit all n rows of the last forward, a chain (the prompt): its state was written by the forward."""
        path = torch.arange(n, device=self.state.device)
        self.window.copy_(conv_window(self.rows.conv_in, self.window, path, torch.tensor(n, device=path.device)))
        self.state.copy_(self.rows.last_state)


class ModelCache:
    """The caches of all layers of one model plus the committed length they share. recurrent: the shape of the state
    of the layers whose indices are in recurrent_layers (Gated DeltaNet); the other layers are attention layers.
    own_lengths: the batch rows are separate sequences, each with its own committed length (`start` [batch]; batched
    decoding), rather than rows that advance together (`start` 0-d)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device, batch: int = 1,
                 recurrent_layers: tuple[int, ...] = (), recurrent: RecurrentShape | None = None,
                 own_lengths: bool = False):
        n_attention = num_layers - len(recurrent_layers)
        shape = (n_attention, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers: list[AttentionLayerCache | RecurrentLayerCache] = []
        for i in range(num_layers):
            if i in recurrent_layers:
                self.layers.append(RecurrentLayerCache(recurrent, batch, dtype, device))
            else:
                a = sum(j not in recurrent_layers for j in range(i))  # its index among the attention layers
                self.layers.append(AttentionLayerCache(self.k[a], self.v[a]))
        self.recurrent = [layer for layer in self.layers if isinstance(layer, RecurrentLayerCache)]
        self.capacity = capacity
        # committed rows, on the device: one for all rows, or one per sequence
        self.start = torch.zeros((batch,) if own_lengths else (), dtype=torch.long, device=device)

    def reset(self) -> None:
        self.start.zero_()
        for layer in self.recurrent:  # a recurrence starts from zeros; stale keys and values are never read
            layer.reset()

    def rows(self, first: int, count: int = 0) -> "ModelCache":
        """A view of batch rows first .. first + count - 1 (count 0: every row from `first`) of a cache whose rows
        have their own lengths: writes through it land in this cache (batched decoding runs a round over the rows in
        use, and prefills one row alone)."""
        if self.start.dim() != 1:
            raise ValueError("row views need a cache whose rows have their own lengths")
        end = first + count if count else self.start.shape[0]
        view = object.__new__(ModelCache)
        view.k, view.v = self.k[:, first:end], self.v[:, first:end]
        view.layers, a = [], 0
        for layer in self.layers:
            if isinstance(layer, RecurrentLayerCache):
                view.layers.append(layer.view(first, end))
            else:
                view.layers.append(AttentionLayerCache(view.k[a], view.v[a]))
                a += 1
        view.recurrent = [layer for layer in view.layers if isinstance(layer, RecurrentLayerCache)]
        view.capacity, view.start = self.capacity, self.start[first:end]
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Batch row src's sequence becomes row dst's (batched decoding keeps the rows in use first)."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])
        for layer in self.recurrent:
            layer.state[dst].copy_(layer.state[src])
            layer.window[dst].copy_(layer.window[src])
        self.start[dst] = self.start[src]

    def keep(self, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """Keep the accepted path of the last forward's rows (path: row indices, root first, `accepted` of them
        real; per sequence [B, P] and [B] when rows have their own lengths): attention rows move to slots start..,
        recurrent states become the last accepted row's. The caller advances `start`."""
        if self.k.shape[0]:
            compact_kv(self.k, self.v, self.start, path, accepted)
        if self.recurrent:
            # shared by the layers; one per sequence where rows have their own paths
            schedule = path_schedule(path, accepted) if path.dim() == 1 else \
                [path_schedule(p, a) for p, a in zip(path, accepted)]
            for layer in self.recurrent:
                layer.keep(path, accepted, schedule)

    def keep_prefix(self, n: int) -> None:
        """Keep all n rows of the last forward, a chain (a prompt): attention rows are already in place."""
        for layer in self.recurrent:
            layer.keep_prefix(n)
