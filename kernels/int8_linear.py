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
    x may also be int8 rows, Int8Rows(q [..., K] int8, scale [...] float32, dtype) (quantize_rows_int8, or a norm
    kernel that makes them: kernels.fused.rmsnorm with an Int8Rows out): then z = x.q @ q^T is summed exactly in
    int32, y = float(z) * scale * x.scale (+ bias). A w8a8 draft's qkv, gate/up and LM-head GEMMs run so: nothing
    is converted in the main loop, and x's re-reads through L2 are half the bytes.

Kernel (`_int8_linear_kernel`): grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)). A program owns BLOCK_N weight rows and
BLOCK_M rows of x, walks K in BLOCK_K steps, converts each int8 weight tile to x's type in registers and accumulates
tl.dot(weight tile, x tile^T) in float32 (the weight as the MMA's row side, so a decode-sized x is the narrow side;
int8 rows: both int8 tiles straight into an int32 tl.dot); the scales and bias are applied once, at the end. Tiles
depend on the row count: unlike kernels.skinny_linear this path need not be batch-invariant, since nothing that
verify must reproduce runs through it.

Three entry points, as in kernels.fused: `int8_linear_reference` (plain PyTorch, float32), `int8_linear_triton` (the
kernel; CPU tensors under TRITON_INTERPRET=1), `int8_linear` (the kernel for CUDA tensors in float16/bfloat16, else
the reference; ENGINE_DISABLE_TRITON=1 forces the reference).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import next_pow2, pdl_launch, pdl_options, pdl_wait, tl, triton, triton_disabled
from kernels.fused import _out_rows, _round, _rows, _soft_rne

__all__ = ["Int8Weight", "Int8Rows", "quantize_int8", "quantize_rows_int8", "int8_linear", "int8_linear_reference",
           "int8_linear_triton", "int8_config"]

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


class Int8Rows(NamedTuple):
    """Rows of activations quantized to int8, a float32 scale per row: x ~ q * scale[..., None]. `dtype` is the type
    the rows stood for (int8_linear's default output type)."""
    q: torch.Tensor      # [..., K] int8
    scale: torch.Tensor  # [...] float32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, index) -> "Int8Rows":
        """A slice of the rows (index over the leading dims, as on q without its last dim)."""
        index = index if isinstance(index, tuple) else (index,)
        return Int8Rows(self.q[index], self.scale[index], self.dtype)

    @staticmethod
    def empty(shape, dtype: torch.dtype, device) -> "Int8Rows":
        return Int8Rows(torch.empty(shape, dtype=torch.int8, device=device),
                        torch.empty(shape[:-1], dtype=torch.float32, device=device), dtype)


def quantize_rows_int8(x: torch.Tensor) -> Int8Rows:
    """Per-row symmetric int8 of activations x [..., K] (reference): scale = max |row| / 127 (1 for a row of zeros),
    q = floor(x / scale + 1/2) (the division correctly rounded), within [-127, 127]. Producing kernels (kernels.fused's
    rmsnorm with `quant=`) compute the same."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.floor(xf / s[..., None] + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Rows(q, s, x.dtype)


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


def int8_config(M: int, N: int, K: int, a8: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows of x against an [N, K] int8 weight. A draft
    block's few rows: 32 weight rows a program. Where that makes 192 programs or more (1.5 an SM), 2 warps with
    256-wide K steps and 3 in flight: with 4, Triton lays the warps 2 x 2 over the 32 x 16 output and every weight
    byte is converted twice. Fewer programs: 4 warps and 4 steps in flight, 512 wide from K 8192. Past 32 rows
    shorter steps, to stay within shared memory; a prompt's many rows: square tiles. Tuned on an H100 at a Qwen3-8B
    draft's shapes (docs/performance.md, "Int8 draft weights"). a8 (int8 rows of x, Int8Rows): nothing is converted,
    so 64 weight rows a program and 4 warps (wgmma) where that makes 384 programs or more (gate/up, an LM head), else
    16 rows with 2 warps (qkv, o, fc, down): the best of a sweep's tiles at each of an 8B draft's shapes on an H100."""
    if a8 and M <= 32:
        block_m = max(16, next_pow2(M))
        if -(-N // 64) >= 384:
            return block_m, 64, min(256, max(32, next_pow2(K))), 4, 3
        return block_m, 16, min(512, max(32, next_pow2(K))), 2, 4
    if M <= 32:
        block_m = max(16, next_pow2(M))
        if -(-N // 32) >= 192:
            return block_m, 32, min(256, max(32, next_pow2(K))), 2, 3
        return block_m, 32, min(512 if K >= 8192 else 256, max(32, next_pow2(K))), 4, 4
    if M <= 64:
        return 64, 32, min(256, max(32, next_pow2(K))), 4, 3
    return 64, 128, min(64, max(32, next_pow2(K))), 8, 3


# ------------------------------------------------------------------------------------------------ reference

def int8_linear_reference(x: torch.Tensor | Int8Rows, w: Int8Weight, bias: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain PyTorch: the integer products summed in float32 (int8 rows: summed exactly, then in float32), then the
    scales and the bias."""
    _check(x, w, bias)
    if isinstance(x, Int8Rows):
        z = (x.q.double() @ w.q.double().t()).float() * w.scale.float() * x.scale.float()[..., None]
    else:
        z = (x.float() @ w.q.float().t()) * w.scale.float()
    if bias is not None:
        z = z + bias.float()
    return z.to(out_dtype or x.dtype)


def _check(x: torch.Tensor | Int8Rows, w: Int8Weight, bias: torch.Tensor | None) -> None:
    if not isinstance(w, Int8Weight):
        raise TypeError(f"w must be an Int8Weight (quantize_int8), got {type(w).__name__}")
    if w.q.dim() != 2 or w.q.dtype != torch.int8:
        raise ValueError(f"w.q must be an int8 [N, K] tensor, got {tuple(w.q.shape)} {w.q.dtype}")
    N, K = w.q.shape
    if tuple(w.scale.shape) != (N,):
        raise ValueError(f"w.scale must be [{N}], got {tuple(w.scale.shape)}")
    if isinstance(x, Int8Rows):
        if x.q.dtype != torch.int8 or tuple(x.scale.shape) != tuple(x.q.shape[:-1]):
            raise ValueError(f"int8 rows must be an int8 [..., K] tensor and a scale per row, got "
                             f"{tuple(x.q.shape)} {x.q.dtype} and {tuple(x.scale.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"x's last dim must be {K} for a weight {tuple(w.q.shape)}, got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")


# --------------------------------------------------------------------------------------------------- kernel

if triton is not None:

    @triton.jit
    def _int8_linear_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_qn, s_ym,
                            A8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, F32_DOT: tl.constexpr,
                            ROUND: tl.constexpr, SOFT_RNE: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cmask, rmask = cols < N, rows < M
        dt: tl.constexpr = x_ptr.dtype.element_ty
        q_rows = q_ptr + cols.to(tl.int64)[:, None] * s_qn
        x_rows = x_ptr + rows.to(tl.int64)[None, :] * s_xm
        if A8:  # int8 rows of x (Int8Rows): integer products, summed exactly in int32
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
            ks = k * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = ks < K
            q = tl.load(q_rows + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0)     # [BN, BK] int8
            xt = tl.load(x_rows + ks[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)  # [BK, BM]
            if A8:
                acc = tl.dot(q, xt, acc, out_dtype=tl.int32)
            elif F32_DOT:  # the interpreter's 16-bit dot is wrong; float32 products of these values are exact
                acc += tl.dot(q.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(q.to(dt), xt)
        z = acc.to(tl.float32) * tl.load(s_ptr + cols, mask=cmask, other=0.0)[:, None]
        if A8:
            z = z * tl.load(xs_ptr + rows, mask=rmask, other=0.0)[None, :]
        acc = z
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[:, None]
        out_t: tl.constexpr = y_ptr.dtype.element_ty
        if ROUND:  # to a 16-bit output
            acc = _round(acc, out_t, SOFT_RNE)
        tl.store(y_ptr + rows.to(tl.int64)[None, :] * s_ym + cols[:, None], acc.to(out_t),
                 mask=cmask[:, None] & rmask[None, :])


# ------------------------------------------------------------------------------------------------ launchers

def int8_linear_triton(x: torch.Tensor | Int8Rows, w: Int8Weight, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                       config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton kernel. `out`, if given, is a [..., N] tensor of out_dtype viewable as [rows, N]; `config`
    overrides int8_config (kernel-time sweeps)."""
    if triton is None:
        raise RuntimeError("int8_linear_triton needs triton")
    _check(x, w, bias)
    a8 = isinstance(x, Int8Rows)
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    N, K = w.q.shape
    out_dtype = out_dtype or x.dtype
    shape = (*x.shape[:-1], N)
    device = x.q.device if a8 else x.device
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    y2 = _out_rows(out, shape, out_dtype, device, "out")
    x2 = _rows(x.q if a8 else x, K, "x")
    M = x2.shape[0]
    if M == 0 or N == 0:
        return out
    xs = x.scale.reshape(M) if a8 else x2  # x2: a dummy pointer
    q, scale = w.q if w.q.stride(1) == 1 else w.q.contiguous(), w.scale.float().contiguous()
    BM, BN, BK, warps, stages = config or int8_config(M, N, K, a8)
    pdl = pdl_launch(x2)
    _int8_linear_kernel[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
        x2, xs, q, scale, scale if bias is None else bias, y2, M, N, K, x2.stride(0), q.stride(0), y2.stride(0),
        A8=a8, HAS_BIAS=bias is not None, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, NUM_STAGES=stages,
        F32_DOT=device.type == "cpu", ROUND=out_dtype != torch.float32, SOFT_RNE=_soft_rne(out), PDL=pdl,
        num_warps=warps, **pdl_options(pdl))
    return out


# ---------------------------------------------------------------------------------------------------- dispatcher

def int8_linear(x: torch.Tensor | Int8Rows, w: Int8Weight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Triton kernel for CUDA tensors in float16/bfloat16 (or int8 rows standing for them), else the reference
    (module docstring)."""
    xt = x.q if isinstance(x, Int8Rows) else x
    if triton is not None and xt.is_cuda and x.dtype in _DTYPES and not triton_disabled():
        return int8_linear_triton(x, w, bias, out_dtype)
    return int8_linear_reference(x, w, bias, out_dtype)
