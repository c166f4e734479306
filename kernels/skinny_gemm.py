"""Skinny GEMMs (issue 30): y = x @ weight^T for a few rows (a decode step, a verify of up to 128 rows) against a
large weight, streaming the weight once, with a row's arithmetic the same whatever the number of rows M
(batch-invariant: a verified row can equal its decode step bit for bit).

skinny_linear(x [..., K], weight [N, K], bias [N] | None, out_dtype=None) -> [..., N]
    float32 accumulation; the output in out_dtype (default x's dtype), the bias added in float32 before the one
    rounding. The kernel for CUDA tensors with M <= MAX_ROWS (others: F.linear, or the reference where out_dtype
    differs from x's); ENGINE_DISABLE_TRITON=1 forces the reference.
skinny_linear_reference: the same function in plain PyTorch (float32 matmul, then the rounding).

Design
------
Rows are cut into tiles of ROW_TILE = 16, the smallest tensor-core tile: a decode step is one tile with 15 rows
masked, and every tile runs the same instruction sequence over K, so a row's result does not depend on the rows
beside it or on their number. The grid is (row tiles, column tiles, K splits) with row tiles fastest: the
programs that read one weight tile run together, so the weight streams from memory once and the other row tiles
find it in L2. Where the column tiles alone cannot fill the GPU (o_proj, down_proj of an 8B model: 64 tiles of 64
columns on 132 SMs), K is cut into SPLIT_K parts, chosen from (N, K) and the SM count alone, never from M; each
part's float32 partial sums go to a workspace and a second kernel adds the parts in order (and the bias) and
rounds once: the same sums in the same order for any M. With one part, the first kernel rounds and stores itself.

Status: checked against its reference under the interpreter (correctness/test_kernel_skinny_gemm.py; batch
invariance is a GPU check); its speed against cuBLAS is measured by `python -m perf.kernel_times --only skinny`; the
model calls it only with ENGINE_SKINNY_GEMM=1 (engine/model.py, `linear`), until it is measured.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from kernels import tl, triton, triton_disabled

__all__ = ["skinny_linear", "skinny_linear_reference", "skinny_linear_triton", "skinny_enabled", "split_k", "MAX_ROWS"]

MAX_ROWS = 128
ROW_TILE = 16
BLOCK_N = 64
BLOCK_K = 64


def skinny_enabled() -> bool:
    """ENGINE_SKINNY_GEMM=1 (read at each call) makes the model's projections and LM head use skinny_linear: opt-in
    while the kernel is measured against cuBLAS (issue 30)."""
    return os.environ.get("ENGINE_SKINNY_GEMM", "0").strip().lower() not in ("", "0", "false", "no")


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_k(n: int, k: int, sms: int) -> int:
    """K parts for an [n, k] weight: enough programs for two waves over the SMs, each part at least 4 K blocks."""
    tiles = -(-n // BLOCK_N)
    want = -(-2 * sms // tiles)
    return max(1, min(want, k // (4 * BLOCK_K)))


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None, parts: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel (parts: K splits, default split_k() on this device; the tests force others; out: a contiguous
    [M, N] buffer to write)."""
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} (row-major) does not fit x [..., {K}]")
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = out if out is not None else torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if y.shape != (M, N) or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous [{M}, {N}] tensor, got {tuple(y.shape)}")
    if M == 0:
        return y.view(*x.shape[:-1], N)
    if parts is None:
        parts = split_k(N, K, _sm_count(x.device.index or 0) if x.is_cuda else 132)
    per_part = -(-K // (parts * BLOCK_K)) * BLOCK_K  # a multiple of BLOCK_K: the parts' boundaries are fixed
    parts = -(-K // per_part)
    grid = (triton.cdiv(M, ROW_TILE), triton.cdiv(N, BLOCK_N), parts)
    has_bias, ieee = bias is not None, x.dtype == torch.float32
    if parts == 1:
        _skinny_kernel[grid](x2, weight, bias if has_bias else y, y, M, N, K, x2.stride(0), weight.stride(0),
                             per_part, DIRECT=True, HAS_BIAS=has_bias, IEEE=ieee, ROWS=ROW_TILE, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K, num_warps=4)
    else:
        partial = torch.empty(parts, M, N, dtype=torch.float32, device=x.device)
        _skinny_kernel[grid](x2, weight, y, partial, M, N, K, x2.stride(0), weight.stride(0), per_part,
                             DIRECT=False, HAS_BIAS=False, IEEE=ieee, ROWS=ROW_TILE, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             num_warps=4)
        block = 1024
        _sum_parts_kernel[(triton.cdiv(M * N, block),)](partial, bias if has_bias else y, y, M * N, N, parts,
                                                        HAS_BIAS=has_bias, BLOCK=block)
    return y.view(*x.shape[:-1], N)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.is_cuda and triton is not None and not triton_disabled() and 0 < rows <= MAX_ROWS:
        return skinny_linear_triton(x, weight, bias, out_dtype)
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    return skinny_linear_reference(x, weight, bias, out_dtype)


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, per_part,
                       DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One (row tile, column tile, K part): the float32 sums of x[rows] . w[cols] over the part's K blocks in
        order; DIRECT: add the bias, round to out's dtype and store y; else store the partial sums [part, M, N]."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * ROWS + tl.arange(0, ROWS)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        k_begin = pid_k * per_part
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + per_part, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :],
                        mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
            if IEEE:  # float32 inputs: full float32 products, not TF32
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        keep = (rows[:, None] < M) & (cols[None, :] < N)
        if DIRECT:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            tl.store(out_ptr + (pid_k * M + rows[:, None]) * N + cols[None, :], acc, mask=keep)

    @triton.jit
    def _sum_parts_kernel(partial_ptr, b_ptr, y_ptr, MN, N, parts, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """y = (sum over parts, in order, of the partial sums) + bias, rounded once."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < MN
        acc = tl.load(partial_ptr + offs, mask=keep, other=0.0)
        for p in range(1, parts):
            acc += tl.load(partial_ptr + p * MN + offs, mask=keep, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=keep, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=keep)
