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

`skinny_qkv_rope` is the qkv projection with kernels.fused's qk_norm_rope_store (no per-head norms, RoPE on the whole
head) in its epilogue: a program's 16 columns are 8 rotary pairs of one head, so the grid is the plain kernel's; its
outputs (q, and k, v at the cache slots) equal those of the two kernels bit for bit. Both kernels compile without
FMA contraction, as the RoPE kernel does: with it, LLVM fuses a rounded RoPE product into the add after it
(fma.rn.bf16, one rounding fewer); the norm's sum of squares is fma.rn.f32 with contraction, so the plain kernel
compiles as the fused one does.

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
from kernels.fused import (_out_rows, _round, _soft_rne, qk_norm_rope_store_reference, rmsnorm_reference,
                           silu_mul_reference)

__all__ = ["skinny_linear", "skinny_linear_reference", "skinny_linear_triton", "skinny_config",
           "skinny_linear_applies", "skinny_qkv_rope", "skinny_qkv_rope_reference", "skinny_qkv_rope_triton",
           "rope_fusable"]

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
    def _project(x_ptr, res_ptr, norm_ptr, w_ptr, h_ptr, rows, cols, rmask, cmask, N, K, eps,
                 s_xm, s_rm, s_wn, s_hm, STORE_H: tl.constexpr,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, SOFT_RNE: tl.constexpr,
                 K_CHUNKS: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
        """(acc, acc_up): the float32 products of the program's rows (normed as the module docstring says) with its
        weight columns `cols` (and, with GLU, the up columns N below them), after the PDL wait. STORE_H: this
        program stores the new residual stream h."""
        dt: tl.constexpr = x_ptr.dtype.element_ty
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
                    if STORE_H:  # the new residual stream, stored by one column block
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
        return acc, acc_up

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
        acc, acc_up = _project(x_ptr, res_ptr, norm_ptr, w_ptr, h_ptr, rows, cols, rmask, cmask, N, K, eps,
                               s_xm, s_rm, s_wn, s_hm, pid_n == 0, NORM, HAS_RES, GLU, BLOCK_M, BLOCK_N, BLOCK_K,
                               NUM_STAGES, SOFT_RNE, K_CHUNKS, UNROLL, PDL, PREFETCH)
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


    @triton.jit
    def _skinny_rope_kernel(x_ptr, res_ptr, norm_ptr, w_ptr, b_ptr, h_ptr, cos_ptr, sin_ptr, slots_ptr,
                            q_ptr, kc_ptr, vc_ptr, M, N, K, eps, T, H, KVH,
                            s_xm, s_rm, s_wn, s_hm, s_cos_b, s_cos_t, s_sin_b, s_sin_t, s_slots_b,
                            s_q_b, s_q_h, s_q_t, s_kc_b, s_kc_h, s_kc_s, s_vc_b, s_vc_h, s_vc_s,
                            D: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                            SOFT_RNE: tl.constexpr, K_CHUNKS: tl.constexpr, UNROLL: tl.constexpr,
                            PDL: tl.constexpr, PREFETCH: tl.constexpr):
        """The qkv projection with kernels.fused's qk_norm_rope_store (no norms, RoPE on every dim) in its epilogue.
        A program's 16 columns are 8 rotary pairs of one head, dims c0..c0+7 and D/2 + the same, so RoPE needs no
        other program's columns: the grid and the weight bytes per program are those of the plain kernel."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        dt: tl.constexpr = x_ptr.dtype.element_ty
        head = pid_n // (D // 16)
        c0 = (pid_n % (D // 16)) * 8
        j = tl.arange(0, 16)
        cols = head * D + c0 + j % 8 + (j // 8) * (D // 2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        acc, _ = _project(x_ptr, res_ptr, norm_ptr, w_ptr, h_ptr, rows, cols, rmask, cols < N, N, K, eps,
                          s_xm, s_rm, s_wn, s_hm, pid_n == 0, NORM, HAS_RES, False, BLOCK_M, 16, BLOCK_K,
                          NUM_STAGES, SOFT_RNE, K_CHUNKS, UNROLL, PDL, PREFETCH)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        z = _round(acc, dt, SOFT_RNE)  # the projection's output, as the plain kernel stores it
        lo, hi = tl.split(tl.permute(tl.reshape(z, [BLOCK_M, 2, 8]), (0, 2, 1)))  # dims c0 + i and D/2 + c0 + i
        b = (rows // T).to(tl.int64)
        t = rows % T
        d = c0 + tl.arange(0, 8)
        m2 = rmask[:, None]
        if head < H + KVH:  # q or k: qk_norm_rope_store's arithmetic, every product rounded
            cos_row = cos_ptr + (b * s_cos_b + t * s_cos_t)[:, None]
            sin_row = sin_ptr + (b * s_sin_b + t * s_sin_t)[:, None]
            c_lo = tl.load(cos_row + d[None, :], mask=m2, other=0.0).to(tl.float32)
            s_lo = tl.load(sin_row + d[None, :], mask=m2, other=0.0).to(tl.float32)
            c_hi = tl.load(cos_row + (D // 2) + d[None, :], mask=m2, other=0.0).to(tl.float32)
            s_hi = tl.load(sin_row + (D // 2) + d[None, :], mask=m2, other=0.0).to(tl.float32)
            lo, hi = (_round(_round(lo * c_lo, dt, SOFT_RNE) + _round(-hi * s_lo, dt, SOFT_RNE), dt, SOFT_RNE),
                      _round(_round(hi * c_hi, dt, SOFT_RNE) + _round(lo * s_hi, dt, SOFT_RNE), dt, SOFT_RNE))
        if head < H:
            dst = q_ptr + b * s_q_b + head * s_q_h + t * s_q_t
        else:
            slot = tl.load(slots_ptr + b * s_slots_b + t, mask=rmask, other=0).to(tl.int64)
            if head < H + KVH:
                dst = kc_ptr + b * s_kc_b + (head - H) * s_kc_h + slot * s_kc_s
            else:
                dst = vc_ptr + b * s_vc_b + (head - H - KVH) * s_vc_h + slot * s_vc_s
        tl.store(dst[:, None] + d[None, :], lo.to(dt), mask=m2)
        tl.store(dst[:, None] + (D // 2) + d[None, :], hi.to(dt), mask=m2)


def _prefetch_rows(weight: torch.Tensor) -> bool:
    """Whether the kernel prefetches its weight rows into L2 before waiting on the kernel before it (PDL):
    rows that the bulk prefetch can take (16-byte aligned, a multiple of 16 bytes long). ENGINE_SKINNY_PREFETCH=0
    turns it off (A/B runs)."""
    return (bulk_prefetch_ok(weight, weight.stride(0), weight.shape[1])
            and env_switch("ENGINE_SKINNY_PREFETCH") is not False)


def _launch_args(x: torch.Tensor, weight: torch.Tensor, block_k: int, warps: int, stages: int) -> dict:
    """The launch arguments both kernels share: the main loop's shape (its steps unrolled by 2 past 4: down_proj's
    6), PDL with the weight prefetch, and no FMA contraction (the module docstring says why)."""
    k_chunks = triton.cdiv(weight.shape[1], block_k)
    pdl = pdl_launch(x)
    return dict(BLOCK_M=BLOCK_M, BLOCK_K=block_k, NUM_STAGES=stages, SOFT_RNE=_soft_rne(x), K_CHUNKS=k_chunks,
                UNROLL=2 if k_chunks > 4 else 1, PDL=pdl, PREFETCH=pdl and _prefetch_rows(weight), num_warps=warps,
                enable_fp_fusion=False, **pdl_options(pdl))


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
        _skinny_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, BLOCK_M))](
            x2, r2, x2 if norm is None else norm, weight, x2 if bias is None else bias, y, x2 if h is None else h,
            M, N, K, float(eps), x2.stride(0), r2.stride(0), weight.stride(0), y.stride(0),
            0 if h is None else h.stride(0),
            NORM=norm is not None, HAS_RES=residual is not None, GLU=glu, HAS_BIAS=bias is not None,
            BLOCK_N=block_n, SOFT_RNE_OUT=_soft_rne(y), **_launch_args(x, weight, block_k, warps, stages))
    return y_out, h_out


def rope_fusable(weight: torch.Tensor, head_dim: int, rotary_dims: int, qk_norm: bool) -> bool:
    """Whether skinny_qkv_rope can run a qkv weight [N, K]: RoPE on every dim of heads a multiple of 16 wide, no
    per-head norm, and 16-column programs (skinny_config), each taking 8 rotary pairs of one head."""
    N, K = weight.shape
    return (not qk_norm and rotary_dims == head_dim and head_dim % 16 == 0 and N % head_dim == 0
            and skinny_config(N, K)[0] == 16)


def skinny_qkv_rope_reference(x, weight, bias, norm, eps, residual, num_heads, num_kv_heads, head_dim, cos, sin,
                              k_cache, v_cache, slots) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch: skinny_linear_reference, then kernels.fused's qk_norm_rope_store_reference (no norms)."""
    qkv, h = skinny_linear_reference(x, weight, bias, norm, eps, residual)
    return qk_norm_rope_store_reference(qkv, num_heads, num_kv_heads, head_dim, None, None, eps, cos, sin,
                                        k_cache, v_cache, slots), h


def skinny_qkv_rope_triton(x, weight, bias, norm, eps, residual, num_heads, num_kv_heads, head_dim, cos, sin,
                           k_cache, v_cache, slots, out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel: (q [B, H, T, D], h) with k and v stored at the cache slots, as skinny_linear followed by
    qk_norm_rope_store (x [B, T, K], cos/sin [B, T, D], slots [T] or [B, T]; `out` receives q)."""
    if triton is None:
        raise RuntimeError("skinny_qkv_rope_triton needs triton")
    _check(x, weight, bias, norm, residual, False, None)
    B, T, K = x.shape
    H, KVH, D = num_heads, num_kv_heads, head_dim
    N = weight.shape[0]
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.stride(1) != 1:
        raise ValueError("x and weight must share a 16-bit float dtype, the weight's last dim contiguous")
    if N != (H + 2 * KVH) * D or not rope_fusable(weight, D, cos.shape[-1], False):
        raise ValueError(f"skinny_qkv_rope needs a [(H + 2 KVH) * D, K] weight, RoPE on all {D} dims and 16-column "
                         f"blocks, got {tuple(weight.shape)}, {cos.shape[-1]} rotary dims")
    for name, t in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1:
            raise ValueError(f"{name} must be {x.dtype} on {x.device} with a contiguous last dim")
    if tuple(cos.shape) != (B, T, D) or tuple(sin.shape) != (B, T, D):
        raise ValueError(f"cos and sin must be [{B}, {T}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if slots.dtype not in (torch.int64, torch.int32) or slots.shape[-1] != T:
        raise ValueError(f"slots must be int32/int64 [T] or [B, T], got {slots.dtype} {tuple(slots.shape)}")
    q = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device) if out is None else out
    h = None if residual is None else torch.empty(B, T, K, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = residual.reshape(-1, K).contiguous() if residual is not None else x2
    slots = slots.contiguous()
    M = B * T
    if M:
        _, block_k, warps, stages = skinny_config(N, K)
        _skinny_rope_kernel[(N // 16, triton.cdiv(M, BLOCK_M))](
            x2, r2, x2 if norm is None else norm, weight, x2 if bias is None else bias, x2 if h is None else h,
            cos, sin, slots, q, k_cache, v_cache, M, N, K, float(eps), T, H, KVH,
            x2.stride(0), r2.stride(0), weight.stride(0), 0 if h is None else h.stride(-2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), slots.stride(0) if slots.dim() == 2 else 0,
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            D=D, NORM=norm is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
            **_launch_args(x, weight, block_k, warps, stages))
    return q, h


def skinny_qkv_rope(x, weight, bias, norm, eps, residual, num_heads, num_kv_heads, head_dim, cos, sin, k_cache,
                    v_cache, slots) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q, h): the kernel for CUDA tensors in float16/bfloat16, else the reference."""
    if _kernel_runs(x) and weight.dtype == x.dtype:
        return skinny_qkv_rope_triton(x, weight, bias, norm, eps, residual, num_heads, num_kv_heads, head_dim, cos,
                                      sin, k_cache, v_cache, slots)
    return skinny_qkv_rope_reference(x, weight, bias, norm, eps, residual, num_heads, num_kv_heads, head_dim, cos,
                                     sin, k_cache, v_cache, slots)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  norm: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                  glu: bool = False, out_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, h): the kernel for CUDA tensors in float16/bfloat16, else the reference."""
    if _kernel_runs(x) and weight.dtype == x.dtype:
        return skinny_linear_triton(x, weight, bias, norm, eps, residual, glu, out_dtype)
    return skinny_linear_reference(x, weight, bias, norm, eps, residual, glu, out_dtype)
