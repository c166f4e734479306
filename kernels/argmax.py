"""The index of each row's largest logit: the decode loop's greedy token (target posterior, DFlash's draft chain,
the bonus token after the prompt).

argmax(x [..., V] float) -> [...] int64, torch.argmax(-1) exactly: the first index of the largest value, a NaN
counting as larger than everything (the first NaN wins), -0.0 equal to +0.0, a row of -inf giving 0.

- `argmax_reference`: torch.argmax over the last dim of [R, V].
- `argmax_triton`: one launch. torch.argmax reads a row with one thread block: about 13 us for SmolLM2's 49,152
  float32 logits on an H100/H200, paid every decode step. Here grid (R, chunks): each program reduces a chunk of
  its row to one partial, then counts its arrival on the row's counter (`kernels.arrival_counters`, acq_rel), and
  the last program to arrive merges the row's partials and writes out[r] (the split merge of tree_attention).
  A partial is one int64 whose order is the argmax order: the value's float32 bits made a two's-complement
  integer (integer order = float order; every NaN the largest key, -0.0 made +0.0) in the high 32 bits, and
  2^31 - 1 - index in the low ones, so one integer max per chunk and one per row decide value and first index
  together, whichever program finished last. No host synchronisation; the scratch and the grid depend on shapes
  only, so the call can be captured in a CUDA graph (allocate the counters before, as the engine's eager warm-up
  round does).
- `argmax`: the kernel for CUDA tensors, else the reference (ENGINE_DISABLE_TRITON=1 forces it, and
  ENGINE_TRITON_ARGMAX=0 for this kernel alone: A/B runs); any leading dims.
"""
from __future__ import annotations

import torch

from kernels import arrival_counters, env_switch, pdl_launch, pdl_options, pdl_wait, tl, triton, triton_disabled

__all__ = ["argmax", "argmax_reference", "argmax_triton"]

MAX_CHUNK = 4096  # logits per program: 12 programs a row at SmolLM2's 49,152, 38 at Qwen3's 151,936
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"expected float logits [R, V], got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError("argmax over an empty vocabulary")


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return x.argmax(-1)


if triton is not None:

    @triton.jit
    def _argmax_kernel(x_ptr, stride_row, V, part_ptr, count_ptr, out_ptr, stride_out, n_chunks,
                       CHUNK: tl.constexpr, CP: tl.constexpr, ONE_CHUNK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        pdl_wait(PDL)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        # -inf past V: a valid element (>= -inf, lower index) always wins over it
        x = tl.load(x_ptr + row * stride_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0 for torch: one key for both
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # sign-magnitude to two's complement: integer order = float order
        key = tl.where(x != x, 0x7FFFFFFF, key)  # any NaN above +inf (and -NaN too)
        packed = (key.to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)  # equal keys: the lower index is larger
        best = tl.max(packed, axis=0)
        if ONE_CHUNK:
            tl.store(out_ptr + row * stride_out, 0x7FFFFFFF - (best & 0x7FFFFFFF))
        else:
            tl.store(part_ptr + row * n_chunks + chunk, best)
            # every thread's store before one thread's acq_rel count; the last to arrive sees all the partials
            tl.debug_barrier()
            counter = count_ptr + row
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_chunks - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call on the stream
                c = tl.arange(0, CP)
                # lanes past n_chunks read the last partial again: a duplicate changes no max. .cg: from L2, where
                # the other programs' stores are, not a stale L1 line
                parts = tl.load(part_ptr + row * n_chunks + tl.minimum(c, n_chunks - 1), cache_modifier=".cg")
                best = tl.max(parts, axis=0)
                tl.store(out_ptr + row * stride_out, 0x7FFFFFFF - (best & 0x7FFFFFFF))


def _chunk_size(V: int) -> int:
    return min(MAX_CHUNK, triton.next_power_of_2(V))


def argmax_triton(x: torch.Tensor, out: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """The one-launch Triton argmax of x [R, V] (float32, bfloat16 or float16; any row stride), into `out` (int64
    [R]) if given. `chunk` (a power of two) overrides the vocabulary split, which otherwise depends on V alone
    (tests: several chunks at small V)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    _check(x)
    if x.dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    R, V = x.shape
    if V >= 1 << 31:
        raise ValueError(f"a row of {V} logits: indices must fit 31 bits")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(R, dtype=torch.long, device=x.device)
    elif out.shape != (R,) or out.dtype != torch.long or out.device != x.device:
        raise ValueError(f"out must be an int64 tensor of shape {(R,)} on {x.device}")
    if R == 0:
        return out
    chunk = chunk or _chunk_size(V)
    if chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    n_chunks = triton.cdiv(V, chunk)
    one = n_chunks == 1
    parts = out if one else torch.empty(R, n_chunks, dtype=torch.long, device=x.device)  # every slot written
    count = out if one else arrival_counters(R, x.device)
    pdl = pdl_launch(x)
    _argmax_kernel[(R, n_chunks)](x, x.stride(0), V, parts, count, out, out.stride(0), n_chunks,
                                  CHUNK=chunk, CP=triton.next_power_of_2(n_chunks), ONE_CHUNK=one, PDL=pdl,
                                  num_warps=8 if chunk >= 2048 else 4 if chunk >= 512 else 1, **pdl_options(pdl))
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for float logits of any leading shape ([V] -> 0-d, [R, V] -> [R], [B, T, V] -> [B, T]): the
    kernel on CUDA, else torch."""
    if (triton is not None and x.is_cuda and x.dtype in DTYPES and x.dim() >= 1 and x.shape[-1] > 0
            and not triton_disabled() and env_switch("ENGINE_TRITON_ARGMAX") is not False):
        return argmax_triton(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])
    return x.argmax(-1)
