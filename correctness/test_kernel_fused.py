"""kernels.fused: the Triton rmsnorm / qk_norm_rope_store / silu_mul / sigmoid_mul against their references, the
references against transformers' modules, and the kernels captured together in a CUDA graph.

CPU: the references are checked directly; the Triton kernels run under the Triton interpreter in a subprocess
(TRITON_INTERPRET=1 must be set before triton is imported), one subprocess per kernel: `python -m
correctness.test_kernel_fused CHECK` runs one of CHECKS and prints what it compared. GPU: the kernels at real
shapes, a CUDA-graph replay with new inputs, timings (print with -s).

Every output is poisoned first: out= buffers are NaN-filled, and the cache rows the kernel must write are
NaN-filled while every other element of the tensor the caches are views of must stay bit-identical.

Tolerances. float32: atol = rtol = 1e-5 (the kernels do the reference's float32 operations; only the order of
the sum of squares and the exp / rsqrt / division approximations differ, ~1e-7 relative). bfloat16: every rounding
to bfloat16 happens at the same point as in the reference, so most elements match exactly; a float32 difference
in the last bit can flip one rounding to the neighbouring bf16 value (one ulp = 2^-8..2^-7 relative), which RoPE's
sum can turn into an absolute error of one ulp of the operands (|operands| < 8 with randn inputs: 2^-5). So:
|got - want| <= 2^-5 + 2^-6 |want| (two ulps relative) elementwise, and at most 1% of the elements may differ at
all (a rounding placed at the wrong point makes a large fraction differ). v is copied: compared exactly.
"""
from __future__ import annotations


import pytest
import torch

from kernels import fused

from correctness.kernel_harness import assert_close_ulps, assert_interpreted_ok, run_checks_main
from kernels.fused import (qk_norm_rope_store, qk_norm_rope_store_reference, qk_norm_rope_store_triton, rmsnorm,
                           rmsnorm_reference, rmsnorm_triton, sigmoid_mul, sigmoid_mul_reference, sigmoid_mul_triton,
                           silu_mul, silu_mul_reference, silu_mul_triton)
from kernels.int8_linear import Int8Rows, quantize_rows_int8

EPS = 1e-6
FOLD_EPS = 1e-5  # the folded norm's epsilon: not the q/k norms' (a kernel that mixed them up would show)


# ---------------------------------------------------------------------------------------------------- helpers

def assert_close(got: torch.Tensor, want: torch.Tensor, context: str) -> None:
    assert_close_ulps(got, want, context, fp32_tol=1e-5, atol=2 ** -5, rtol=2 ** -6, max_differing=0.01)


def rand(gen, *shape, dtype, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def small_first_row(h: torch.Tensor) -> torch.Tensor:
    """h with its first row scaled down to where the norm's epsilon matters (mean square ~1e-5)."""
    h.view(-1, h.shape[-1])[0] *= 1e-3
    return h


def rope_cos_sin(gen, B, T, R, dtype, device="cpu", start=0):
    """HF-style cos/sin [B, T, R] (the two halves repeat) at positions start + t (random per batch row)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    pos = start + torch.arange(T, dtype=torch.float32)[None, :] + torch.randint(0, 50, (B, 1), generator=gen)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def check_rmsnorm(fn, gen, shape, dtype, device, residual: bool, context: str, inplace=False) -> None:
    N = shape[-1]
    x = rand(gen, *shape, dtype=dtype, device=device, scale=2.0)
    w = rand(gen, N, dtype=dtype, device=device)
    res = rand(gen, *shape, dtype=dtype, device=device) if residual else None
    want_y, want_h = rmsnorm_reference(x, w, EPS, res)
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)
    h_out = None
    if residual:
        h_out = res.clone() if inplace else torch.full(shape, float("nan"), dtype=dtype, device=device)
    y, h = fn(x, w, EPS, res if not inplace else h_out, out=out, h_out=h_out)
    assert y is out, f"{context}: y not written into out="
    assert_close(y, want_y, f"{context} y")
    if residual:
        assert h is h_out, f"{context}: h not written into h_out="
        assert_close(h, want_h, f"{context} h")
    else:
        assert h is x, f"{context}: without a residual h must be x itself"
    y2, _ = fn(x, w, EPS, res)  # fresh outputs, no out=
    assert_close(y2, want_y, f"{context} fresh y")


def check_rmsnorm_rows(fn, gen, shape, dtype, device, residual: bool, context: str) -> None:
    """out= as int8 rows (a w8a8 draft's norms): the kernel's own 16-bit y, quantized per row by the reference
    quantization, bit for bit; h as without it. Row 0 is zero (scale 1, all-zero integers)."""
    N = shape[-1]
    x = rand(gen, *shape, dtype=dtype, device=device, scale=2.0)
    w = rand(gen, N, dtype=dtype, device=device)
    res = rand(gen, *shape, dtype=dtype, device=device) if residual else None
    x.view(-1, N)[0] = 0
    if residual:
        res.view(-1, N)[0] = 0
    y, h = fn(x, w, EPS, res)
    out = Int8Rows(torch.full(shape, 99, dtype=torch.int8, device=device),
                   torch.full(shape[:-1], float("nan"), device=device), dtype)
    got, h2 = fn(x, w, EPS, res, out=out)
    assert got is out, f"{context}: int8 rows not written into out="
    want = quantize_rows_int8(y)
    if device == "cpu":  # the interpreter runs both variants' arithmetic alike: bit for bit
        assert torch.equal(out.q, want.q), f"{context}: {(out.q != want.q).sum().item()} integers differ"
        assert torch.equal(out.scale, want.scale), f"{context}: row scales differ"
    else:  # compiled apart, the two variants' y may differ by an ulp (contraction, rsqrt): a step at most, rarely
        off = (out.q.int() - want.q.int()).abs()
        assert off.max() <= 1 and off.float().mean() < 0.01, f"{context}: {int((off > 0).sum())} integers differ"
        torch.testing.assert_close(out.scale, want.scale, rtol=2 ** -7, atol=0, msg=f"{context}: row scales")
    assert bool((out.scale.view(-1)[0] == 1) & (out.q.view(-1, N)[0] == 0).all()), f"{context}: the zero row"
    assert torch.equal(h2, h), f"{context}: h"


def qk_case(gen, B, T, H, KVH, D, R, norms, dtype, device="cpu", cap=64, start=None, layers=2, pad=8,
            per_row=False, gated=False, folded=0):
    """Inputs of one qk_norm_rope_store case; caches are layer 1 of [layers, B, KVH, cap, D + pad] bases, [..., :D].
    per_row: slots [B, T], each batch row its own (separate sequences). gated: qkv is [q | gate | k | v], the gate
    columns NaN (a kernel that read them would write NaN). folded=N: a norm_input of N columns (a folded norm's
    rows, one scale per row: engine.model's folded norms)."""
    qkv = rand(gen, B, T, ((2 if gated else 1) * H + 2 * KVH) * D, dtype=dtype, device=device, scale=2.0)
    if gated:
        qkv[..., H * D:2 * H * D] = float("nan")
    q_norm = rand(gen, D, dtype=dtype, device=device) if norms in ("both", "q") else None
    k_norm = rand(gen, D, dtype=dtype, device=device) if norms in ("both", "k") else None
    cos, sin = rope_cos_sin(gen, B, T, R, dtype, device, start=start or 0)
    if per_row:
        slots = torch.stack([torch.randperm(cap, generator=gen)[:T] for _ in range(B)])
    elif start is None:  # scattered slots, not in order
        slots = torch.randperm(cap, generator=gen)[:T]
    else:
        slots = start + torch.arange(T)
    slots = slots.to(device)
    k_base = rand(gen, layers, B, KVH, cap, D + pad, dtype=dtype, device=device)
    v_base = rand(gen, layers, B, KVH, cap, D + pad, dtype=dtype, device=device)
    written = torch.zeros(k_base.shape, dtype=torch.bool, device=device)
    for b, row_slots in enumerate(slots if per_row else [slots] * B):
        written[1, b, :, row_slots, :D] = True
    k_base[written] = float("nan")
    v_base[written] = float("nan")
    norm_input = small_first_row(rand(gen, B, T, folded, dtype=dtype, device=device, scale=3.0)) if folded else None
    return dict(qkv=qkv, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin, slots=slots, norm_input=norm_input,
                k_base=k_base, v_base=v_base, written=written, dims=(H, KVH, D), gated=gated)


def check_qk(fn, case, context: str, use_out=True) -> None:
    H, KVH, D = case["dims"]
    B, T, _ = case["qkv"].shape
    kb_ref, vb_ref = case["k_base"].clone(), case["v_base"].clone()
    kb, vb = case["k_base"].clone(), case["v_base"].clone()
    args = (case["qkv"], H, KVH, D, case["q_norm"], case["k_norm"], EPS, case["cos"], case["sin"])
    gated, norm_input = case["gated"], case["norm_input"]
    want = qk_norm_rope_store_reference(*args, kb_ref[1, ..., :D], vb_ref[1, ..., :D], case["slots"], gated,
                                        norm_input, FOLD_EPS)
    kw = {"gated": True} if gated else {}
    if norm_input is not None:
        kw.update(norm_input=norm_input, norm_eps=FOLD_EPS)
    if use_out:  # a strided out=: [B, H, T, D] inside a [B, T, H, D + 4] buffer
        buf = torch.full((B, T, H, D + 4), float("nan"), dtype=want.dtype, device=want.device)
        kw["out"] = buf[..., :D].transpose(1, 2)
    q = fn(*args, kb[1, ..., :D], vb[1, ..., :D], case["slots"], **kw)
    if use_out:
        assert q is kw["out"], f"{context}: q not written into out="
    assert_close(q, want, f"{context} q")
    written = case["written"]
    assert torch.equal(kb[~written], kb_ref[~written]), f"{context}: k cache changed outside the written rows"
    assert torch.equal(vb[~written], vb_ref[~written]), f"{context}: v cache changed outside the written rows"
    if norm_input is None:  # copied as it comes; scaled by the folded norm, it is rounded like q and k
        assert torch.equal(vb[written], vb_ref[written]), f"{context}: v rows differ"
    else:
        assert_close(vb[written], vb_ref[written], f"{context} v rows")
    assert_close(kb[written], kb_ref[written], f"{context} k rows")


def check_silu(fn, gen, shape, dtype, device, context: str, folded: int = 0) -> None:
    """folded=N: with a norm_input of N columns."""
    gu = rand(gen, *shape, dtype=dtype, device=device, scale=3.0)
    kw = {}
    if folded:
        h = small_first_row(rand(gen, *shape[:-1], folded, dtype=dtype, device=device, scale=3.0))
        kw = dict(norm_input=h, norm_eps=FOLD_EPS)
    want = silu_mul_reference(gu, **kw)
    out = torch.full(want.shape, float("nan"), dtype=dtype, device=device)
    got = fn(gu, out=out, **kw)
    assert got is out, f"{context}: not written into out="
    assert_close(got, want, context)
    assert_close(fn(gu, **kw), want, f"{context} fresh")


def check_sigmoid(fn, gen, shape, dtype, device, context: str) -> None:
    """x * sigmoid(gate) with the gate a column slice of a wider tensor (as the qkv GEMM's gate columns are)."""
    N = shape[-1]
    x = rand(gen, *shape, dtype=dtype, device=device, scale=2.0)
    wide = rand(gen, *shape[:-1], 3 * N, dtype=dtype, device=device, scale=3.0)
    gate = wide[..., N:2 * N]
    want = sigmoid_mul_reference(x, gate)
    out = torch.full(want.shape, float("nan"), dtype=dtype, device=device)
    got = fn(x, gate, out=out)
    assert got is out, f"{context}: not written into out="
    assert_close(got, want, context)
    assert_close(fn(x, gate), want, f"{context} fresh")
    assert_close(fn(x.clone(), gate, out=x), want, f"{context} in place")


DTYPES = (torch.float32, torch.bfloat16)


# ------------------------------------------------------------------------------ interpreter checks (subprocess)

def _interp_rmsnorm() -> str:
    gen = torch.Generator().manual_seed(1)
    cases = 0
    for dtype in DTYPES:
        for shape in ((1, 72), (3, 100), (2, 3, 576), (1, 1024)):
            for residual in (False, True):
                check_rmsnorm(rmsnorm_triton, gen, shape, dtype, "cpu", residual, f"rmsnorm {dtype} {shape} {residual}")
                cases += 1
        check_rmsnorm(rmsnorm_triton, gen, (3, 100), dtype, "cpu", True, f"rmsnorm {dtype} in place", inplace=True)
        x = rand(gen, 4, 130, dtype=dtype)[:, :100]  # rows with a stride
        w = rand(gen, 100, dtype=dtype)
        assert_close(rmsnorm_triton(x, w, EPS)[0], rmsnorm_reference(x, w, EPS)[0], f"rmsnorm {dtype} strided rows")
        cases += 2
        for shape in ((3, 100), (2, 5, 576)):
            for residual in (False, True):
                check_rmsnorm_rows(rmsnorm_triton, gen, shape, dtype, "cpu", residual, f"int8 rows {dtype} {shape}")
                cases += 1
    return f"{cases} rmsnorm cases"


QK_CPU = [  # (B, T, H, KVH, D, R, norms)
    (1, 1, 4, 2, 32, 32, "both"),
    (2, 3, 3, 1, 24, 24, "both"),
    (1, 5, 2, 2, 80, 80, None),
    (2, 2, 4, 2, 32, 16, "q"),
    (1, 3, 2, 1, 64, 32, "k"),
    (1, 2, 6, 2, 16, 8, None),
]


def _interp_qk() -> str:
    gen = torch.Generator().manual_seed(2)
    cases = 0
    for dtype in DTYPES:
        for i, (B, T, H, KVH, D, R, norms) in enumerate(QK_CPU):
            case = qk_case(gen, B, T, H, KVH, D, R, norms, dtype, start=None if i % 2 else 7)
            check_qk(qk_norm_rope_store_triton, case, f"qk {dtype} B{B} T{T} H{H} KVH{KVH} D{D} R{R} {norms}",
                     use_out=i % 3 != 2)
            cases += 1
        case = qk_case(gen, 3, 5, 4, 2, 16, 16, "both", dtype, per_row=True)
        check_qk(qk_norm_rope_store_triton, case, f"qk {dtype} per-row slots")
        for B, T, H, KVH, D, R, norms in ((2, 3, 4, 2, 32, 8, "both"), (1, 4, 3, 1, 16, 16, None)):  # gated q
            case = qk_case(gen, B, T, H, KVH, D, R, norms, dtype, start=3, gated=True)
            check_qk(qk_norm_rope_store_triton, case, f"qk {dtype} gated B{B} T{T} H{H} KVH{KVH} D{D} R{R}")
        # after a folded norm: widths below, at and past one chunk of the row's load (two chunks, the last masked)
        for B, T, H, KVH, D, R, norms, N in ((1, 3, 4, 2, 32, 32, "both", 100), (2, 2, 2, 1, 16, 8, None, 64),
                                             (1, 2, 2, 2, 16, 16, "k", fused.NORM_INPUT_CHUNK + 100)):
            case = qk_case(gen, B, T, H, KVH, D, R, norms, dtype, start=5, folded=N)
            check_qk(qk_norm_rope_store_triton, case, f"qk {dtype} folded N{N} B{B} T{T} H{H} KVH{KVH} {norms}")
        case = qk_case(gen, 2, 3, 4, 2, 16, 16, "q", dtype, per_row=True, folded=72)
        check_qk(qk_norm_rope_store_triton, case, f"qk {dtype} folded, per-row slots")
        cases += 7
    return f"{cases} qk_norm_rope_store cases"


def _interp_silu() -> str:
    gen = torch.Generator().manual_seed(3)
    cases = 0
    for dtype in DTYPES:
        for shape in ((1, 2 * 48), (3, 2 * 1500), (2, 2, 2 * 100)):  # 1500: two column blocks, the second masked
            check_silu(silu_mul_triton, gen, shape, dtype, "cpu", f"silu {dtype} {shape}")
            cases += 1
        for shape, N in (((3, 2 * 1500), 100), ((2, 2, 2 * 48), 64), ((2, 2 * 40), fused.NORM_INPUT_CHUNK + 100)):
            check_silu(silu_mul_triton, gen, shape, dtype, "cpu", f"silu {dtype} {shape} folded N{N}", folded=N)
            cases += 1
    return f"{cases} silu_mul cases"


def _interp_sigmoid() -> str:
    gen = torch.Generator().manual_seed(9)
    cases = 0
    for dtype in DTYPES:
        for shape in ((1, 48), (3, 1500), (2, 2, 100)):  # 1500: two column blocks, the second masked
            check_sigmoid(sigmoid_mul_triton, gen, shape, dtype, "cpu", f"sigmoid {dtype} {shape}")
            cases += 1
    return f"{cases} sigmoid_mul cases"


CHECKS = {"rmsnorm": _interp_rmsnorm, "qk": _interp_qk, "silu": _interp_silu, "sigmoid": _interp_sigmoid}


# ---------------------------------------------------------------------------------------------------- CPU tests

@pytest.mark.cpu
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_triton_kernels_under_interpreter(name):
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_fused", name)


@pytest.mark.cpu
def test_references_match_transformers():
    """rmsnorm_reference is LlamaRMSNorm (residual added first); the q/k path is Qwen3's q_norm/k_norm +
    apply_rotary_pos_emb, bit for bit in bfloat16; silu_mul_reference is ACT2FN['silu'](gate) * up."""
    pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(4)
    dt = torch.bfloat16
    norm = LlamaRMSNorm(96, eps=EPS).to(dt)
    with torch.no_grad():
        norm.weight.copy_(rand(gen, 96, dtype=dt))
    x, res = rand(gen, 5, 96, dtype=dt), rand(gen, 5, 96, dtype=dt)
    y, h = rmsnorm_reference(x, norm.weight.detach(), EPS, res)
    assert torch.equal(h, x + res) and torch.equal(y, norm(x + res))

    B, T, H, KVH, D = 2, 3, 4, 2, 32
    case = qk_case(gen, B, T, H, KVH, D, D, "both", dt, start=5)
    kc, vc = case["k_base"][1, ..., :D], case["v_base"][1, ..., :D]
    q = qk_norm_rope_store_reference(case["qkv"], H, KVH, D, case["q_norm"], case["k_norm"], EPS, case["cos"],
                                     case["sin"], kc, vc, case["slots"])
    qn, kn = LlamaRMSNorm(D, eps=EPS).to(dt), LlamaRMSNorm(D, eps=EPS).to(dt)
    with torch.no_grad():
        qn.weight.copy_(case["q_norm"])
        kn.weight.copy_(case["k_norm"])
    hq, hk, hv = case["qkv"].view(B, T, H + 2 * KVH, D).split([H, KVH, KVH], dim=2)
    want_q, want_k = apply_rotary_pos_emb(qn(hq).transpose(1, 2), kn(hk).transpose(1, 2), case["cos"], case["sin"])
    assert torch.equal(q, want_q)
    assert torch.equal(kc[:, :, case["slots"]], want_k)
    assert torch.equal(vc[:, :, case["slots"]], hv.transpose(1, 2))

    gu = rand(gen, 4, 2 * 50, dtype=dt, scale=3.0)
    assert torch.equal(silu_mul_reference(gu), ACT2FN["silu"](gu[:, :50]) * gu[:, 50:])


@pytest.mark.cpu
def test_gated_reference_skips_the_gate_columns():
    """gated=True: [q | gate | k | v] gives what the ungated call gives on [q | k | v], the gate never read."""
    gen = torch.Generator().manual_seed(22)
    for dtype in DTYPES:
        case = qk_case(gen, 2, 3, 4, 2, 16, 8, "both", dtype, start=4, gated=True)
        H, KVH, D = case["dims"]
        qkv = case["qkv"]
        plain = torch.cat((qkv[..., :H * D], qkv[..., 2 * H * D:]), dim=-1)
        rest = (case["q_norm"], case["k_norm"], EPS, case["cos"], case["sin"])
        kb, vb, kb2, vb2 = (case[n].clone() for n in ("k_base", "v_base", "k_base", "v_base"))
        q = qk_norm_rope_store_reference(qkv, H, KVH, D, *rest, kb[1, ..., :D], vb[1, ..., :D], case["slots"], True)
        want = qk_norm_rope_store_reference(plain, H, KVH, D, *rest, kb2[1, ..., :D], vb2[1, ..., :D], case["slots"])
        assert not q.isnan().any() and torch.equal(q, want)
        assert torch.equal(kb.nan_to_num(), kb2.nan_to_num()) and torch.equal(vb.nan_to_num(), vb2.nan_to_num())
    with pytest.raises(ValueError, match="gated"):  # an ungated width declared gated
        qk_norm_rope_store_reference(plain, H, KVH, D, *rest, kb[1, ..., :D], vb[1, ..., :D], case["slots"], True)


@pytest.mark.cpu
def test_reference_per_row_slots_write_each_rows_own():
    """Batch rows that are separate sequences: the reference with slots [B, T] equals each row written alone."""
    gen = torch.Generator().manual_seed(21)
    case = qk_case(gen, 3, 4, 4, 2, 8, 8, "both", torch.float32, per_row=True)
    H, KVH, D = case["dims"]
    args = (case["qkv"], H, KVH, D, case["q_norm"], case["k_norm"], EPS, case["cos"], case["sin"])
    kb, vb = case["k_base"].clone(), case["v_base"].clone()
    q = qk_norm_rope_store_reference(*args, kb[1, ..., :D], vb[1, ..., :D], case["slots"])
    for b in range(3):
        kr, vr = case["k_base"][1, b:b + 1, ..., :D].clone(), case["v_base"][1, b:b + 1, ..., :D].clone()
        row = (case["qkv"][b:b + 1], H, KVH, D, case["q_norm"], case["k_norm"], EPS, case["cos"][b:b + 1],
               case["sin"][b:b + 1])
        assert torch.equal(q[b:b + 1], qk_norm_rope_store_reference(*row, kr, vr, case["slots"][b]))
        assert torch.equal(kb[1, b:b + 1, ..., :D], kr) and torch.equal(vb[1, b:b + 1, ..., :D], vr)


@pytest.mark.cpu
def test_partial_rotary_reference():
    """Dims past R pass through; the first R follow the full-rotary formula on the R-dim slice."""
    gen = torch.Generator().manual_seed(5)
    D, R = 32, 8
    case = qk_case(gen, 1, 2, 2, 1, D, R, None, torch.float32, start=3)
    kc, vc = case["k_base"][1, ..., :D], case["v_base"][1, ..., :D]
    q = qk_norm_rope_store_reference(case["qkv"], 2, 1, D, None, None, EPS, case["cos"], case["sin"], kc, vc,
                                     case["slots"])
    raw = case["qkv"].view(1, 2, 4, D)[:, :, :2].transpose(1, 2)
    assert torch.equal(q[..., R:], raw[..., R:])
    c, s = case["cos"][:, None], case["sin"][:, None]
    x = raw[..., :R]
    rot = x * c + torch.cat((-x[..., R // 2:], x[..., :R // 2]), -1) * s
    assert torch.equal(q[..., :R], rot)


@pytest.mark.cpu
def test_dispatchers_use_the_references_on_cpu(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    called = []
    for name in ("rmsnorm_triton", "qk_norm_rope_store_triton", "silu_mul_triton", "sigmoid_mul_triton"):
        monkeypatch.setattr(fused, name, lambda *a, _n=name, **k: called.append(_n))
    x, w = rand(gen, 3, 40, dtype=torch.float32), rand(gen, 40, dtype=torch.float32)
    y, h = rmsnorm(x, w, EPS)
    assert h is x and torch.equal(y, rmsnorm_reference(x, w, EPS)[0])
    gu = rand(gen, 3, 40, dtype=torch.float32)
    assert torch.equal(silu_mul(gu), silu_mul_reference(gu))
    assert torch.equal(sigmoid_mul(x, gu), sigmoid_mul_reference(x, gu))
    case = qk_case(gen, 1, 2, 2, 1, 16, 16, "both", torch.float32, start=0)
    args = (case["qkv"], 2, 1, 16, case["q_norm"], case["k_norm"], EPS, case["cos"], case["sin"])
    kc, vc = case["k_base"][1, ..., :16], case["v_base"][1, ..., :16]
    kc2, vc2 = kc.clone(), vc.clone()
    assert torch.equal(qk_norm_rope_store(*args, kc, vc, case["slots"]),
                       qk_norm_rope_store_reference(*args, kc2, vc2, case["slots"]))
    assert torch.equal(kc.nan_to_num(), kc2.nan_to_num()) and torch.equal(vc.nan_to_num(), vc2.nan_to_num())
    assert not called
    monkeypatch.setenv("ENGINE_DISABLE_TRITON", "1")
    assert fused.triton_disabled()


@pytest.mark.cpu
def test_rmsnorm_writes_into_out():
    """`out` receives the norm, as the draft's layers write their block rows after the context rows of one buffer:
    a contiguous part of it (one sequence) and a strided one (several) alike; the rows around stay untouched."""
    gen = torch.Generator().manual_seed(8)
    w = rand(gen, 40, dtype=torch.float32)
    for batch in (1, 3):
        x, res = rand(gen, batch, 4, 40, dtype=torch.float32), rand(gen, batch, 4, 40, dtype=torch.float32)
        buf = torch.full((batch, 6, 40), float("nan"))
        y, h = rmsnorm(x, w, EPS, res, out=buf[:, 2:])
        want_y, want_h = rmsnorm_reference(x, w, EPS, res)
        assert y.data_ptr() == buf[:, 2:].data_ptr() and torch.equal(buf[:, 2:], want_y) and torch.equal(h, want_h)
        assert buf[:, :2].isnan().all()


@pytest.mark.cpu
def test_shape_errors():
    pytest.importorskip("triton")
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError):
        rmsnorm_triton(x, torch.zeros(7), EPS)
    with pytest.raises(ValueError):
        rmsnorm_triton(x, torch.zeros(8), EPS, out=torch.zeros(2, 7))
    with pytest.raises(ValueError):
        silu_mul_triton(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="gate must match"):
        sigmoid_mul_triton(x, torch.zeros(2, 7))
    qkv, cos = torch.zeros(1, 2, 4 * 8), torch.zeros(1, 2, 8)
    cache = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError):  # H + 2 KVH = 4 heads of 8, but 3 heads declared
        qk_norm_rope_store_triton(qkv, 1, 1, 8, None, None, EPS, cos, cos, cache, cache, torch.arange(2))
    with pytest.raises(ValueError):  # odd rotary dims
        qk_norm_rope_store_triton(qkv, 2, 1, 8, None, None, EPS, cos[..., :5], cos[..., :5], cache, cache,
                                  torch.arange(2))


# ---------------------------------------------------------------------------------------------------- GPU tests

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or fused.triton is None,
                                reason="needs a CUDA GPU and Triton")
BF16 = torch.bfloat16
QK_GPU = [  # (H, KVH, D, R, norms, gated): Qwen3-8B, a 9/3 GQA without norms, partial rotary, Qwen3.6-27B (gated)
    (32, 8, 128, 128, "both", False),
    (9, 3, 64, 64, None, False),
    (32, 8, 128, 32, None, False),
    (24, 4, 256, 64, "both", True),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [4096, 576, 5120])
def test_gpu_rmsnorm(N):
    gen = torch.Generator().manual_seed(10 + N)
    for T in (1, 16, 65):
        for shape in ((T, N), (2, T, N)):
            for residual in (False, True):
                check_rmsnorm(rmsnorm_triton, gen, shape, BF16, "cuda", residual, f"rmsnorm {shape} res={residual}")
        check_rmsnorm(rmsnorm_triton, gen, (T, N), BF16, "cuda", True, f"rmsnorm T={T} in place", inplace=True)
        check_rmsnorm(rmsnorm_triton, gen, (T, N), torch.float32, "cuda", True, f"rmsnorm fp32 T={T}")
        check_rmsnorm_rows(rmsnorm_triton, gen, (T, N), BF16, "cuda", True, f"int8 rows T={T}")
    x, w = rand(gen, 16, N, dtype=BF16, device="cuda"), rand(gen, N, dtype=BF16, device="cuda")
    assert_close(rmsnorm(x, w, EPS)[0], rmsnorm_reference(x, w, EPS)[0], "dispatcher")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("H,KVH,D,R,norms,gated", QK_GPU)
def test_gpu_qk_norm_rope_store(H, KVH, D, R, norms, gated):
    gen = torch.Generator().manual_seed(20 + H + D + R)
    for T in (1, 16, 65):
        for B in (1, 2):
            case = qk_case(gen, B, T, H, KVH, D, R, norms, BF16, "cuda", cap=4096, start=1000 + T, pad=0, gated=gated)
            check_qk(qk_norm_rope_store_triton, case, f"qk B{B} T{T} H{H} KVH{KVH} D{D} R{R} {norms}",
                     use_out=B == 2)
    case = qk_case(gen, 1, 16, H, KVH, D, R, norms, torch.float32, "cuda", cap=4096, start=None, gated=gated)
    check_qk(qk_norm_rope_store_triton, case, "qk fp32 scattered slots")
    case = qk_case(gen, 1, 16, H, KVH, D, R, norms, BF16, "cuda", cap=4096, start=7, gated=gated)
    check_qk(lambda *a, out=None, **kw: qk_norm_rope_store(*a, **kw), case, "dispatcher", use_out=False)
    if not gated:  # after a folded norm (engine.model): the 8B's width, and two chunks of the row's load
        for T, N in ((1, 4096), (16, 4096), (65, 4096), (16, 8192)):
            case = qk_case(gen, 1, T, H, KVH, D, R, norms, BF16, "cuda", cap=4096, start=900, pad=0, folded=N)
            check_qk(qk_norm_rope_store_triton, case, f"qk folded N{N} T{T} H{H} KVH{KVH} D{D} R{R} {norms}")
        case = qk_case(gen, 1, 16, H, KVH, D, R, norms, BF16, "cuda", cap=4096, start=7, folded=4096)
        check_qk(lambda *a, out=None, **kw: qk_norm_rope_store(*a, **kw), case, "dispatcher, folded", use_out=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("I", [12288, 1536, 14336])
def test_gpu_silu_mul(I):
    gen = torch.Generator().manual_seed(30 + I)
    for T in (1, 16, 65):
        check_silu(silu_mul_triton, gen, (T, 2 * I), BF16, "cuda", f"silu T={T} I={I}")
    check_silu(silu_mul_triton, gen, (2, 16, 2 * I), BF16, "cuda", f"silu 3-d I={I}")
    check_silu(silu_mul_triton, gen, (16, 2 * I), torch.float32, "cuda", f"silu fp32 I={I}")
    for T in (1, 16, 65):
        check_silu(silu_mul_triton, gen, (T, 2 * I), BF16, "cuda", f"silu folded T={T} I={I}", folded=4096)
    gu = rand(gen, 16, 2 * I, dtype=BF16, device="cuda")
    assert_close(silu_mul(gu), silu_mul_reference(gu), "dispatcher")
    h = rand(gen, 16, 4096, dtype=BF16, device="cuda", scale=3.0)
    assert_close(silu_mul(gu, norm_input=h, norm_eps=FOLD_EPS), silu_mul_reference(gu, h, FOLD_EPS), "dispatcher, folded")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [6144, 4096, 1024])  # Qwen3.6-27B's attention width, then smaller hybrids'
def test_gpu_sigmoid_mul(N):
    gen = torch.Generator().manual_seed(50 + N)
    for T in (1, 16, 65):
        check_sigmoid(sigmoid_mul_triton, gen, (T, N), BF16, "cuda", f"sigmoid T={T} N={N}")
    check_sigmoid(sigmoid_mul_triton, gen, (2, 16, N), BF16, "cuda", f"sigmoid 3-d N={N}")
    check_sigmoid(sigmoid_mul_triton, gen, (16, N), torch.float32, "cuda", f"sigmoid fp32 N={N}")
    x, g = rand(gen, 16, N, dtype=BF16, device="cuda"), rand(gen, 16, N, dtype=BF16, device="cuda")
    assert_close(sigmoid_mul(x, g), sigmoid_mul_reference(x, g), "dispatcher")


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph():
    """rmsnorm (with residual, in place) -> qk_norm_rope_store -> silu_mul captured once, replayed with new inputs
    copied in place (new positions and slots included), checked against the references after each replay."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(40)
    T, N, H, KVH, D, I, CAP = 16, 4096, 32, 8, 128, 12288, 4096
    x = torch.empty(T, N, dtype=BF16, device=dev)
    res = torch.empty_like(x)
    w = rand(gen, N, dtype=BF16, device=dev)
    qkv = torch.empty(1, T, (H + 2 * KVH) * D, dtype=BF16, device=dev)
    qn, kn = rand(gen, D, dtype=BF16, device=dev), rand(gen, D, dtype=BF16, device=dev)
    cos = torch.empty(1, T, D, dtype=BF16, device=dev)
    sin = torch.empty_like(cos)
    slots = torch.empty(T, dtype=torch.long, device=dev)
    kc = torch.zeros(1, KVH, CAP, D, dtype=BF16, device=dev)
    vc = torch.zeros_like(kc)
    gu = torch.empty(T, 2 * I, dtype=BF16, device=dev)
    y, q, act = torch.empty_like(x), torch.empty(1, H, T, D, dtype=BF16, device=dev), torch.empty(T, I, dtype=BF16,
                                                                                                  device=dev)

    def fill(step):
        x.copy_(rand(gen, T, N, dtype=BF16, device=dev))
        res.copy_(rand(gen, T, N, dtype=BF16, device=dev))
        qkv.copy_(rand(gen, 1, T, (H + 2 * KVH) * D, dtype=BF16, device=dev, scale=2.0))
        c, s = rope_cos_sin(gen, 1, T, D, BF16, dev, start=100 * step)
        cos.copy_(c)
        sin.copy_(s)
        slots.copy_(torch.arange(T, device=dev) + 100 * step)
        gu.copy_(rand(gen, T, 2 * I, dtype=BF16, device=dev, scale=3.0))

    def body():
        rmsnorm_triton(x, w, EPS, res, out=y, h_out=res)
        qk_norm_rope_store_triton(qkv, H, KVH, D, qn, kn, EPS, cos, sin, kc, vc, slots, out=q)
        silu_mul_triton(gu, out=act)

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for step in (1, 2, 3):
        fill(step)
        want_y, want_h = rmsnorm_reference(x, w, EPS, res)
        kr, vr = kc.clone(), vc.clone()
        want_q = qk_norm_rope_store_reference(qkv, H, KVH, D, qn, kn, EPS, cos, sin, kr, vr, slots)
        want_act = silu_mul_reference(gu)
        y.fill_(float("nan"))
        q.fill_(float("nan"))
        act.fill_(float("nan"))
        kc[:, :, slots] = float("nan")
        vc[:, :, slots] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, want_y, f"graph step {step} y")
        assert_close(res, want_h, f"graph step {step} h")
        assert_close(q, want_q, f"graph step {step} q")
        assert_close(kc, kr, f"graph step {step} k cache")
        assert torch.equal(vc, vr), f"graph step {step} v cache"
        assert_close(act, want_act, f"graph step {step} act")


if __name__ == "__main__":  # python -m correctness.test_kernel_fused CHECK  (with TRITON_INTERPRET=1)
    run_checks_main(CHECKS)
