"""A one-shot all-reduce over peer memory fused with the residual add and the RMSNorm that follow it: tensor
parallelism's row-parallel layers (o_proj, down_proj) end in an all-reduce, and the next thing the model does is
norm(residual + that sum). One kernel per row-parallel layer instead of three (staging copy, all-reduce, norm), and
one barrier instead of two.

    all_reduce_rmsnorm(parts [world, ..., N], weight [N], eps, residual [..., N] | None) -> (y, h)

    s = parts[0] + parts[1] + ... in float32, in rank order, rounded to the dtype (every rank gets the same bits);
    then kernels.fused's RMSNorm: h = s + residual (rounded), y = weight * (h * rsqrt(mean(h^2) + eps)), both
    products rounded. Without a residual h is s.

Each rank's part lives in its own symmetric-memory buffer (torch.distributed._symmetric_memory: every rank can read
every other rank's buffer over NVLink); the row-parallel GEMM writes straight into it (engine.parallel). Program
`row` of the kernel on rank r:
1. signals every peer p (its signal pad's entry [row, r]: compare-and-swap 0 -> 1, release, system scope, spinning
   while the peer has not yet consumed the previous signal), then waits for each peer's signal in its own pad
   (entry [row, p]: compare-and-swap 1 -> 0, acquire). The GEMM before the kernel has finished writing the row.
2. reads the row from every rank's buffer (volatile loads: the peer's memory, not a cached copy; 16 bytes at a time
   where the rows are 16-byte aligned), adds in rank order, then adds the residual and normalises as kernels.fused's
   rmsnorm kernel does (the same jit helper).
There is no second barrier (a rank waiting until its peers have read its buffer): callers alternate between two
slots of the buffer, and a rank writes slot s again only after its peers have signalled from the call that used
the other slot, which they enter only after their read of slot s is complete (engine.parallel, "Two slots").

`all_reduce_rmsnorm_reference` is the plain PyTorch function (on the stacked parts); `all_reduce_rmsnorm_triton`
launches the kernel on the buffers' device pointers. The GPU test runs two ranks under torchrun
(correctness/test_kernel_all_reduce.py).
"""
from __future__ import annotations

import torch

from kernels import next_pow2, tl, triton
from kernels.fused import _normalize_store, _round, rmsnorm_reference

__all__ = ["all_reduce_rmsnorm_reference", "all_reduce_rmsnorm_triton"]


def all_reduce_rmsnorm_reference(parts: torch.Tensor, weight: torch.Tensor, eps: float,
                                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """parts [world, ..., N]: the sum over ranks in rank order (float32, rounded once), then kernels.fused's
    RMSNorm with the residual add. Returns (y, h)."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return rmsnorm_reference(total.to(parts.dtype), weight, eps, residual)


if triton is not None:

    @triton.jit
    def _signal_then_wait(send, wait):
        """Thread 0 of the program: set *send from 0 to 1 (spinning while it is still 1: the peer has not taken the
        previous signal), release, system scope; then take *wait from 1 to 0 (spinning until it is 1), acquire.
        The caller's barrier makes the other threads wait for thread 0."""
        tl.inline_asm_elementwise(
            """
            {
                .reg .u32 %lane, %old;
                .reg .pred %first, %done;
                mov.u32 %lane, %tid.x;
                setp.eq.u32 %first, %lane, 0;
                @!%first bra skip;
            send:
                atom.global.release.sys.cas.b32 %old, [$1], 0, 1;
                setp.eq.u32 %done, %old, 0;
                @!%done bra send;
            take:
                atom.global.acquire.sys.cas.b32 %old, [$2], 1, 0;
                setp.eq.u32 %done, %old, 1;
                @!%done bra take;
            skip:
                mov.u32 $0, 0;
            }
            """,
            "=r,l,l", [send, wait], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _all_reduce_rmsnorm_kernel(bufs_ptr, pads_ptr, offset, res_ptr, w_ptr, y_ptr, h_ptr, N, eps, rank,
                                   s_res, s_y, s_h,
                                   WORLD: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                                   SOFT_RNE: tl.constexpr, ALIGNED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        one = tl.zeros([1], dtype=tl.int64)  # the signal addresses as 1-element tensors (inline asm operands)
        mine = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
        for p in tl.static_range(WORLD):
            if p != rank:
                peer = tl.load(pads_ptr + p).to(tl.pointer_type(tl.int32))
                _signal_then_wait(peer + row * WORLD + rank + one, mine + row * WORLD + p + one)
        tl.debug_barrier()
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        dt: tl.constexpr = y_ptr.dtype.element_ty
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            src = tl.load(bufs_ptr + p).to(tl.pointer_type(dt)) + offset + row * N
            if ALIGNED:  # 16-byte rows: vector loads (a pointer read from memory has no known alignment otherwise)
                src = tl.multiple_of(src, 16)
            total += tl.load(src + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
        h = _round(total, dt, SOFT_RNE)
        if HAS_RES:
            r = tl.load(res_ptr + row * s_res + offs, mask=mask, other=0.0).to(tl.float32)
            h = _round(h + r, dt, SOFT_RNE)
        tl.store(h_ptr + row * s_h + offs, h.to(dt), mask=mask)
        _normalize_store(h, w_ptr, y_ptr + row * s_y, offs, mask, N, eps, SOFT_RNE)


def all_reduce_rmsnorm_triton(buffer_ptrs: torch.Tensor, signal_pad_ptrs: torch.Tensor, rank: int, offset: int,
                              part: torch.Tensor, weight: torch.Tensor, eps: float,
                              residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel. `part` [..., N] is this rank's part: contiguous, `offset` elements into its symmetric buffer, and
    every rank's part sits at the same offset of its own. buffer_ptrs and signal_pad_ptrs (int64 [world] on the
    device: the symmetric-memory handle's buffer_ptrs_dev and signal_pad_ptrs_dev) are every rank's buffer base and
    signal pad; a pad needs world 32-bit entries per row. Returns new (y, h) tensors."""
    if triton is None:
        raise RuntimeError("all_reduce_rmsnorm_triton needs triton")
    N = part.shape[-1]
    if not part.is_contiguous():
        raise ValueError("the part must be contiguous inside its buffer")
    if tuple(weight.shape) != (N,) or weight.dtype != part.dtype:
        raise ValueError(f"weight must be [{N}] {part.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != part.shape or residual.dtype != part.dtype):
        raise ValueError(f"residual must match the part {tuple(part.shape)} {part.dtype}: "
                         f"{tuple(residual.shape)} {residual.dtype}")
    rows = part.numel() // max(1, N)
    y, h = torch.empty_like(part), torch.empty_like(part)
    if rows == 0 or N == 0:
        return y, h
    res2 = part.view(rows, N) if residual is None else residual.reshape(rows, N)
    block = next_pow2(N)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    _all_reduce_rmsnorm_kernel[(rows,)](buffer_ptrs, signal_pad_ptrs, offset, res2, weight, y, h, N, float(eps), rank,
                                        res2.stride(0), N, N,
                                        WORLD=buffer_ptrs.numel(), HAS_RES=residual is not None, BLOCK=block,
                                        SOFT_RNE=False, ALIGNED=_aligned_rows(N, offset, part.element_size()),
                                        num_warps=num_warps)
    return y, h


def _aligned_rows(N: int, offset: int, size: int) -> bool:
    """Every rank's rows start 16-byte aligned: symmetric-memory buffers start at a mapping granule, and the offset
    and the row length keep the alignment. Then the peers' rows are read with 16-byte loads, not one 2-byte NVLink
    load per element (test_kernel_all_reduce.py checks the PTX)."""
    return (N * size) % 16 == 0 and (offset * size) % 16 == 0
