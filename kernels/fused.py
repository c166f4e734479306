"""Fused elementwise kernels of a decoder layer: RMSNorm (+ residual add), q/k RMSNorm + RoPE + KV-cache store,
SiLU*mul, and the output gate of gated attention (x * sigmoid(gate)).

A decode step of an 8B model spends a large share of its time in tiny elementwise kernels (RMSNorm as 5-6 ops,
per-head q/k RMSNorm, RoPE as ~8 ops each for q and k, the cache index_copy_, silu, mul). Each function below is one
kernel launch. Four functions, each in three forms:

- `*_reference`: plain PyTorch, readable; the CPU path and the tests' oracle.
- `*_triton`: a Triton kernel. No host synchronisation, a grid that depends on shapes only: safe to capture in a
  CUDA graph and replay with new inputs copied in place. Optional `out=` tensors. Under TRITON_INTERPRET=1 they
  also run on CPU tensors (tests).
- the dispatcher (`rmsnorm`, `qk_norm_rope_store`, `silu_mul`, `sigmoid_mul`): the kernel for CUDA tensors, else
  the reference. `ENGINE_DISABLE_TRITON=1` in the environment (read at each call) forces the reference.

All math is done in float32 inside the kernels, and results are rounded to the input dtype at the same points as
the reference rounds them (torch computes a bfloat16 elementwise op in float32 and rounds once), so that bf16
results agree with the reference up to the rare one-ulp flip caused by a float32 reduction order or an exp/rsqrt
approximation that differs in the last float32 bit.

rmsnorm(x [..., N], weight [N], eps, residual=None) -> (y, h)
    h = x if residual is None else (x + residual) rounded to x.dtype;
    y = weight * (h.float() * rsqrt(mean(h.float()**2, -1) + eps)).to(x.dtype)   (the product rounded once).
    Without a residual, h is x itself (no copy). `h_out=residual` updates the residual stream in place.
    out=Int8Rows (kernels.int8_linear; a w8a8 draft's norms): y is quantized per row in the kernel, as
    quantize_rows_int8(y) computes it, and stored as int8 values and a float32 scale a row instead of y.

qk_norm_rope_store(qkv [B, T, (H + 2 KVH) D], H, KVH, D, q_norm [D] | None, k_norm [D] | None, eps,
                   cos [B, T, R], sin [B, T, R], k_cache, v_cache [B, KVH, CAP, D], slots [T] int64) -> q [B, H, T, D]
    (slots [B, T]: batch rows that are separate sequences write at their own slots)
    The fused q/k/v projection's output is split into heads (q heads, then k heads, then v heads); q and k heads get
    the per-head RMSNorm (as rmsnorm without residual) when q_norm / k_norm are given; then RoPE on the first R dims
    of each q and k head: x[:R] * cos + rotate_half(x[:R]) * sin in the input dtype (each product and the sum
    rounded), rotate_half(x) = cat(-x[R/2:], x[:R/2]); dims past R pass through. k (normed, rotated) and v (as is)
    are written to cache rows slots[t]; q is returned in [B, H, T, D].
    gated=True: qkv is [B, T, (2 H + 2 KVH) D], a gated attention's [q | gate | k | v] (engine.model's Attention.fuse
    layout); the gate's H D columns are skipped (sigmoid_mul applies them after attention), so no copy drops them.

silu_mul(gate_up [..., 2I]) -> act [..., I]
    act = silu(gate) (rounded) * up (rounded), gate = gate_up[..., :I], up = gate_up[..., I:]; as F.silu(g) * u.

norm_input=h [..., N] (qk_norm_rope_store and silu_mul; engine.model's folded norms): the GEMM before the kernel
    multiplied h itself, not RMSNorm(h), by a weight with the norm's gain folded into its input columns. So each row of
    qkv / gate_up is first scaled by rsqrt(mean(h.float()**2) + norm_eps) and rounded to the dtype (what the GEMM of
    the normed row would have stored), and the kernel goes on as above.

sigmoid_mul(x [..., N], gate [..., N]) -> x * sigmoid(gate)   (sigmoid rounded, then the product; as torch rounds)
    The output gate of Qwen3.5's attention: gate may be a strided column slice (the qkv GEMM's gate columns).

Kernel designs
--------------
_rmsnorm_kernel: one program per row; the whole row (N padded to a power of two, masked) is loaded once into
registers, the residual add, the float32 sum of squares (one tl.sum), the scaling and the weight product happen
in registers, and y (and h when a residual is given) are stored. 4 warps up to 2048 columns, then 8, then 16.

_qk_norm_rope_store_kernel: grid (B * T, H + 2 KVH): one program per (token, head) of the qkv row, one or two warps.
A q or k program loads its head (D padded to a power of two, masked) and, for the rotated dims, the rotate_half
partner elements with a second gathered load of the same row (cheaper than a register permutation and exactly
the same numbers): the RMSNorm scale is per head, so the partner's normed value is recomputed from the partner's
raw value, the shared 1/rms and the partner's weight. q programs store into q [B, H, T, D]; k programs load
slots[t] and store into k_cache; v programs copy their head into v_cache. The q and k bodies are one @triton.jit
helper called from two branches on the head index (q_norm and k_norm may be present independently). With norm_input,
each program first reads its token's row of h for the row's 1/rms (every head of a token reads the same row).

_silu_mul_kernel: grid (rows, cdiv(I, BLOCK)), BLOCK = min(1024, next_pow2(I)) columns per program, masked.
With norm_input, every program of a row also reads that row of h (8 KB at 4096 wide, from L2 after the first) and
computes its 1/rms: cheaper than a kernel of its own, which is what folding the norm saves.
_sigmoid_mul_kernel: the same grid over x's N columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import next_pow2, pdl_launch, pdl_options, pdl_wait, tl, triton, triton_disabled

__all__ = [
    "rmsnorm", "rmsnorm_reference", "rmsnorm_triton",
    "qk_norm_rope_store", "qk_norm_rope_store_reference", "qk_norm_rope_store_triton",
    "silu_mul", "silu_mul_reference", "silu_mul_triton", "scale_by_norm_input",
    "sigmoid_mul", "sigmoid_mul_reference", "sigmoid_mul_triton",
    "triton_disabled",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SILU_BLOCK = 1024  # columns per silu_mul program (at most)


def _use_triton(*tensors) -> bool:
    return (triton is not None and all(t.is_cuda for t in tensors) and tensors[0].dtype in _DTYPES
            and not triton_disabled())


# ------------------------------------------------------------------------------------------------ references

def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch RMSNorm (HF Llama/Qwen3 style) with an optional residual add first. Returns (y, h)."""
    h = x if residual is None else x + residual
    normed = (h.float() * _inv_rms_reference(h, eps)).to(x.dtype)
    return (weight * normed).to(x.dtype), h


def _inv_rms_reference(h: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(h^2) + eps) per row of h, in float32, keepdim."""
    return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)


def scale_by_norm_input(x: torch.Tensor, norm_input: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., M] with each row times rsqrt(mean(h^2) + eps) of the same row of h = norm_input [..., N], rounded to
    x's dtype: the output of a GEMM that read h with an RMSNorm's gain folded into its weight, made the output of
    the GEMM of RMSNorm(h). x itself when norm_input is None."""
    if norm_input is None:
        return x
    if norm_input.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"norm_input must have x's rows {tuple(x.shape[:-1])}, got {tuple(norm_input.shape)}")
    return (x.float() * _inv_rms_reference(norm_input, eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos, sin [B, T, R]: rotate the first R dims, pass the rest through."""
    R = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = x[..., :R] * cos + _rotate_half(x[..., :R]) * sin
    return rot if R == x.shape[-1] else torch.cat((rot, x[..., R:]), dim=-1)


def _check_qkv(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, cos, sin, k_cache, v_cache, slots,
               gated=False):
    heads = (2 if gated else 1) * num_heads + 2 * num_kv_heads
    if qkv.dim() != 3 or qkv.shape[2] != heads * head_dim:
        what = "(2 H + 2 KVH) * D, gated" if gated else "(H + 2 KVH) * D"
        raise ValueError(f"qkv must be [B, T, {what}] = [B, T, {heads * head_dim}], got {tuple(qkv.shape)}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    B, T, _ = qkv.shape
    R = cos.shape[-1]
    if tuple(cos.shape) != (B, T, R) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [B, T, R] = [{B}, {T}, R], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if R % 2 or R > head_dim or R <= 0:
        raise ValueError(f"rotary dims R = {R} must be even and in (0, head_dim = {head_dim}]")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and tuple(w.shape) != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}], got {tuple(w.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[0] != B \
            or k_cache.shape[1] != num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache and v_cache must be [B, KVH, CAP, D] = [{B}, {num_kv_heads}, CAP, {head_dim}], got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if tuple(slots.shape) not in ((T,), (B, T)):
        raise ValueError(f"slots must be [T] = [{T}] or per batch row [B, T] = [{B}, {T}], got {tuple(slots.shape)}")


def qk_norm_rope_store_reference(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, gated: bool = False, norm_input: torch.Tensor | None = None,
                                 norm_eps: float = 1e-6) -> torch.Tensor:
    """Plain PyTorch: split heads, optional per-head RMSNorm of q and k, RoPE, index_copy_ of k and v into the caches.

    Returns q [B, H, T, D] (contiguous)."""
    _check_qkv(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, gated)
    qkv = scale_by_norm_input(qkv, norm_input, norm_eps)
    B, T, _ = qkv.shape
    gates = num_heads if gated else 0
    q, _, k, v = qkv.reshape(B, T, num_heads + gates + 2 * num_kv_heads, head_dim).split(
        [num_heads, gates, num_kv_heads, num_kv_heads], dim=2)
    if q_norm is not None:
        q = rmsnorm_reference(q, q_norm, eps)[0]
    if k_norm is not None:
        k = rmsnorm_reference(k, k_norm, eps)[0]
    q = rope_reference(q.transpose(1, 2), cos, sin)
    k = rope_reference(k.transpose(1, 2), cos, sin)
    if slots.dim() == 2:  # batch rows that are separate sequences: each writes at its own slots
        for b in range(B):
            k_cache[b].index_copy_(1, slots[b], k[b])
            v_cache[b].index_copy_(1, slots[b], v[b].transpose(0, 1))
    else:
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v.transpose(1, 2))
    return q.contiguous()


def silu_mul_reference(gate_up: torch.Tensor, norm_input: torch.Tensor | None = None, norm_eps: float = 1e-6
                       ) -> torch.Tensor:
    """Plain PyTorch: F.silu(gate) * up with gate, up = gate_up.chunk(2, -1)."""
    gate, up = scale_by_norm_input(gate_up, norm_input, norm_eps).chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: x * torch.sigmoid(gate)."""
    return x * torch.sigmoid(gate)


# ---------------------------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _round(x, dt: tl.constexpr, SOFT_RNE: tl.constexpr):
        """float32 x rounded to dt (round to nearest even), returned as float32. SOFT_RNE: integer rounding of
        float32 to bfloat16 (finite values), for the interpreter, whose float32 -> bfloat16 cast truncates."""
        if SOFT_RNE:
            b = x.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            y = b.to(tl.float32, bitcast=True)
        else:
            y = x.to(dt).to(tl.float32)
        return y

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, ys_ptr, N, eps,
                        s_x, s_res, s_y, s_h,
                        HAS_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        dt: tl.constexpr = x_ptr.dtype.element_ty
        h = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * s_res + offs, mask=mask, other=0.0).to(tl.float32)
            h = _round(h + r, dt, SOFT_RNE)
            tl.store(h_ptr + row * s_h + offs, h.to(dt), mask=mask)
        if QUANT:  # y as int8 rows (kernels.int8_linear.quantize_rows_int8 of the rounded y), not y
            y = _normalized(h, w_ptr, offs, mask, N, eps, dt, SOFT_RNE)
            amax = tl.max(tl.abs(y), axis=0)
            scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
            q = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(y, scale) + 0.5), -127.0), 127.0)
            tl.store(y_ptr + row * s_y + offs, q.to(tl.int8), mask=mask)
            tl.store(ys_ptr + row, scale)
        else:
            _normalize_store(h, w_ptr, y_ptr + row * s_y, offs, mask, N, eps, SOFT_RNE)

    @triton.jit
    def _normalized(h, w_ptr, offs, mask, N, eps, dt: tl.constexpr, SOFT_RNE: tl.constexpr):
        """y = w * (h * rsqrt(mean(h^2) + eps)), both products rounded to dt, as float32 (h: a float32 row of dt
        values, zero past N)."""
        inv = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return _round(w * _round(h * inv, dt, SOFT_RNE), dt, SOFT_RNE)

    @triton.jit
    def _normalize_store(h, w_ptr, y_row, offs, mask, N, eps, SOFT_RNE: tl.constexpr):
        """_normalized, stored at y_row. Shared by the kernels that end in an RMSNorm (kernels.all_reduce too)."""
        dt: tl.constexpr = y_row.dtype.element_ty
        tl.store(y_row + offs, _normalized(h, w_ptr, offs, mask, N, eps, dt, SOFT_RNE).to(dt), mask=mask)

    @triton.jit
    def _inv_rms(h_row, N, eps, BLOCK_H: tl.constexpr):
        """rsqrt(mean(h^2) + eps) of the row at h_row (N values), in chunks of BLOCK_H."""
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in range(0, N, BLOCK_H):
            offs = k + tl.arange(0, BLOCK_H)
            h = tl.load(h_row + offs, mask=offs < N, other=0.0).to(tl.float32)
            acc += h * h
        return tl.rsqrt(tl.sum(acc, axis=0) / N + eps)

    @triton.jit
    def _norm_rope_head(src, w_ptr, cos_row, sin_row, dst, eps, scale, HAS_NORM: tl.constexpr,
                        HAS_SCALE: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, R: tl.constexpr,
                        SOFT_RNE: tl.constexpr):
        """One head: load (times the row's folded-norm scale, rounded), optional RMSNorm (weight at w_ptr), RoPE on
        the first R dims, store at dst."""
        dt: tl.constexpr = dst.dtype.element_ty
        offs = tl.arange(0, D_P2)
        dmask = offs < D
        rot = offs < R
        first = offs < R // 2
        poffs = tl.where(first, offs + R // 2, offs - R // 2)  # the rotate_half partner (used where rot)
        x = tl.load(src + offs, mask=dmask, other=0.0).to(tl.float32)
        xp = tl.load(src + poffs, mask=rot, other=0.0).to(tl.float32)
        if HAS_SCALE:
            x = _round(x * scale, dt, SOFT_RNE)
            xp = _round(xp * scale, dt, SOFT_RNE)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + poffs, mask=rot, other=0.0).to(tl.float32)
            x = _round(w * _round(x * inv, dt, SOFT_RNE), dt, SOFT_RNE)
            xp = _round(wp * _round(xp * inv, dt, SOFT_RNE), dt, SOFT_RNE)
        c = tl.load(cos_row + offs, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_row + offs, mask=rot, other=0.0).to(tl.float32)
        xp = tl.where(first, -xp, xp)
        roped = _round(_round(x * c, dt, SOFT_RNE) + _round(xp * s, dt, SOFT_RNE), dt, SOFT_RNE)
        out = tl.where(rot, roped, x)
        tl.store(dst + offs, out.to(dt), mask=dmask)

    @triton.jit
    def _qk_norm_rope_store_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, kc_ptr, vc_ptr,
                                   h_ptr, T, H, KVH, gap, eps, s_slots_b, N, norm_eps, s_h_b, s_h_t,
                                   s_qkv_b, s_qkv_t, s_cos_b, s_cos_t, s_sin_b, s_sin_t,
                                   s_q_b, s_q_h, s_q_t, s_kc_b, s_kc_h, s_kc_s, s_vc_b, s_vc_h, s_vc_s,
                                   HAS_QN: tl.constexpr, HAS_KN: tl.constexpr, HAS_SCALE: tl.constexpr,
                                   BLOCK_H: tl.constexpr,
                                   D: tl.constexpr, D_P2: tl.constexpr, R: tl.constexpr, SOFT_RNE: tl.constexpr,
                                   PDL: tl.constexpr):
        pdl_wait(PDL)
        pid = tl.program_id(0)
        hd = tl.program_id(1)
        b = (pid // T).to(tl.int64)
        t = pid % T
        src = qkv_ptr + b * s_qkv_b + t * s_qkv_t + hd * D + tl.where(hd < H, 0, gap)  # gap: a gated q's gates
        cos_row = cos_ptr + b * s_cos_b + t * s_cos_t
        sin_row = sin_ptr + b * s_sin_b + t * s_sin_t
        scale = 1.0
        if HAS_SCALE:
            scale = _inv_rms(h_ptr + b * s_h_b + t * s_h_t, N, norm_eps, BLOCK_H)
        if hd < H:
            dst = q_ptr + b * s_q_b + hd * s_q_h + t * s_q_t
            _norm_rope_head(src, qn_ptr, cos_row, sin_row, dst, eps, scale, HAS_QN, HAS_SCALE, D, D_P2, R, SOFT_RNE)
        elif hd < H + KVH:
            slot = tl.load(slots_ptr + b * s_slots_b + t).to(tl.int64)
            dst = kc_ptr + b * s_kc_b + (hd - H) * s_kc_h + slot * s_kc_s
            _norm_rope_head(src, kn_ptr, cos_row, sin_row, dst, eps, scale, HAS_KN, HAS_SCALE, D, D_P2, R, SOFT_RNE)
        else:
            slot = tl.load(slots_ptr + b * s_slots_b + t).to(tl.int64)
            offs = tl.arange(0, D_P2)
            dmask = offs < D
            v = tl.load(src + offs, mask=dmask, other=0.0)
            if HAS_SCALE:
                v = _round(v.to(tl.float32) * scale, vc_ptr.dtype.element_ty, SOFT_RNE).to(vc_ptr.dtype.element_ty)
            tl.store(vc_ptr + b * s_vc_b + (hd - H - KVH) * s_vc_h + slot * s_vc_s + offs, v, mask=dmask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, h_ptr, I, s_gu, s_out, N, norm_eps, s_h, BLOCK: tl.constexpr,
                         HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr, SOFT_RNE: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        dt: tl.constexpr = out_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * s_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            scale = _inv_rms(h_ptr + row * s_h, N, norm_eps, BLOCK_H)
            g = _round(g * scale, dt, SOFT_RNE)
            u = _round(u * scale, dt, SOFT_RNE)
        act = _round(g / (1.0 + tl.exp(-g)), dt, SOFT_RNE)
        tl.store(out_ptr + row * s_out + cols, _round(act * u, dt, SOFT_RNE).to(dt), mask=mask)

    @triton.jit
    def _sigmoid_mul_kernel(x_ptr, g_ptr, out_ptr, N, s_x, s_g, s_out, BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr,
                            PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        dt: tl.constexpr = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * s_g + cols, mask=mask, other=0.0).to(tl.float32)
        s = _round(1.0 / (1.0 + tl.exp(-g)), dt, SOFT_RNE)
        tl.store(out_ptr + row * s_out + cols, _round(x * s, dt, SOFT_RNE).to(dt), mask=mask)


NORM_INPUT_CHUNK = 4096  # values of a norm_input row a program loads at once (one load up to 4096 wide)


def _norm_input_rows(norm_input: torch.Tensor | None, rows_of: torch.Tensor, lead: tuple, name: str
                     ) -> tuple[torch.Tensor, int, int]:
    """(norm_input viewed [rows, N] (rows_of itself as a dummy pointer when None), N, BLOCK_H), checked against the
    leading dims `lead` of the tensor it scales."""
    if norm_input is None:
        return rows_of, 1, 1
    if tuple(norm_input.shape[:-1]) != tuple(lead) or norm_input.device != rows_of.device \
            or norm_input.dtype not in _DTYPES:
        raise ValueError(f"norm_input must be [{', '.join(map(str, lead))}, N] on {rows_of.device} (the rows of "
                         f"{name}), got {tuple(norm_input.shape)} {norm_input.dtype} on {norm_input.device}")
    N = norm_input.shape[-1]
    return _rows(norm_input, N, "norm_input"), N, min(NORM_INPUT_CHUNK, next_pow2(N))


def _soft_rne(t: torch.Tensor) -> bool:
    """Under TRITON_INTERPRET=1 (CPU tensors) float32 -> bfloat16 casts truncate: round with integer ops instead."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ launchers

def _rows(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """A [rows, n] view (or, if none exists, a contiguous copy) with a contiguous last dim."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(1) == 1 or t2.shape[1] == 1 else t2.contiguous()


def _out_rows(out: torch.Tensor, shape, dtype, device, name: str) -> torch.Tensor:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} on {device}, got {tuple(out.shape)} {out.dtype} "
                         f"{out.device}")
    try:
        o2 = out.view(-1, shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} must be viewable as [rows, {shape[-1]}]") from None
    if o2.stride(1) != 1 and o2.shape[1] != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")
    return o2


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   out=None, h_out: torch.Tensor | None = None) -> tuple:
    """The Triton kernel. Returns (y, h); `out` receives y, `h_out` receives h = x + residual (only with a residual;
    `h_out=residual` updates the residual in place). Without a residual h is x itself. `out` may be an Int8Rows
    (kernels.int8_linear) of x's shape: it then receives quantize_rows_int8(y), and y itself is not stored."""
    if triton is None:
        raise RuntimeError("rmsnorm_triton needs triton")
    N = x.shape[-1]
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    if tuple(weight.shape) != (N,):
        raise ValueError(f"weight must be [{N}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}: {tuple(residual.shape)} {residual.dtype}")
    quant = _int8_rows_out(out, x)
    if quant and not out.scale.is_contiguous():
        raise ValueError("out.scale (int8 rows) must be contiguous")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = _out_rows(out.q, x.shape, torch.int8, x.device, "out.q") if quant else \
        _out_rows(out, x.shape, x.dtype, x.device, "out")
    ys = out.scale if quant else y2  # y2: a dummy pointer
    if residual is None:
        if h_out is not None:
            raise ValueError("h_out needs a residual (without one, h is x itself)")
        h, h2 = x, y2
    else:
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if h_out is None else h_out
        h2 = _out_rows(h, x.shape, x.dtype, x.device, "h_out")
    x2 = _rows(x, N, "x")
    r2 = x2 if residual is None else _rows(residual, N, "residual")
    rows = x2.shape[0]
    if rows == 0 or N == 0:
        return out, h
    block = next_pow2(N)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    pdl = pdl_launch(x)
    _rmsnorm_kernel[(rows,)](x2, r2, weight, y2, h2, ys, N, float(eps),
                             x2.stride(0), r2.stride(0), y2.stride(0), h2.stride(0),
                             HAS_RES=residual is not None, QUANT=quant, BLOCK=block, SOFT_RNE=_soft_rne(x), PDL=pdl,
                             num_warps=num_warps, **pdl_options(pdl))
    return out, h


def _int8_rows_out(out, x: torch.Tensor) -> bool:
    """Whether `out` is an Int8Rows for x's rows (checked: int8 values of x's shape, a float32 scale a row)."""
    from kernels.int8_linear import Int8Rows  # that module imports this one

    if not isinstance(out, Int8Rows):
        return False
    if tuple(out.q.shape) != tuple(x.shape) or tuple(out.scale.shape) != tuple(x.shape[:-1]) \
            or out.q.dtype != torch.int8 or out.scale.dtype != torch.float32 or out.dtype != x.dtype:
        raise ValueError(f"out as int8 rows must be q {tuple(x.shape)} int8 and a float32 scale "
                         f"{tuple(x.shape[:-1])} for {x.dtype}, got {tuple(out.q.shape)} and "
                         f"{tuple(out.scale.shape)} {out.scale.dtype} for {out.dtype}")
    return True


def qk_norm_rope_store_triton(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                              q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor, out: torch.Tensor | None = None, gated: bool = False,
                              norm_input: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    """The Triton kernel. `slots`: [T] int32/int64 on qkv's device, or [B, T] (each batch row its own). `out`, if
    given, is a [B, H, T, D] tensor of qkv's dtype (any strides with a contiguous last dim) that receives q. The caches
    may be strided views (last dim contiguous). `gated`: qkv is [q | gate | k | v]. `norm_input` [B, T, N]: see the
    module docstring. One launch, grid (B * T, H + 2 KVH)."""
    if triton is None:
        raise RuntimeError("qk_norm_rope_store_triton needs triton")
    _check_qkv(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, gated)
    B, T, _ = qkv.shape
    H, KVH, D, R = num_heads, num_kv_heads, head_dim, cos.shape[-1]
    dt = qkv.dtype
    if dt not in _DTYPES:
        raise ValueError(f"unsupported dtype {dt}")
    for name, t in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache), ("q_norm", q_norm),
                    ("k_norm", k_norm)):
        if t is not None and t.dtype != dt:
            raise ValueError(f"{name} must have qkv's dtype {dt}, got {t.dtype}")
    if slots.dtype not in (torch.int64, torch.int32) or slots.device != qkv.device:
        raise ValueError(f"slots must be int32/int64 on {qkv.device}, got {slots.dtype} on {slots.device}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dimension")
    if out is None:
        out = torch.empty(B, H, T, D, dtype=dt, device=qkv.device)
    elif tuple(out.shape) != (B, H, T, D) or out.dtype != dt or out.device != qkv.device or out.stride(3) != 1:
        raise ValueError(f"out must be [{B}, {H}, {T}, {D}] {dt} on {qkv.device} with a contiguous last dim")
    if B * T == 0:
        return out
    if qkv.stride(2) != 1:
        qkv = qkv.contiguous()
    if cos.stride(2) != 1:
        cos = cos.contiguous()
    if sin.stride(2) != 1:
        sin = sin.contiguous()
    d_p2 = next_pow2(D)
    slots = slots.contiguous()
    h2, N, block_h = _norm_input_rows(norm_input, qkv, (B, T), "qkv")
    pdl = pdl_launch(qkv)
    _qk_norm_rope_store_kernel[(B * T, H + 2 * KVH)](
        qkv, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, cos, sin, slots, out,
        k_cache, v_cache, h2, T, H, KVH, H * D if gated else 0, float(eps), slots.stride(0) if slots.dim() == 2 else 0,
        N, float(norm_eps), T * h2.stride(0), h2.stride(0),
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HAS_QN=q_norm is not None, HAS_KN=k_norm is not None, HAS_SCALE=norm_input is not None, BLOCK_H=block_h,
        D=D, D_P2=d_p2, R=R, SOFT_RNE=_soft_rne(qkv),
        PDL=pdl, num_warps=1 if d_p2 <= 128 else 2,
        enable_fp_fusion=False,  # no FMA contraction: round each RoPE product like the reference does
        **pdl_options(pdl))
    return out


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor | None = None, norm_input: torch.Tensor | None = None,
                    norm_eps: float = 1e-6) -> torch.Tensor:
    """The Triton kernel. `out`, if given, is a [..., I] tensor of gate_up's dtype viewable as [rows, I].
    `norm_input` [..., N]: see the module docstring."""
    if triton is None:
        raise RuntimeError("silu_mul_triton needs triton")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"the last dim of gate_up must be even (cat(gate, up)), got {gate_up.shape[-1]}")
    if gate_up.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {gate_up.dtype}")
    I = gate_up.shape[-1] // 2
    shape = (*gate_up.shape[:-1], I)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    o2 = _out_rows(out, shape, gate_up.dtype, gate_up.device, "out")
    g2 = _rows(gate_up, 2 * I, "gate_up")
    if g2.shape[0] == 0 or I == 0:
        return out
    h2, N, block_h = _norm_input_rows(norm_input, g2, gate_up.shape[:-1], "gate_up")
    block = min(SILU_BLOCK, next_pow2(I))
    pdl = pdl_launch(gate_up)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(I, block))](g2, o2, h2, I, g2.stride(0), o2.stride(0), N,
                                                           float(norm_eps), h2.stride(0), BLOCK=block,
                                                           HAS_SCALE=norm_input is not None, BLOCK_H=block_h,
                                                           SOFT_RNE=_soft_rne(gate_up), PDL=pdl,
                                                           num_warps=4 if block >= 512 else 2, **pdl_options(pdl))
    return out


def sigmoid_mul_triton(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel. `gate` has x's shape and dtype (rows may be strided: a column slice of a wider tensor);
    `out`, if given, is a tensor of x's shape and dtype viewable as [rows, N] (it may be x itself)."""
    if triton is None:
        raise RuntimeError("sigmoid_mul_triton needs triton")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    if gate.shape != x.shape or gate.dtype != x.dtype or gate.device != x.device:
        raise ValueError(f"gate must match x {tuple(x.shape)} {x.dtype} on {x.device}: got {tuple(gate.shape)} "
                         f"{gate.dtype} on {gate.device}")
    N = x.shape[-1]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = _out_rows(out, x.shape, x.dtype, x.device, "out")
    x2, g2 = _rows(x, N, "x"), _rows(gate, N, "gate")
    if x2.shape[0] == 0 or N == 0:
        return out
    block = min(SILU_BLOCK, next_pow2(N))
    pdl = pdl_launch(x)
    _sigmoid_mul_kernel[(x2.shape[0], triton.cdiv(N, block))](x2, g2, o2, N, x2.stride(0), g2.stride(0), o2.stride(0),
                                                               BLOCK=block, SOFT_RNE=_soft_rne(x), PDL=pdl,
                                                               num_warps=4 if block >= 512 else 2, **pdl_options(pdl))
    return out


# ---------------------------------------------------------------------------------------------------- dispatchers

def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            out=None) -> tuple:
    """(y, h): the Triton kernel for CUDA tensors, else the reference (see the module docstring). `out`, if given,
    receives y (the kernel writes it there when it is contiguous, else y is copied into it); an Int8Rows `out`
    receives y quantized per row (rmsnorm_triton)."""
    quant = _int8_rows_out(out, x)
    if _use_triton(x, weight) and weight.dtype == x.dtype:
        if out is None or (out.q.is_contiguous() and out.scale.is_contiguous() if quant else out.is_contiguous()):
            return rmsnorm_triton(x, weight, eps, residual, out=out)
        y, h = rmsnorm_triton(x, weight, eps, residual, out=type(out).empty(x.shape, x.dtype, x.device)
                              if quant else None)
    else:
        y, h = rmsnorm_reference(x, weight, eps, residual)
        if quant:
            from kernels.int8_linear import quantize_rows_int8  # that module imports this one

            y = quantize_rows_int8(y)
    if quant:
        out.q.copy_(y.q)
        out.scale.copy_(y.scale)
        return out, h
    return (y, h) if out is None else (out.copy_(y), h)


def qk_norm_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, gated: bool = False, norm_input: torch.Tensor | None = None,
                       norm_eps: float = 1e-6) -> torch.Tensor:
    """q [B, H, T, D]; k and v written into the caches: the Triton kernel for CUDA tensors, else the reference."""
    same_dtype = all(t is None or t.dtype == qkv.dtype for t in (q_norm, k_norm, cos, sin, k_cache, v_cache))
    if _use_triton(qkv, k_cache, v_cache, cos, sin, slots) and same_dtype \
            and (norm_input is None or norm_input.is_cuda):
        return qk_norm_rope_store_triton(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, cos, sin,
                                         k_cache, v_cache, slots, gated=gated, norm_input=norm_input,
                                         norm_eps=norm_eps)
    return qk_norm_rope_store_reference(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, cos, sin,
                                        k_cache, v_cache, slots, gated, norm_input, norm_eps)


def silu_mul(gate_up: torch.Tensor, norm_input: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    """silu(gate) * up (of the folded norm's rows, with norm_input): the Triton kernel for CUDA tensors, else the
    reference."""
    if _use_triton(gate_up) and (norm_input is None or norm_input.is_cuda):
        return silu_mul_triton(gate_up, norm_input=norm_input, norm_eps=norm_eps)
    return silu_mul_reference(gate_up, norm_input, norm_eps)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate): the Triton kernel for CUDA tensors of one dtype and shape, else the reference."""
    if _use_triton(x, gate) and gate.dtype == x.dtype and gate.shape == x.shape:
        return sigmoid_mul_triton(x, gate)
    return sigmoid_mul_reference(x, gate)
