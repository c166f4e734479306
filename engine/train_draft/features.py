"""The context features the draft reads: the frozen target's hidden states after its `target_layer_ids`, from the
engine's own forward over whole sequences, computed once for all sequences into a feature bank when they fit in
memory (in float8 when only that fits), else in every step."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from ..memory import available_bytes
from ..model import Transformer


def target_features(model: Transformer, width: int, batch: int, layers: tuple[int, ...]):
    """fn(tokens [batch, width]) -> (final hidden states, context features of `layers`): the target's forward over
    whole sequences from position 0, causal (no node_mask), the same blocks and kernels as at inference, in one cache
    of that shape reused by every call. Padding at the end never reaches a real row."""
    cache = model.new_cache(width, batch=batch)
    positions = torch.arange(width, device=model.device).expand(batch, width)
    return lambda tokens: model(tokens, positions, cache, None, capture=layers)


# The share of the device's free memory that the feature bank may take: the step's own buffers need the rest. The
# default recipe's bank: about 33 M positions x 5 layers x 576 values, 179 GiB in bfloat16, 90 GiB in float8.
FEATURE_BANK_SHARE = 0.7


class Float8Rows:
    """Feature rows [n, layers * hidden] kept as float8 e4m3 with one float32 scale per row and layer (its largest
    magnitude maps to 448, e4m3's largest): half the bytes of bfloat16, each value within 1/16 of itself (3 mantissa
    bits). Indexing returns the rows in `dtype`, like a plain bank tensor."""

    def __init__(self, n: int, layers: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.values = torch.empty(n, layers, hidden, dtype=torch.uint8, device=device)  # e4m3 bits
        self.scales = torch.empty(n, layers, 1, dtype=torch.float32, device=device)
        self.dtype, self.shape = dtype, (n, layers * hidden)

    @staticmethod
    def nbytes(n: int, layers: int, hidden: int) -> int:
        """What Float8Rows(n, layers, hidden) takes: a byte per value, a float32 scale per row and layer."""
        return n * layers * (hidden + 4)

    def __setitem__(self, rows: slice, x: torch.Tensor) -> None:
        x = x.float().unflatten(-1, self.values.shape[1:])
        scale = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 448.0
        self.values[rows] = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        self.scales[rows] = scale

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        # gathered as bytes: indexing works on uint8 everywhere, then one conversion of the rows taken
        values = self.values[idx].view(torch.float8_e4m3fn).float()
        return (values * self.scales[idx]).flatten(-2).to(self.dtype)


def free_memory(dev: torch.device) -> int:
    """Bytes the feature bank may draw on: free on the GPU plus what PyTorch holds unused (the data's caches and
    graphs), or the host's available memory."""
    return available_bytes(dev) or 0


@dataclass
class FeatureBank:
    """The target's context features of every position of every packed sequence, computed once (feature_bank)."""
    rows: torch.Tensor | Float8Rows  # [sum of lengths, len(layers) * hidden], sequence after sequence
    starts: torch.Tensor             # the first row of each sequence
    storage: str                     # "bfloat16", "float32", ... or "float8 e4m3"

    def row_index(self, packed, idx: torch.Tensor) -> torch.Tensor:
        """The row of every position of sequences idx [b, W]. Positions past a sequence's end repeat its last row:
        padding, never in a real position's context."""
        lengths, W = packed[1][idx], packed[0].shape[1]
        offsets = torch.arange(W, device=idx.device).minimum(lengths[:, None] - 1)
        return self.starts[idx, None] + offsets


@torch.no_grad()
def feature_bank(model: Transformer, packed, layers: tuple[int, ...], batch: int, log=print) -> FeatureBank | None:
    """The target's context features at every position of every packed sequence, computed once. The target is
    frozen, so running it in every step recomputes the same rows (10.4 of a 36.8 ms step on the H200). Kept in the
    model's dtype when that takes at most FEATURE_BANK_SHARE of the free memory, else as Float8Rows when those fit
    (about twice the data); else None, and train() runs the target in every step. Logs which."""
    from tqdm import tqdm

    tokens, lengths, _ = packed
    N, W = tokens.shape
    dev, dtype = tokens.device, model.embed_tokens.weight.dtype
    positions, hidden = int(lengths.sum()), model.cfg.hidden_size
    width = len(layers) * hidden
    need, need_fp8 = positions * width * dtype.itemsize, Float8Rows.nbytes(positions, len(layers), hidden)
    free = free_memory(dev)
    if need <= FEATURE_BANK_SHARE * free:
        rows, storage = torch.empty(positions, width, dtype=dtype, device=dev), str(dtype).removeprefix("torch.")
    elif need_fp8 <= FEATURE_BANK_SHARE * free:
        rows, storage = Float8Rows(positions, len(layers), hidden, dtype, dev), "float8 e4m3"
        need = need_fp8
    else:
        log(f"features: the target runs in every step (computing them once would take {need / 2**30:.1f} GiB, "
            f"{need_fp8 / 2**30:.1f} GiB in float8; {free / 2**30:.1f} GiB free)")
        return None
    t0 = time.perf_counter()
    starts = lengths.cumsum(0) - lengths
    features_of = target_features(model, W, batch, layers)
    first = starts.tolist()
    for lo in tqdm(range(0, N, batch), desc="target features", unit="batch", file=sys.stderr):
        chunk = tokens[lo:lo + batch]
        n = len(chunk)
        if n < batch:  # the cache's batch is fixed: pad the last chunk with copies of its first row
            chunk = torch.cat((chunk, chunk[:1].expand(batch - n, W)))
        _, feats = features_of(chunk)
        real = torch.arange(W, device=dev) < lengths[lo:lo + n, None]
        chunk_rows = feats[:n][real]  # each sequence's positions in order, the sequences one after another
        rows[first[lo]:first[lo] + len(chunk_rows)] = chunk_rows
    log(f"features: {positions} positions x {width} computed once, kept in {storage} ({need / 2**30:.1f} GiB of "
        f"{free / 2**30:.1f} GiB free, {time.perf_counter() - t0:.0f} s)")
    return FeatureBank(rows, starts, storage)
