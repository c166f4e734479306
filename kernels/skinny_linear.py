"""Skinny linear layers for launch-bound models: norm(x) @ W^T with SiLU(gate) * up on the way out, in one kernel,
a row's result independent of how many rows run beside it.

A decode step of a small model (SmolLM2-135M: 576 wide, 30 layers) streams its 0.27 GB of weights in 0.07 ms on an
H200 yet takes about 1 ms: each layer ran nine kernels, and cuBLAS's GEMV takes 3-5 us for a weight it reads in
0.3-0.8 us. Here the RMSNorm before a projection (with the residual add fused into it) runs in the GEMM's prologue
and SiLU(gate) * up in the gate/up GEMM's epilogue, so a layer of the Llama family runs six kernels (docs/design.md,
"Skinny linear layers"; the measurements are in docs/performance.md).

    skinny_linear(x [..., K], weight [N, K], bias [N] | None, norm=None, eps, residual=None, glu=False,
                  out_dtype=None) -> (y, h)

    prologue, row by row:
      norm given:  h = x + residual (rounded to x.dtype; h is x itself without a residual),
                   a = norm * (h * rsqrt(mean(h^2) + eps)) with both products rounded to x.dtype (kernels.fused's
                   rmsnorm; the mean of squares is summed in BLOCK_K chunks);
      otherwise    a = x.
    z = a @ weight^T in float32 (+ bias), rounded to out_dtype (default x.dtype): y = z [..., N].
    glu: weight = cat(W_gate, W_up) [2I, K], and y = silu(z_gate) (rounded) * z_up [..., I], rounded (kernels.fused's
    silu_mul on the rounded GEMM output).
    h is returned with a residual (else None): the residual stream after the add.

Batch invariance: a program owns 16 rows and BLOCK_N columns (and, with glu, the matching up columns) and walks K in
BLOCK_K steps, one tl.dot per step; BLOCK_N, BLOCK_K, the warps and the stages depend on the weight's shape only. A
row's operations are therefore the same whether it runs alone (decode) or among 16 or 128 rows (verify), padding
rows contributing nothing: verify reproduces decode bit for bit. cuBLAS is batch-invariant too (without a split-K
workspace, engine/__init__.py) but cannot take a prologue.

Three entry points, as in kernels.fused: `skinny_linear_reference` (plain PyTorch: kernels.fused's references and
F.linear), `skinny_linear_triton` (the kernel; CPU tensors under TRITON_INTERPRET=1), `skinny_linear` (the kernel for
CUDA tensors in float16/bfloat16, else the reference; ENGINE_DISABLE_TRITON=1 forces the reference).
`skinny_linear_applies` is the engine's rule for which models use it (engine.model.fuse_projections).

Kernel (`_skinny_kernel`): grid (cdiv(N, BLOCK_N), cdiv(M, 16)). With a norm, a first pass over the row tile's K
sums the squares of h (float32, chunk by chunk in a fixed order); the main loop recomputes h chunk by chunk (a 16 x
BLOCK_K tile of activations is cheap next to the BLOCK_N x BLOCK_K weight tile), and the programs of the first
column block store it. Every program stores only its own rows and columns: no atomics, no second launch.
In a launch-bound step each call's time is its programs' chain of dependent memory round trips after the PDL wait, so
the first pass is unrolled (its chunks' loads in flight at once, not one after another: 0.5-1.1 us a call at
SmolLM2's shapes on the H200), and a main loop of more than 4 steps is unrolled by 2 (down_proj, 0.4-0.5 us); the
arithmetic and its order are unchanged, so are the bits (docs/performance.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import (bulk_prefetch_ok, env_switch, next_pow2, pdl_launch, pdl_options, pdl_wait, prefetch_l2, tl,
                     triton, triton_disabled)
from kernels.fused import _out_rows, _round, _soft_rne, rmsnorm_reference, silu_mul_reference

__all__ = ["skinny_linear", "skinny_linear_reference", "skinny_linear_triton", "skinny_config",
           "skinny_linear_applies"]

BLOCK_M = 16  # rows per program: tl.dot's smallest tile
_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROWS = 128  # rows per sequence the engine runs through it (more: a prefill, where cuBLAS reads each weight once)
MAX_HIDDEN = 640  # models up to this width use the kernel (docs/performance.md: faster at 576, slower at 1024)


def skinny_linear_applies(weight: torch.Tensor, forced: bool | None = None) -> bool:
    """Whether a model whose MLP gate/up weight is `weight` [2 * intermediate, hidden] runs its layers with this
    kernel: a CUDA float16/bfloat16 model (ENGINE_DISABLE_TRITON=1 unset) at most MAX_HIDDEN wide; `forced`
    True or False overrides the width rule."""
    return _kernel_runs(weight) and (weight.shape[1] <= MAX_HIDDEN if forced is None else forced)


def _kernel_runs(t: torch.Tensor) -> bool:
    """The kernel takes CUDA tensors in 16-bit floats, unless ENGINE_DISABLE_TRITON=1."""
    return triton is not None and t.is_cuda and t.dtype in _DTYPES and not triton_disabled()


def skinny_config(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight of N output columns (per half, with glu) and K
    inputs: a function of the shape alone (batch invariance). Narrow column blocks keep every SM busy on small
    weights; long K steps keep the chain of dependent loads short. Tuned on the H200 at SmolLM2-135M's shapes."""
    return (16 if N <= 1024 else 32), min(256, max(16, next_pow2(K))), (2 if N <= 768 else 4), 3


# ------------------------------------------------------------------------------------------------ reference

def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            norm: torch.Tensor | None = None, eps: float = 1e-6,
                            residual: torch.Tensor | None = None, glu: bool = False,
                            out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch: kernels.fused's rmsnorm reference, F.linear accumulated in float32, its silu_mul reference."""
    _check(x, weight, bias, norm, residual, glu, out_dtype)
    h = None
    a = x
    if norm is not None:
        a, h = rmsnorm_reference(x, norm, eps, residual)
        if residual is None:
            h = None
    y = F.linear(a.float(), weight.float(), None if bias is None else bias.float()).to(out_dtype or x.dtype)
    return (silu_mul_reference(y) if glu else y), h


def _check(x, weight, bias, norm, residual, glu, out_dtype) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x's last dim must be {K} for a weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    if glu and (N % 2 or out_dtype not in (None, x.dtype)):
        raise ValueError(f"glu needs a weight of even rows (cat(gate, up)) and x's dtype out, got {N} rows")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    if norm is not None and tuple(norm.shape) != (K,):
        raise ValueError(f"norm must be [{K}], got {tuple(norm.shape)}")
    if residual is not None and (norm is None or residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("a residual needs a norm and must match x's shape and dtype")


# --------------------------------------------------------------------------------------------------- kernel

if triton is not None:

    @triton.jit
    def _dot_step(acc, a, w, dt: tl.constexpr, SOFT_RNE: tl.constexpr):
        """acc + a @ w^T: a [BLOCK_M, BLOCK_K] float32 holding dt values, w [BLOCK_N, BLOCK_K] in dt."""
        if SOFT_RNE:  # the interpreter's bfloat16 dot is wrong; float32 products of bf16 values are exact
            acc += tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a.to(dt), tl.trans(w))
        return acc

    @triton.jit
    def _residual_sum(x_rows, r_rows, ks, mask, HAS_RES: tl.constexpr, dt: tl.constexpr, SOFT_RNE: tl.constexpr):
        """h = x (+ residual, the sum rounded to dt) over the columns ks, in float32."""
        h = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            h = _round(h + tl.load(r_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32), dt, SOFT_RNE)
        return h

    @triton.jit
    def _skinny_kernel(x_ptr, res_ptr, norm_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, N, K, eps,
                       s_xm, s_rm, s_wn, s_ym, s_hm,
                       NORM: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr, SOFT_RNE: tl.constexpr, SOFT_RNE_OUT: tl.constexpr,
                       K_CHUNKS: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        dt: tl.constexpr = x_ptr.dtype.element_ty
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        cmask = cols < N
        if PREFETCH:  # the program's weight rows (read-only) into L2 while the kernel before it still runs
            w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64) * s_wn
            nbytes = tl.full([BLOCK_N], 0, tl.int32) + K * w_ptr.dtype.element_ty.primitive_bitwidth // 8
            prefetch_l2(w_rows, nbytes)
            if GLU:
                prefetch_l2(w_rows + N * s_wn, nbytes)
        pdl_wait(PDL)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * s_xm
        r_rows = res_ptr + rows.to(tl.int64)[:, None] * s_rm
        w_cols = w_ptr + cols.to(tl.int64)[:, None] * s_wn
        if NORM:  # mean of h^2 per row, chunk by chunk
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for i in tl.static_range(K_CHUNKS):  # unrolled: the chunks' loads are in flight together
                ks = i * BLOCK_K + tl.arange(0, BLOCK_K)
                h = _residual_sum(x_rows, r_rows, ks, rmask[:, None] & (ks < K)[None, :], HAS_RES, dt, SOFT_RNE)
                ss += tl.sum(h * h, axis=1)
            inv = tl.rsqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in tl.range(0, K_CHUNKS, num_stages=NUM_STAGES, loop_unroll_factor=UNROLL):
            ks = i * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = ks < K
            m2 = rmask[:, None] & kmask[None, :]
            if NORM:
                h = _residual_sum(x_rows, r_rows, ks, m2, HAS_RES, dt, SOFT_RNE)
                if HAS_RES:
                    if pid_n == 0:  # the new residual stream, stored by one column block
                        tl.store(h_ptr + rows.to(tl.int64)[:, None] * s_hm + ks[None, :], h.to(dt), mask=m2)
                nw = tl.load(norm_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
                a = _round(nw[None, :] * _round(h * inv[:, None], dt, SOFT_RNE), dt, SOFT_RNE)
            else:
                a = tl.load(x_rows + ks[None, :], mask=m2, other=0.0).to(tl.float32)
            wmask = cmask[:, None] & kmask[None, :]
            acc = _dot_step(acc, a, tl.load(w_cols + ks[None, :], mask=wmask, other=0.0), dt, SOFT_RNE)
            if GLU:  # the up rows, N rows below the gate rows
                acc_up = _dot_step(acc_up, a, tl.load(w_cols + N * s_wn + ks[None, :], mask=wmask, other=0.0), dt,
                                   SOFT_RNE)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if GLU:
                acc_up += tl.load(b_ptr + N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if GLU:  # gate and up rounded to dt as the GEMM's output would be, then silu_mul's arithmetic
            g = _round(acc, dt, SOFT_RNE)
            acc = _round(g / (1.0 + tl.exp(-g)), dt, SOFT_RNE) * _round(acc_up, dt, SOFT_RNE)
        if SOFT_RNE_OUT:  # bfloat16 output under the interpreter
            acc = _round(acc, dt, True)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def _prefetch_rows(weight: torch.Tensor) -> bool:
    """Whether the kernel prefetches its weight rows into L2 before waiting on the kernel before it (PDL):
    rows that the bulk prefetch can take (16-byte aligned, a multiple of 16 bytes long). ENGINE_SKINNY_PREFETCH=0
    turns it off (A/B runs)."""
    return (bulk_prefetch_ok(weight, weight.stride(0), weight.shape[1])
            and env_switch("ENGINE_SKINNY_PREFETCH") is not False)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         norm: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                         glu: bool = False, out_dtype: torch.dtype | None = None,
                         out: torch.Tensor | None = None, h_out: torch.Tensor | None = None,
                         config: tuple[int, int, int, int] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel (see the module docstring). `out` [..., N] and `h_out` (x's shape, with a residual only): buffers
    that receive y and h (viewable as rows with a contiguous last dim). `config` overrides skinny_config(N, K)
    (tuning probes only: another config is another rounding order)."""
    if triton is None:
        raise RuntimeError("skinny_linear_triton needs triton")
    _check(x, weight, bias, norm, residual, glu, out_dtype)
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a 16-bit float dtype, got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight needs a contiguous last dimension")
    K = weight.shape[1]
    N = weight.shape[0] // 2 if glu else weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if residual is None and h_out is not None:
        raise ValueError("h_out needs a residual")
    y_shape, y_dtype = (*x.shape[:-1], N), out_dtype or x.dtype
    y_out = torch.empty(y_shape, dtype=y_dtype, device=x.device) if out is None else out
    y, h = _out_rows(y_out, y_shape, y_dtype, x.device, "out"), None
    if residual is not None:
        h_out = torch.empty_like(x) if h_out is None else h_out
        h = _out_rows(h_out, x.shape, x.dtype, x.device, "h_out")
        if h.data_ptr() in (x2.data_ptr(), residual.data_ptr()):  # other programs still read them
            raise ValueError("h_out must not be x or the residual: the kernel cannot update them in place")
    r2 = residual.reshape(-1, K).contiguous() if residual is not None else x2
    if M and N:
        block_n, block_k, warps, stages = config or skinny_config(N, K)
        k_chunks = triton.cdiv(K, block_k)  # the main loop's steps, unrolled by 2 past 4 (down_proj: 6 steps)
        pdl = pdl_launch(x)
        prefetch = pdl and _prefetch_rows(weight)
        _skinny_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, BLOCK_M))](
            x2, r2, x2 if norm is None else norm, weight, x2 if bias is None else bias, y, x2 if h is None else h,
            M, N, K, float(eps), x2.stride(0), r2.stride(0), weight.stride(0), y.stride(0),
            0 if h is None else h.stride(0),
            NORM=norm is not None, HAS_RES=residual is not None, GLU=glu, HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, SOFT_RNE=_soft_rne(x),
            SOFT_RNE_OUT=_soft_rne(y), K_CHUNKS=k_chunks, UNROLL=2 if k_chunks > 4 else 1, PDL=pdl, PREFETCH=prefetch,
            num_warps=warps, **pdl_options(pdl))
    return y_out, h_out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  norm: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                  glu: bool = False, out_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, h): the kernel for CUDA tensors in float16/bfloat16, else the reference."""
    if _kernel_runs(x) and weight.dtype == x.dtype:
        return skinny_linear_triton(x, weight, bias, norm, eps, residual, glu, out_dtype)
    return skinny_linear_reference(x, weight, bias, norm, eps, residual, glu, out_dtype)
