"""kernels.int8_linear: quantization, the kernel against its reference, and the reference against the weight it stands
for.

CPU: the reference directly; the kernel under the Triton interpreter in a subprocess (`python -m
correctness.test_kernel_int8_linear CHECK`), also with its programs in reverse order. GPU: the int8 weights of a draft
at Qwen3-8B's width (each projection, the LM head into float32) at 1 to 300 rows, and a CUDA-graph replay. Outputs are
NaN-poisoned first (out= buffers), so an element the kernel fails to write shows.

Tolerances: the kernel and the reference sum the same float32 products in another order; in float32 out they agree to
1e-5, in a 16-bit type a sum may round the other way for a few elements (as kernels.fused's tests).
"""
from __future__ import annotations

import pytest
import torch

from correctness.kernel_harness import (assert_close_ulps, assert_interpreted_ok, programs_in_reverse,
                                        run_checks_main)
from kernels.int8_linear import (Int8Rows, Int8Weight, int8_config, int8_linear, int8_linear_reference,
                                 int8_linear_triton, quantize_int8, quantize_rows_int8)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = (torch.bfloat16, torch.float16)


def assert_close(got, want, context):
    assert_close_ulps(got, want, context, fp32_tol=1e-5, atol=2 ** -5, rtol=2 ** -6, max_differing=0.01)


def case(gen, M, N, K, dtype, device="cpu", bias=False, strided=False):
    """x [M, K] (rows `strided` apart in a wider tensor if asked), an Int8Weight of a random [N, K] weight, bias."""
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    w[N // 3] = 0  # a row of zeros: scale 1, all-zero integers
    x = torch.randn(M, K + 8 if strided else K, generator=gen).to(dtype)[:, :K]
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    qw = quantize_int8(w.to(device))
    return x.to(device), qw, None if b is None else b.to(device)


def check(kernel, gen, M, N, K, dtype, device="cpu", bias=False, strided=False, out_dtype=None, config=None):
    x, w, b = case(gen, M, N, K, dtype, device, bias, strided)
    want = int8_linear_reference(x, w, b, out_dtype)
    out = torch.full((M, N), float("nan"), dtype=out_dtype or dtype, device=device)
    got = kernel(x, w, b, out_dtype, out=out, config=config)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, want, f"M={M} N={N} K={K} {dtype} bias={bias} strided={strided} out={out_dtype} {config}")


def check_rows(kernel, gen, M, N, K, dtype, device="cpu", bias=False, out_dtype=None, config=None):
    """x as int8 rows (a w8a8 draft's): the integer sums are exact, so without a bias the kernel equals the reference
    bit for bit (with one, the last product and the add may fuse)."""
    x, w, b = case(gen, M, N, K, dtype, device, bias)
    xq = quantize_rows_int8(x)
    want = int8_linear_reference(xq, w, b, out_dtype)
    out = torch.full((M, N), float("nan"), dtype=out_dtype or dtype, device=device)
    got = kernel(xq, w, b, out_dtype, out=out, config=config)
    context = f"int8 rows M={M} N={N} K={K} {dtype} bias={bias} out={out_dtype} {config}"
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, want, context)
    if not bias:
        assert torch.equal(got, want), f"{context}: {(got != want).sum().item()} elements differ"


# ------------------------------------------------------------------------------------------ interpreter checks

def _interp_kernel() -> str:
    gen = torch.Generator().manual_seed(1)
    cases = 0
    for dtype in DTYPES:
        # rows: a decode step, a block, a block and one row, a prompt; N and K not multiples of their tiles
        for M, N, K in ((1, 64, 64), (5, 100, 300), (16, 24, 40), (17, 130, 96), (70, 200, 72)):
            check(int8_linear_triton, gen, M, N, K, dtype, bias=M % 2 == 1, strided=M == 17)
            cases += 1
        check(int8_linear_triton, gen, 3, 150, 64, dtype, out_dtype=torch.float32)  # an LM head's float32 logits
        cases += 1
    return f"{cases} int8_linear cases"


def _interp_reversed() -> str:
    gen = torch.Generator().manual_seed(2)
    with programs_in_reverse():
        for M, N, K in ((16, 200, 96), (70, 260, 64)):
            check(int8_linear_triton, gen, M, N, K, torch.bfloat16, bias=True)
    return "2 cases with the programs in reverse"


def _interp_configs() -> str:
    """Every tile shape int8_config can pick, forced on one small shape."""
    gen = torch.Generator().manual_seed(3)
    configs = {int8_config(M, N, K) for M in (1, 20, 40, 64, 65) for N, K in ((64, 64), (4096, 4096), (8192, 4096))}
    for config in sorted(configs):
        check(int8_linear_triton, gen, 33, 150, 100, torch.bfloat16, config=config)
    return f"{len(configs)} configs"


def _interp_rows() -> str:
    """int8 rows of x: the shapes above, every tile int8_config picks for them, rows with a stride."""
    gen = torch.Generator().manual_seed(5)
    cases = 0
    for M, N, K in ((1, 64, 64), (5, 100, 300), (16, 24, 40), (17, 130, 96), (70, 200, 72)):
        check_rows(int8_linear_triton, gen, M, N, K, torch.bfloat16, bias=M % 2 == 1)
        cases += 1
    check_rows(int8_linear_triton, gen, 15, 150, 64, torch.bfloat16, out_dtype=torch.float32)
    configs = {int8_config(M, N, K, a8=True) for M in (1, 20, 40, 65) for N, K in ((64, 64), (4096, 4096),
                                                                                  (8192, 4096))}
    for config in sorted(configs):
        check_rows(int8_linear_triton, gen, 33, 150, 100, torch.float16, config=config)
    x, w, _ = case(gen, 6, 40, 64, torch.bfloat16)
    rows = quantize_rows_int8(torch.cat((x, x), dim=1))  # q rows 128 apart: take the first half of each row
    half = Int8Rows(rows.q[:, :64], rows.scale, rows.dtype)
    assert torch.equal(int8_linear_triton(half, w), int8_linear_reference(half, w)), "int8 rows with a stride"
    return f"{cases + len(configs) + 2} int8-row cases"


CHECKS = {"kernel": _interp_kernel, "reversed": _interp_reversed, "configs": _interp_configs, "rows": _interp_rows}


# ---------------------------------------------------------------------------------------------------- CPU tests

@pytest.mark.cpu
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_triton_kernel_under_interpreter(name):
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_int8_linear", name)


@pytest.mark.cpu
def test_quantization_is_within_half_a_step():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 200, generator=gen) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    w[5] = 0
    w[7, 3] = -w[7].abs().max() * 2  # the row's extreme is negative
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.dtype == torch.float32 and qw.shape == w.shape
    assert qw.q.abs().max() <= 127 and (qw.q.abs().amax(dim=1)[torch.arange(64) != 5] == 127).all()
    assert qw.scale[5] == 1 and (qw.q[5] == 0).all()
    err = (qw.q.float() * qw.scale[:, None] - w).abs()
    assert (err <= qw.scale[:, None] / 2 * (1 + 1e-6)).all()
    assert qw.nbytes == 64 * 200 + 4 * 64


@pytest.mark.cpu
def test_reference_is_the_dequantized_product():
    gen = torch.Generator().manual_seed(5)
    x, w, b = case(gen, 7, 48, 80, torch.bfloat16, bias=True)
    want = (x.double() @ (w.q.double() * w.scale.double()[:, None]).t() + b.double())
    got = int8_linear_reference(x, w, b, torch.float32)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert int8_linear(x, w, b).dtype == torch.bfloat16  # the dispatcher on CPU: the reference, x's dtype out
    assert torch.equal(int8_linear(x, w, b), int8_linear_reference(x, w, b))


@pytest.mark.cpu
@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x[:, :-1], w, None), "last dim must be 80"),
    (lambda x, w: (x, Int8Weight(w.q.float(), w.scale), None), "int8"),
    (lambda x, w: (x, Int8Weight(w.q, w.scale[:-1]), None), r"scale must be \[48\]"),
    (lambda x, w: (x, w, torch.zeros(47)), r"bias must be \[48\]"),
    (lambda x, w: (x, w.q, None), "Int8Weight"),
])
def test_bad_inputs_get_one_error(bad, match):
    x, w, _ = case(torch.Generator().manual_seed(6), 4, 48, 80, torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=match):
        int8_linear_reference(*bad(x, w))


@pytest.mark.cpu
def test_quantize_rejects_what_it_cannot_represent():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_int8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_int8(torch.ones(3))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_int8(torch.ones(2, 2, dtype=torch.int8))


# ---------------------------------------------------------------------------------------------------- GPU tests

# A DFlash draft at Qwen3-8B's width: fc (5 target layers in), qkv, o, gate/up, down; the LM head into float32
QWEN3_8B_DRAFT = [(4096, 20480), (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K", QWEN3_8B_DRAFT)
def test_gpu_draft_shapes(N, K):
    gen = torch.Generator().manual_seed(N + K)
    for M in (1, 16, 32, 300):
        check(int8_linear_triton, gen, M, N, K, torch.bfloat16, device="cuda", bias=M == 16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K", QWEN3_8B_DRAFT)
def test_gpu_draft_shapes_int8_rows(N, K):
    gen = torch.Generator().manual_seed(N + K + 1)
    for M in (1, 16, 32, 300):
        check_rows(int8_linear_triton, gen, M, N, K, torch.bfloat16, device="cuda", bias=M == 16)
    check_rows(int8_linear_triton, gen, 15, 151936 if N == 4096 and K == 4096 else N, K, torch.bfloat16,
               device="cuda", out_dtype=torch.float32)


@pytest.mark.gpu
@needs_cuda
def test_gpu_lm_head_into_float32():
    gen = torch.Generator().manual_seed(9)
    for M in (1, 15):
        check(int8_linear_triton, gen, M, 151936, 4096, torch.bfloat16, device="cuda", out_dtype=torch.float32)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replays_with_new_inputs():
    gen = torch.Generator().manual_seed(10)
    x, w, _ = case(gen, 16, 4096, 4096, torch.bfloat16, device="cuda")
    static_x = x.clone()
    int8_linear(static_x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int8_linear(static_x, w)
    static_x.copy_(torch.randn(16, 4096, generator=gen).to(device="cuda", dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(y, int8_linear(static_x.clone(), w))


if __name__ == "__main__":  # python -m correctness.test_kernel_int8_linear CHECK  (with TRITON_INTERPRET=1)
    run_checks_main(CHECKS)
