"""Weight-only int8 projections: x @ W^T with W stored as int8 and one float32 scale per output row.

For a draft's weights (engine.draft, `--draft-weights int8`): a draft only proposes, and the target's verify decides
every token, so the draft's arithmetic never reaches the output. What it costs does: a DFlash round streams the
draft's layers and the LM head over the block, 3.3 GB for a 5-layer draft at Qwen3-8B's width against the target's
16.4 GB a step. Stored as int8 they are half that (docs/design.md, "Int8 draft weights").

    quantize_int8(w [N, K]) -> Int8Weight(q [N, K] int8, scale [N] float32):
        scale = max |w_row| / 127 (1 for a row of zeros), q = round(w / scale), within [-127, 127].
    int8_linear(x [..., K], w: Int8Weight, bias [N] | None = None, out_dtype=None) -> y [..., N]:
        z = x @ q^T summed in float32 (q's integers are exact in x's 16-bit type), y = z * scale (+ bias),
        rounded to out_dtype (default x.dtype).

Kernel (`_int8_linear_kernel`): grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)). A program owns BLOCK_N weight rows and
BLOCK_M rows of x, walks K in BLOCK_K steps, converts each int8 weight tile to x's type in registers and accumulates
tl.dot(weight tile, x tile^T) in float32 (the weight as the MMA's row side, so a decode-sized x is the narrow side);
the scale and bias are applied once, at the end. Tiles depend on the row count: unlike kernels.skinny_linear this
path need not be batch-invariant, since nothing that verify must reproduce runs through it.

Three entry points, as in kernels.fused: `int8_linear_reference` (plain PyTorch, float32), `int8_linear_triton` (the
kernel; CPU tensors under TRITON_INTERPRET=1), `int8_linear` (the kernel for CUDA tensors in float16/bfloat16, else
the reference; ENGINE_DISABLE_TRITON=1 forces the reference).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import next_pow2, pdl_launch, pdl_options, pdl_wait, tl, triton, triton_disabled
from kernels.fused import _out_rows, _round, _rows, _soft_rne

__all__ = ["Int8Weight", "quantize_int8", "int8_linear", "int8_linear_reference", "int8_linear_triton",
           "int8_config"]

_DTYPES = (torch.float16, torch.bfloat16)
QMAX = 127  # symmetric: -128 is never used, so negating a weight negates its integer


class Int8Weight(NamedTuple):
    """A quantized [N, K] weight: w ~ q * scale[:, None]."""
    q: torch.Tensor      # [N, K] int8
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Per-output-row symmetric int8 of a [N, K] weight, computed in float32 on w's device a block of rows at a time
    (an LM head's float32 copy would be twice its size)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 takes a [N, K] weight, got {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"quantize_int8 takes a floating-point weight, got {w.dtype}")
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int8, device=w.device)
    scale = torch.empty(N, dtype=torch.float32, device=w.device)
    step = max(1, (1 << 24) // max(K, 1))  # 64 MB of float32 a block
    for lo in range(0, N, step):
        wf = w[lo:lo + step].float()
        amax = wf.abs().amax(dim=1)
        if not torch.isfinite(amax).all():
            raise ValueError("quantize_int8: the weight has non-finite values")
        s = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
        scale[lo:lo + step] = s
        q[lo:lo + step] = torch.round(wf / s[:, None]).clamp_(-QMAX, QMAX)
    return Int8Weight(q, scale)


def int8_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows of x against an [N, K] int8 weight. A draft
    block's few rows: 32 weight rows a program. Where that makes 192 programs or more (1.5 an SM), 2 warps with
    256-wide K steps and 3 in flight: with 4, Triton lays the warps 2 x 2 over the 32 x 16 output and every weight
    byte is converted twice. Fewer programs: 4 warps and 4 steps in flight, 512 wide from K 8192. Past 32 rows
    shorter steps, to stay within shared memory; a prompt's many rows: square tiles. Tuned on an H100 at a Qwen3-8B
    draft's shapes (docs/performance.md, "Int8 draft weights")."""
    if M <= 32:
        block_m = max(16, next_pow2(M))
        if -(-N // 32) >= 192:
            return block_m, 32, min(256, max(32, next_pow2(K))), 2, 3
        return block_m, 32, min(512 if K >= 8192 else 256, max(32, next_pow2(K))), 4, 4
    if M <= 64:
        return 64, 32, min(256, max(32, next_pow2(K))), 4, 3
    return 64, 128, min(64, max(32, next_pow2(K))), 8, 3


# ------------------------------------------------------------------------------------------------ reference

def int8_linear_reference(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain PyTorch: the integer products summed in float32, then the scale and bias."""
    _check(x, w, bias)
    z = (x.float() @ w.q.float().t()) * w.scale.float()
    if bias is not None:
        z = z + bias.float()
    return z.to(out_dtype or x.dtype)


def _check(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> None:
    if not isinstance(w, Int8Weight):
        raise TypeError(f"w must be an Int8Weight (quantize_int8), got {type(w).__name__}")
    if w.q.dim() != 2 or w.q.dtype != torch.int8:
        raise ValueError(f"w.q must be an int8 [N, K] tensor, got {tuple(w.q.shape)} {w.q.dtype}")
    N, K = w.q.shape
    if tuple(w.scale.shape) != (N,):
        raise ValueError(f"w.scale must be [{N}], got {tuple(w.scale.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"x's last dim must be {K} for a weight {tuple(w.q.shape)}, got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")


# --------------------------------------------------------------------------------------------------- kernel

if triton is not None:

    @triton.jit
    def _int8_linear_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_qn, s_ym,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, F32_DOT: tl.constexpr,
                            ROUND: tl.constexpr, SOFT_RNE: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cmask, rmask = cols < N, rows < M
        dt: tl.constexpr = x_ptr.dtype.element_ty
        q_rows = q_ptr + cols.to(tl.int64)[:, None] * s_qn
        x_rows = x_ptr + rows.to(tl.int64)[None, :] * s_xm
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
            ks = k * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = ks < K
            q = tl.load(q_rows + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0)     # [BN, BK] int8
            xt = tl.load(x_rows + ks[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)  # [BK, BM]
            if F32_DOT:  # the interpreter's 16-bit dot is wrong; float32 products of these values are exact
                acc += tl.dot(q.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(q.to(dt), xt)
        acc = acc * tl.load(s_ptr + cols, mask=cmask, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[:, None]
        out_t: tl.constexpr = y_ptr.dtype.element_ty
        if ROUND:  # to a 16-bit output
            acc = _round(acc, out_t, SOFT_RNE)
        tl.store(y_ptr + rows.to(tl.int64)[None, :] * s_ym + cols[:, None], acc.to(out_t),
                 mask=cmask[:, None] & rmask[None, :])


# ------------------------------------------------------------------------------------------------ launchers

def int8_linear_triton(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                       config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton kernel. `out`, if given, is a [..., N] tensor of out_dtype viewable as [rows, N]; `config`
    overrides int8_config (kernel-time sweeps)."""
    if triton is None:
        raise RuntimeError("int8_linear_triton needs triton")
    _check(x, w, bias)
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    N, K = w.q.shape
    out_dtype = out_dtype or x.dtype
    shape = (*x.shape[:-1], N)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=x.device)
    y2 = _out_rows(out, shape, out_dtype, x.device, "out")
    x2 = _rows(x, K, "x")
    M = x2.shape[0]
    if M == 0 or N == 0:
        return out
    q, scale = w.q if w.q.stride(1) == 1 else w.q.contiguous(), w.scale.float().contiguous()
    BM, BN, BK, warps, stages = config or int8_config(M, N, K)
    pdl = pdl_launch(x)
    _int8_linear_kernel[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
        x2, q, scale, scale if bias is None else bias, y2, M, N, K, x2.stride(0), q.stride(0), y2.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, NUM_STAGES=stages,
        F32_DOT=x.device.type == "cpu", ROUND=out_dtype != torch.float32, SOFT_RNE=_soft_rne(out), PDL=pdl,
        num_warps=warps, **pdl_options(pdl))
    return out


# ---------------------------------------------------------------------------------------------------- dispatcher

def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Triton kernel for CUDA tensors in float16/bfloat16, else the reference (module docstring)."""
    if triton is not None and x.is_cuda and x.dtype in _DTYPES and not triton_disabled():
        return int8_linear_triton(x, w, bias, out_dtype)
    return int8_linear_reference(x, w, bias, out_dtype)
