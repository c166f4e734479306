"""Triton kernels of the engine's GPU path, each beside a plain PyTorch reference of the same function.

- tree_attention: queries are a draft tree's nodes, keys the committed cache plus the nodes, an ancestor mask
  decides visibility (split along the keys for long contexts);
- topk: the top-k tokens and log-probabilities of each draft depth (the tree builder's input);
- tree_ops: best-first tree build, the walk, and KV-cache compaction for all layers in one launch;
- fused: RMSNorm + residual add, q/k RMSNorm + RoPE + KV-cache store, SiLU(gate) * up.
- skinny_linear: a projection with its RMSNorm (and residual add) in the prologue and SiLU(gate) * up in the
  epilogue, batch-invariant, for launch-bound models (SmolLM2-135M's width).
- cross_entropy: per-row cross-entropy and argmax over the vocabulary, with its gradient (draft training's loss).

Each public function dispatches to its Triton kernel for CUDA tensors and to the reference otherwise;
ENGINE_DISABLE_TRITON=1 forces the references everywhere.
"""

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (a CPU-only platform without wheels): the references are the only path
    triton = None
    tl = None


def triton_disabled() -> bool:
    """ENGINE_DISABLE_TRITON=1 (read at each call) makes every dispatcher use its PyTorch reference."""
    return os.environ.get("ENGINE_DISABLE_TRITON", "0").strip().lower() not in ("", "0", "false", "no")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())


def row_values(value, rows: int, name: str = "start") -> list[int]:
    """A per-sequence argument of a reference, on the host: an int or a 1-element tensor (every row the same), or
    one value per batch row (batched decoding: rows that are separate sequences)."""
    if hasattr(value, "numel") and value.numel() > 1:
        if value.numel() != rows:
            raise ValueError(f"{name} has {value.numel()} values for a batch of {rows}")
        return [int(x) for x in value.reshape(-1).tolist()]
    return [int(value)] * rows
