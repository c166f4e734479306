"""Tree-verify attention (kernels/tree_attention.py): the Triton kernel against the PyTorch reference.

Fresh seeded random inputs per case; the output buffer is poisoned with NaN before the kernel runs and every
element must be written (and nothing around it); cache rows at or past start + T are poisoned with NaN too, so a
kernel that lets an invisible row leak in fails. Comparisons are against the reference computed in float64, with
tolerances by dtype.

- CPU (`cpu`): the reference against an independent per-query loop; the dispatcher; and the Triton kernel under
  the interpreter at small shapes. TRITON_INTERPRET=1 takes effect when `@triton.jit` decorates the kernels, so
  those cases run in a subprocess that imports the kernel module afresh with it set (pytest-xdist workers may
  have imported it already without).
- GPU (`gpu`, skipped without CUDA): real shapes (Qwen3-8B-like H=32/KVH=8/D=128 and SmolLM2 H=9/KVH=3/D=64,
  CAP=4096, bf16), other dtypes and cache layouts, the dispatcher, and a CUDA-graph replay with `start` changed in
  place.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from correctness.kernel_harness import (assert_interpreted_ok, interpreter_numpy_fix, programs_in_reverse,
                                       run_checks_main)
import kernels
from kernels import tree_attention as ta
from kernels.tree_attention import tokens_per_tile, tree_attention, tree_attention_reference, tree_attention_triton

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # atol = rtol, vs a float64 reference
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# inputs

def seeded(name: str, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Ancestor-or-self mask of a tree given parents[i] < i for nodes 1..T-1 (node 0 is the root)."""
    T = len(parents) + 1
    mask = torch.zeros(T, T, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(parents, start=1):
        assert 0 <= p < i
        mask[i] = mask[p]
        mask[i, i] = True
    return mask


def make_mask(kind: str, T: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "tree":  # random tree: parents[i] uniform in [0, i)
        parents = [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    elif kind == "deep":  # mostly chains with a few branches, like a DDTree draft tree
        parents = [i - 1 if torch.rand(1, generator=gen).item() < 0.7 else
                   int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    elif kind == "chain":  # causal: a DFlash block
        parents = list(range(T - 1))
    elif kind == "star":  # every node a child of the root
        parents = [0] * (T - 1)
    elif kind == "diag":  # each node sees only itself (rows whose only visible key lies in a later block/split)
        return torch.eye(T, dtype=torch.bool)
    elif kind == "full":  # every new row sees every new row (the DFlash draft's non-causal block)
        return torch.ones(T, T, dtype=torch.bool)
    else:
        raise ValueError(kind)
    return tree_mask(parents)


def make_qkv(B, H, KVH, T, D, CAP, dtype, layout, gen, device="cpu", q_std=1.0):
    """q [B, H, T, D] and caches [B, KVH, CAP, D] in one of three layouts (all with a contiguous last dim)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.float32).to(device)

    if layout == "contig":
        q = rnd(B, H, T, D)
        k, v = rnd(B, KVH, CAP, D), rnd(B, KVH, CAP, D)
    elif layout == "hf":  # [B, S, heads, D] storage seen as [B, heads, S, D]
        q = rnd(B, T, H, D).transpose(1, 2)
        k, v = rnd(B, CAP, KVH, D).transpose(1, 2), rnd(B, CAP, KVH, D).transpose(1, 2)
    elif layout == "layers":  # one layer of a [layers, B, KVH, CAP + pad, D] buffer
        k = rnd(3, B, KVH, CAP + 7, D)[1, :, :, 3:CAP + 3]
        v = rnd(3, B, KVH, CAP + 7, D)[2, :, :, 2:CAP + 2]
        q = rnd(B, H, T, D)
    else:
        raise ValueError(layout)
    return (q * q_std).to(dtype), k.to(dtype), v.to(dtype)


def poison_tail(cache: torch.Tensor, end: int) -> torch.Tensor:
    """A copy (same strides) of the cache with rows >= end set to NaN: they must never reach the output."""
    c = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=cache.device)
    c.copy_(cache)
    c[:, :, end:] = float("nan")
    return c


def excess(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """max(|out - ref| - tol * (1 + |ref|)): > 0 means a mismatch (NaN counts as a mismatch)."""
    out, ref = out.double(), ref.double()
    bad = ((out - ref).abs() - tol * (1 + ref.abs()))
    bad = torch.where(torch.isnan(bad), torch.full_like(bad, math.inf), bad)
    return bad.max().item()


def run_poisoned(q, k, v, start, mask, **kw):
    """Run the kernel into a NaN-filled view of a bigger buffer; return (out, whether anything around it was hit)."""
    B, H, T, D = q.shape
    big = torch.full((B, H + 1, T + 2, D + 3), float("nan"), dtype=q.dtype, device=q.device)
    out = big[:, 1:, 1:T + 1, 2:D + 2]
    res = tree_attention_triton(q, k, v, start, mask, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    outside = big.clone()
    outside[:, 1:, 1:T + 1, 2:D + 2] = float("nan")
    return out, bool((~torch.isnan(outside)).any())


# ---------------------------------------------------------------------------------------------------------------
# interpreter cases (small shapes: the whole file must stay well under a minute on 2 cores)

@dataclass
class Case:
    name: str
    H: int
    KVH: int
    T: int
    D: int
    CAP: int
    starts: list
    B: int = 1
    dtype: str = "fp32"
    mask: str = "tree"
    layout: str = "contig"
    split_size: int = 32
    block_n: int = 16
    start_form: str = "tensor64"  # tensor64 | tensor32 | int
    q_std: float = 1.0
    check_grid: bool = False
    packed_starts: tuple | None = None  # the starts at which packed programs are checked too (None: all)


def _gqa_t_d_cases(H: int, KVH: int) -> list[Case]:
    """One GQA ratio x T in {1, 5, 16, 33} x D in {16, 32, 64}; start 0, a random one, CAP - T."""
    cases = []
    for ti, T in enumerate([1, 5, 16, 33]):
        for di, D in enumerate([16, 32, 64]):
            CAP = 96
            mid = int(torch.randint(1, CAP - T, (1,), generator=seeded(f"mid{H}{ti}{di}")))
            cases.append(Case(f"g{H // KVH}-T{T}-D{D}", H, KVH, T, D, CAP, [0, mid, CAP - T],
                              mask=["tree", "deep", "chain"][(H + ti + di) % 3], packed_starts=(mid,)))
    return cases


def _boundary_cases() -> list[Case]:
    return [
        # block_n 16, split 32: ends exactly at / one past block and split boundaries, and at CAP
        Case("T5-blocks-splits", 4, 2, 5, 16, 128, [0, 11, 12, 27, 28, 30, 59, 60, 123]),
        Case("T16-split64", 3, 1, 16, 16, 160, [0, 48, 49, 56, 144], split_size=64, mask="deep"),
        # 8 splits, the start of the range only: 7 neutral partials merged
        Case("neutral-splits", 4, 2, 5, 16, 256, [0, 3, 200], mask="star"),
        # split_size not a multiple of block_n (rounded up to 48)
        Case("split40", 4, 1, 7, 32, 150, [0, 41, 47, 143], split_size=40),
        # one split: the kernel writes `out` directly, no merge
        Case("single-split", 6, 2, 5, 32, 100, [0, 59, 95], split_size=512, block_n=64),
        Case("single-split-T33", 2, 1, 33, 16, 100, [0, 31, 67], split_size=512, block_n=64, mask="chain"),
        Case("block64-split128", 4, 2, 16, 16, 300, [0, 112, 113, 284], split_size=128, block_n=64),
        # head_dim not a power of two, and below 16 (padded for tl.dot)
        Case("D24", 6, 2, 5, 24, 96, [0, 30, 91]),
        Case("D8", 4, 4, 9, 8, 80, [0, 23, 71], mask="full"),
        # every new row sees every other (a draft's bidirectional block): row 0's keys cross a split boundary
        # although start + 1 does not
        Case("full-across-split", 4, 2, 9, 16, 96, [28, 60], mask="full"),
        Case("D40-gqa3", 3, 1, 16, 40, 96, [5, 80], mask="tree"),
        # peaky softmax: the running max changes a lot between blocks and splits
        Case("peaky", 4, 2, 5, 32, 128, [3, 61, 123], q_std=6.0),
        Case("star-T33", 4, 2, 33, 16, 96, [17, 63], mask="star", split_size=64),
        # rows that see nothing in the first blocks / splits (only themselves): -inf running max, neutral partials
        Case("diag-T33", 4, 2, 33, 16, 96, [0, 1, 40], mask="diag", split_size=16),
        Case("diag-T33-one-split", 2, 2, 33, 16, 64, [0, 31], mask="diag", split_size=512),
    ]


def _dtype_layout_cases() -> list[Case]:
    return [
        Case("bf16-g4", 8, 2, 16, 32, 96, [0, 40, 80], dtype="bf16"),
        Case("bf16-T1", 8, 2, 1, 64, 96, [0, 33, 95], dtype="bf16"),
        Case("fp16-g3", 6, 2, 5, 64, 96, [0, 29, 91], dtype="fp16", mask="chain"),
        Case("hf-layout", 6, 2, 5, 32, 80, [0, 35, 75], layout="hf", B=2),
        Case("layers-view", 4, 1, 16, 16, 96, [0, 33, 80], layout="layers", B=2, dtype="bf16"),
        Case("start-int32", 4, 2, 5, 16, 96, [0, 50, 91], start_form="tensor32"),
        Case("start-int", 4, 2, 5, 16, 96, [0, 50, 91], start_form="int"),
        Case("grid-fixed", 4, 2, 16, 16, 128, [0, 7, 47, 112], check_grid=True),
    ]


GROUPS = {  # one interpreter subprocess each (a few seconds): pytest-xdist spreads them over the workers
    "gqa1": lambda: _gqa_t_d_cases(2, 2),
    "gqa3": lambda: _gqa_t_d_cases(6, 2),
    "gqa4": lambda: _gqa_t_d_cases(8, 2),
    "boundaries": _boundary_cases,
    "dtypes_layouts": _dtype_layout_cases,
}


class _GridSpy:
    """Stands in for the forward kernel object to record the launch grids."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def check_case(case: Case) -> dict:
    """Run one case at each of its starts; return {'ok', 'errors', 'max_excess', 'max_abs_err'}."""
    dtype = DTYPES[case.dtype]
    gen = seeded(case.name)
    q, k, v = make_qkv(case.B, case.H, case.KVH, case.T, case.D, case.CAP, dtype, case.layout, gen, q_std=case.q_std)
    mask = make_mask(case.mask, case.T, gen)
    errors, worst, max_err = [], -math.inf, 0.0
    packed = tokens_per_tile(case.H // case.KVH)
    spy = None
    if case.check_grid:
        spy = ta._tree_attn_fwd = _GridSpy(ta._tree_attn_fwd)
    try:
        for start in case.starts:
            assert 0 <= start and start + case.T <= case.CAP, (case.name, start)
            if case.start_form == "tensor64":
                s = torch.tensor(start, dtype=torch.int64)
            elif case.start_form == "tensor32":
                s = torch.tensor(start, dtype=torch.int32)
            else:
                s = start
            kp, vp = poison_tail(k, start + case.T), poison_tail(v, start + case.T)
            out, outside = run_poisoned(q, kp, vp, s, mask, split_size=case.split_size, block_n=case.block_n,
                                        tokens_per_program=1)
            # The same bits with the programs run in reverse order (a stray write then shows), and with several
            # tokens per program.
            variants = []
            if not case.check_grid and start == case.starts[0]:
                variants.append((1, "the result depends on the order the programs run in"))
            if not case.check_grid and packed > 1 and case.T > 1 and start in (case.packed_starts or case.starts):
                variants.append((packed, f"{packed} tokens per program changed the result"))
            for tokens, problem in variants:
                with programs_in_reverse():
                    other = tree_attention_triton(q, kp, vp, s, mask, split_size=case.split_size,
                                                  block_n=case.block_n, tokens_per_program=tokens)
                if not torch.equal(other, out):
                    errors.append(f"start={start}: {problem}")
            ref = tree_attention_reference(q.double(), k.double(), v.double(), start, mask)
            e = excess(out, ref, TOL[dtype])
            worst = max(worst, e)
            max_err = max(max_err, (out.double() - ref).abs().max().item())
            if outside:
                errors.append(f"start={start}: wrote outside `out`")
            if torch.isnan(out).any():
                errors.append(f"start={start}: {int(torch.isnan(out).sum())} output elements NaN (unwritten?)")
            elif e > 0:
                errors.append(f"start={start}: max |out - ref| exceeds the {case.dtype} tolerance by {e:.3g}")
    finally:
        if spy is not None:
            ta._tree_attn_fwd = spy.kernel
    if spy is not None and len(set(spy.grids)) != 1:
        errors.append(f"launch grid depends on start: {spy.grids}")
    return {"ok": not errors, "errors": errors, "max_excess": worst, "max_abs_err": max_err}


def _interpreter_main(group: str) -> int:
    """Entry point of the interpreter subprocess: run a group, print one JSON line, exit 1 on any mismatch."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    interpreter_numpy_fix()
    torch.set_num_threads(1)
    results = {}
    for case in GROUPS[group]():
        t0 = time.perf_counter()
        try:
            r = check_case(case)
        except Exception as e:  # noqa: BLE001 - reported, then the test fails
            r = {"ok": False, "errors": [f"{type(e).__name__}: {e}"], "max_excess": None}
        left = sum(int(c.count_nonzero()) for c in kernels._COUNTERS.values())
        if left:  # each call's merging split resets its group's counter: a stuck one would end a later merge early
            r["ok"] = False
            r["errors"].append(f"{left} arrival counters left non-zero")
            for c in kernels._COUNTERS.values():
                c.zero_()
        r["seconds"] = round(time.perf_counter() - t0, 3)
        results[case.name] = r
    print("RESULTS " + json.dumps(results))
    return 0 if all(r["ok"] for r in results.values()) else 1


def _run_interpreter_group(group: str) -> dict:
    code = ("import sys; from correctness.test_kernel_tree_attention import _interpreter_main; "
            f"sys.exit(_interpreter_main({group!r}))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    if not lines:
        pytest.fail(f"interpreter run of {group} crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.cpu
@pytest.mark.parametrize("group", list(GROUPS))
def test_interpreter_kernel_matches_reference(group):
    pytest.importorskip("triton")
    results = _run_interpreter_group(group)
    assert set(results) == {c.name for c in GROUPS[group]()}
    failures = {name: r["errors"] for name, r in results.items() if not r["ok"]}
    assert not failures, json.dumps(failures, indent=1)


# ---------------------------------------------------------------------------------------------------------------
# CPU: the reference itself and the dispatcher

def naive_tree_attention(q, k_cache, v_cache, start: int, node_mask):
    """Per (batch, head, query) loop over the visible keys, in float64."""
    B, H, T, D = q.shape
    G = H // k_cache.shape[1]
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = list(range(start)) + [start + j for j in range(T) if node_mask[i, j]]
                kk = k_cache[b, h // G, keys].double()
                vv = v_cache[b, h // G, keys].double()
                p = torch.softmax(kk @ q[b, h, i].double() / math.sqrt(D), dim=0)
                out[b, h, i] = p @ vv
    return out


@pytest.mark.cpu
@pytest.mark.parametrize("H,KVH,T,D,CAP,start,mask_kind", [
    (2, 2, 1, 16, 20, 0, "chain"),
    (6, 2, 5, 8, 20, 7, "tree"),
    (8, 2, 16, 24, 40, 24, "deep"),
    (3, 1, 9, 16, 30, 21, "star"),
    (4, 4, 6, 32, 12, 0, "full"),
])
def test_reference_matches_naive(H, KVH, T, D, CAP, start, mask_kind):
    gen = seeded(f"naive-{H}-{T}-{start}")
    q, k, v = make_qkv(2, H, KVH, T, D, CAP, torch.float32, "hf", gen)
    mask = make_mask(mask_kind, T, gen)
    ref = tree_attention_reference(q, poison_tail(k, start + T), poison_tail(v, start + T), start, mask)
    assert ref.dtype == torch.float32 and ref.shape == q.shape
    torch.testing.assert_close(ref.double(), naive_tree_attention(q, k, v, start, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.cpu
def test_reference_start_forms_and_dtype():
    gen = seeded("forms")
    q, k, v = make_qkv(1, 4, 2, 5, 16, 32, torch.bfloat16, "contig", gen)
    mask = make_mask("tree", 5, gen)
    a = tree_attention_reference(q, k, v, 9, mask)
    assert a.dtype == torch.bfloat16
    for s in (torch.tensor(9), torch.tensor(9, dtype=torch.int32)):
        assert torch.equal(a, tree_attention_reference(q, k, v, s, mask))
    with pytest.raises(ValueError):
        tree_attention_reference(q, k, v, 28, mask)  # start + T > CAP


@pytest.mark.cpu
def test_dispatch_on_cpu_is_the_reference(monkeypatch):
    gen = seeded("dispatch-cpu")
    q, k, v = make_qkv(1, 6, 2, 5, 16, 40, torch.float32, "contig", gen)
    mask = make_mask("tree", 5, gen)
    monkeypatch.setattr(ta, "tree_attention_triton", lambda *a, **kw: pytest.fail("kernel called on CPU tensors"))
    assert torch.equal(tree_attention(q, k, v, torch.tensor(11), mask), tree_attention_reference(q, k, v, 11, mask))


@pytest.mark.cpu
def test_tokens_per_program_is_checked():
    pytest.importorskip("triton")
    assert [tokens_per_tile(G) for G in (1, 2, 3, 4, 6, 8, 16, 32)] == [16, 8, 4, 4, 2, 2, 1, 1]
    q, k, v = make_qkv(1, 8, 2, 5, 16, 64, torch.float32, "contig", seeded("tok"))
    with pytest.raises(ValueError, match="tokens_per_program must be 1 or 4 for 4 query heads per kv head, got 2"):
        tree_attention_triton(q, k, v, 0, torch.ones(5, 5, dtype=torch.bool), tokens_per_program=2)


@pytest.mark.cpu
def test_default_packing_rule():
    """Packed in batched calls with T > 1; one sequence packs from T x capacity = PACK_ROWS_X_KEYS; never T = 1."""
    assert ta.default_tokens_per_program(1, 16, 512, 4) == 1        # the 8B's DDTree-15 verify, short context
    assert ta.default_tokens_per_program(1, 65, 512, 4) == 1        # DDTree-64, short
    assert ta.default_tokens_per_program(1, 65, 1024, 4) == 4       # DDTree-64, 1024-key cache
    assert ta.default_tokens_per_program(1, 16, 4096, 6) == 2       # the 27B's shape (6 query heads per kv head)
    assert ta.default_tokens_per_program(1, 1, 1 << 20, 4) == 1     # decode never packs
    assert ta.default_tokens_per_program(2, 2, 16, 4) == 4          # batched
    assert ta.default_tokens_per_program(8, 1, 4096, 4) == 1


@pytest.mark.cpu
def test_disable_flag(monkeypatch):
    monkeypatch.delenv("ENGINE_DISABLE_TRITON", raising=False)
    assert not ta.triton_disabled()
    monkeypatch.setenv("ENGINE_DISABLE_TRITON", "0")
    assert not ta.triton_disabled()
    monkeypatch.setenv("ENGINE_DISABLE_TRITON", "1")
    assert ta.triton_disabled()


# ---------------------------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_SHAPES = [(32, 8, 128), (9, 3, 64), (24, 4, 256)]  # Qwen3-8B, SmolLM2-135M, Qwen3.6-27B (H, KVH, D)
GPU_CAP = 4096


def _gpu_starts(T: int) -> list[int]:
    # 0; ends at / one past the 512-key split and 64-key block boundaries; mid; the end of the cache
    return sorted({0, 512 - T, 513 - T, 1000, 2047, 3000 - T // 2, GPU_CAP - T})


def _gpu_check(q, k, v, mask, starts, tol, **kw):
    T = q.shape[2]
    ref_q, ref_k, ref_v = q.double(), k.double(), v.double()
    for start in starts:
        kp, vp = poison_tail(k, start + T), poison_tail(v, start + T)
        out, outside = run_poisoned(q, kp, vp, torch.tensor(start, device=q.device), mask, **kw)
        ref = tree_attention_reference(ref_q, ref_k, ref_v, start, mask)
        assert not outside, f"start={start}: wrote outside `out`"
        assert not torch.isnan(out).any(), f"start={start}: unwritten (NaN) output elements"
        e = excess(out, ref, tol)
        assert e <= 0, f"start={start}: mismatch, excess {e:.3g} (max abs err {(out.double() - ref).abs().max():.3g})"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 65])
@pytest.mark.parametrize("H,KVH,D", GPU_SHAPES)
def test_gpu_bf16_real_shapes(H, KVH, D, T):
    gen = seeded(f"gpu-{H}-{T}", "cuda")
    q, k, v = make_qkv(1, H, KVH, T, D, GPU_CAP, torch.bfloat16, "contig", gen, device="cuda")
    mask = make_mask("deep" if T > 16 else "tree", T, seeded(f"gpu-mask-{T}")).cuda()
    for tokens in sorted({1, tokens_per_tile(H // KVH)}):
        _gpu_check(q, k, v, mask, _gpu_starts(T), TOL[torch.bfloat16], tokens_per_program=tokens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("H,KVH,D", GPU_SHAPES)
def test_gpu_other_dtypes(H, KVH, D, dtype):
    dt = DTYPES[dtype]
    gen = seeded(f"gpu-{dtype}-{H}", "cuda")
    q, k, v = make_qkv(1, H, KVH, 16, D, GPU_CAP, dt, "contig", gen, device="cuda")
    mask = make_mask("tree", 16, seeded("gpu-dt-mask")).cuda()
    _gpu_check(q, k, v, mask, [0, 497, 2047, GPU_CAP - 16], TOL[dt])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["hf", "layers"])
def test_gpu_strided_caches_and_options(layout):
    gen = seeded(f"gpu-{layout}", "cuda")
    q, k, v = make_qkv(2, 12, 4, 9, 64, 1000, torch.bfloat16, layout, gen, device="cuda")
    mask = make_mask("tree", 9, seeded("gpu-layout-mask")).cuda()
    _gpu_check(q, k, v, mask, [0, 250, 511, 991], TOL[torch.bfloat16])
    # other tilings: one split (direct write), small blocks, odd split sizes
    for kw in (dict(split_size=4096), dict(block_n=32, split_size=96), dict(block_n=16, split_size=50)):
        _gpu_check(q, k, v, mask, [0, 500, 991], TOL[torch.bfloat16], **kw)


@pytest.mark.gpu
@needs_cuda
def test_gpu_odd_head_dims():
    for D in (24, 8, 80):
        gen = seeded(f"gpu-D{D}", "cuda")
        q, k, v = make_qkv(1, 8, 2, 7, D, 700, torch.bfloat16, "contig", gen, device="cuda")
        mask = make_mask("tree", 7, seeded("gpu-D-mask")).cuda()
        _gpu_check(q, k, v, mask, [0, 505, 693], TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("H,KVH,D", GPU_SHAPES)
def test_gpu_cuda_graph_replay_with_new_start(H, KVH, D, T):
    gen = seeded(f"graph-{H}-{T}", "cuda")
    q, k, v = make_qkv(1, H, KVH, T, D, GPU_CAP, torch.bfloat16, "contig", gen, device="cuda")
    mask = make_mask("tree", T, seeded("graph-mask")).cuda()
    start = torch.zeros((), dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile outside the capture
        for _ in range(2):
            tree_attention(q, k, v, start, mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(q, k, v, start, mask)
    for s in [0, 700, GPU_CAP - T, 13, 2500, 511]:
        start.fill_(s)
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref = tree_attention_reference(q.double(), k.double(), v.double(), s, mask)
        e = excess(out, ref, TOL[torch.bfloat16])
        assert e <= 0, f"replay with start={s}: excess {e:.3g}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_and_disable_flag(monkeypatch):
    gen = seeded("gpu-dispatch", "cuda")
    q, k, v = make_qkv(1, 9, 3, 5, 64, 600, torch.bfloat16, "contig", gen, device="cuda")
    mask = make_mask("tree", 5, seeded("gpu-dispatch-mask")).cuda()
    calls = []
    real = ta.tree_attention_triton
    monkeypatch.setattr(ta, "tree_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("ENGINE_DISABLE_TRITON", raising=False)
    ref = tree_attention_reference(q.double(), k.double(), v.double(), 300, mask)
    out = ta.tree_attention(q, k, v, torch.tensor(300, device="cuda"), mask)
    assert calls == [1] and excess(out, ref, TOL[torch.bfloat16]) <= 0
    out = ta.tree_attention(q, k, v, 300, mask)  # a Python int start
    assert calls == [1, 1] and excess(out, ref, TOL[torch.bfloat16]) <= 0
    monkeypatch.setenv("ENGINE_DISABLE_TRITON", "1")
    out = ta.tree_attention(q, k, v, torch.tensor(300, device="cuda"), mask)
    assert calls == [1, 1] and excess(out, ref, TOL[torch.bfloat16]) <= 0
    monkeypatch.delenv("ENGINE_DISABLE_TRITON")
    big_T = ta.MAX_TRITON_T + 1  # beyond the kernel's range: the reference
    q2, k2, v2 = make_qkv(1, 9, 3, big_T, 64, 600, torch.bfloat16, "contig", gen, device="cuda")
    ta.tree_attention(q2, k2, v2, 10, torch.ones(big_T, big_T, dtype=torch.bool, device="cuda"))
    assert calls == [1, 1]


# ---------------------------------------------------------------------------------------------------------------
# Verification reproduces decoding bit for bit (CPU under the interpreter, and GPU)

def decode_invariance_errors(H, KVH, D, CAP, T, starts, mask_kind, dtype, device, verify_tokens=None,
                             **kw) -> list[str]:
    """Each row of a T-row pass must equal, bit for bit, the one-token step that decoding runs for it: its
    visible new rows (ancestors) committed contiguously after `start`, the token itself last. verify_tokens: the
    verify pass's tokens per program (the kernel's default where None)."""
    gen = seeded(f"invariance-{H}-{T}-{mask_kind}")
    q, k, v = make_qkv(1, H, KVH, T, D, CAP, dtype, "contig", gen, q_std=3.0)
    q, k, v = q.to(device), k.to(device), v.to(device)
    mask = make_mask(mask_kind, T, gen).to(device)
    one = torch.ones(1, 1, dtype=torch.bool, device=device)
    errors = []
    for start in starts:
        out = tree_attention_triton(q, k, v, start, mask, tokens_per_program=verify_tokens, **kw)
        for t in range(T):
            seen = mask[t].nonzero()[:, 0]
            k1, v1 = k.clone(), v.clone()
            k1[:, :, start:start + len(seen)] = k[:, :, start + seen]
            v1[:, :, start:start + len(seen)] = v[:, :, start + seen]
            step = tree_attention_triton(q[:, :, t:t + 1], k1, v1, start + len(seen) - 1, one, **kw)
            if not torch.equal(step[:, :, 0], out[:, :, t]):
                diff = (step[:, :, 0].float() - out[:, :, t].float()).abs().max().item()
                errors.append(f"start={start} row {t} ({len(seen)} visible new rows): differs by up to {diff:.3g}")
    return errors


def _interpreted_invariance() -> str:
    n = 0
    for mask_kind in ("tree", "chain"):
        for tokens in (1, tokens_per_tile(2)):
            # starts around the 64-key block and (split_size=64) split boundaries, so the new rows straddle them
            errors = decode_invariance_errors(4, 2, 16, 160, 9, (0, 37, 59, 64, 120), mask_kind, torch.bfloat16,
                                              "cpu", verify_tokens=tokens, split_size=64)
            assert not errors, (tokens, errors[:5])
            n += 1
    return f"{n} masks x program shapes, rows bit-identical to one-token steps"


@pytest.mark.cpu
def test_interpreter_verify_rows_equal_decode_steps():
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_tree_attention", "invariance")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("H,KVH,D", GPU_SHAPES)
def test_gpu_verify_rows_equal_decode_steps(H, KVH, D):
    for T, kind in ((16, "chain"), (16, "tree"), (33, "deep")):
        for tokens in sorted({1, tokens_per_tile(H // KVH)}):
            errors = decode_invariance_errors(H, KVH, D, 1100, T, (128, 190, 500 - T // 2, 1000), kind,
                                              torch.bfloat16, "cuda", verify_tokens=tokens)
            assert not errors, f"T={T} {kind}, {tokens} token(s) per program: {errors[:5]}"


# ---------------------------------------------------------------------------------------------------------------
# Batch rows with their own committed lengths and trees (batched decoding)

def batched_rows_errors(dtype, device, B=3, H=4, KVH=2, T=7, D=16, CAP=40, kernel=True) -> list[str]:
    """One call over B rows, each with its own start and tree: every row of the kernel equals, bit for bit, the same
    row run alone (a row's result does not depend on the rows beside it); kernel and reference equal the plain
    per-row definition within tolerance. kernel=False: the reference only."""
    gen = seeded(f"batched-{dtype}")
    q, k, v = make_qkv(B, H, KVH, T, D, CAP, dtype, "contig", gen, device=device)
    starts = torch.tensor([0, 13, 30][:B], device=device)
    masks = torch.stack([make_mask(kind, T, gen) for kind in ("chain", "tree", "star")][:B]).to(device)
    ref = tree_attention_reference(q, k, v, starts, masks)
    out = tree_attention_triton(q, k, v, starts, masks) if kernel else ref
    errors = []
    for b in range(B):
        start = int(starts[b])
        if kernel and not torch.equal(out[b:b + 1], tree_attention_triton(q[b:b + 1], k[b:b + 1], v[b:b + 1], start,
                                                                          masks[b])):
            errors.append(f"row {b}: differs from the row run alone")
        want = naive_tree_attention(q[b:b + 1].cpu().float(), k[b:b + 1].cpu().float(), v[b:b + 1].cpu().float(),
                                    start, masks[b].cpu())
        for name, got in (("kernel", out), ("reference", ref)):
            if excess(got[b:b + 1].cpu(), want, TOL[dtype]) > 0:
                errors.append(f"row {b}: the {name} differs from the definition")
    return errors


def _interpreted_batched_rows() -> str:
    errors = batched_rows_errors(torch.float32, "cpu")
    assert not errors, errors
    return "3 rows with their own starts and trees"


@pytest.mark.cpu
def test_interpreter_batched_rows_equal_rows_alone():
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_tree_attention", "batched_rows")


@pytest.mark.cpu
def test_reference_batched_rows_and_bad_starts():
    errors = batched_rows_errors(torch.float32, "cpu", kernel=False)
    assert not errors, errors
    q, k, v = make_qkv(2, 2, 2, 3, 8, 10, torch.float32, "contig", seeded("bad-starts"))
    with pytest.raises(ValueError, match="3 values for a batch of 2"):
        tree_attention_reference(q, k, v, torch.tensor([1, 2, 3]), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="node_mask must be"):
        tree_attention_reference(q, k, v, 0, torch.ones(3, 3, 3, dtype=torch.bool))


@pytest.mark.gpu
@needs_cuda
def test_gpu_batched_rows_equal_rows_alone():
    errors = batched_rows_errors(torch.bfloat16, "cuda", H=32, KVH=8, T=16, D=128, CAP=1200)
    assert not errors, errors


if __name__ == "__main__":
    run_checks_main({"invariance": _interpreted_invariance, "batched_rows": _interpreted_batched_rows})
