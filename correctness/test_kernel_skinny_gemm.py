"""kernels.skinny_gemm: the Triton skinny GEMM against its reference, and batch invariance: every row of an M-row
call equals, bit for bit, the same row computed alone (M = 1), for M up to 128, with and without K splits.

CPU: the kernel runs under the Triton interpreter in a subprocess (`python -m correctness.test_kernel_skinny_gemm
CHECK`), on shapes whose N and K are not multiples of the blocks, against the reference only: the interpreter's
tl.dot is numpy's matmul, whose sum for a row depends on the row's position in the tile, so batch invariance is a
GPU check. GPU: the 8B model's projection shapes in bfloat16, the reference and batch invariance, and a CUDA-graph
replay with new inputs.

Tolerances: float32 (interpreter) atol = rtol = 1e-4 (the same products, summed in another order); bfloat16 one
rounding of a float32 sum that differs from the reference's in the last bits: |got - want| <= 2^-7 |want| + 1e-2
elementwise (two bf16 ulps), at most 2% of the elements differing. Batch invariance is exact.
"""
from __future__ import annotations

import sys

import pytest
import torch

from correctness.kernel_harness import assert_close_ulps, assert_interpreted_ok
from kernels.skinny_gemm import MAX_ROWS, skinny_linear, skinny_linear_reference, skinny_linear_triton, split_k

MODULE = "correctness.test_kernel_skinny_gemm"


def assert_close(got, want, context):
    assert_close_ulps(got, want, context, fp32_tol=1e-4, atol=1e-2, rtol=2 ** -7, max_differing=0.02)


def check_shapes(device: str, dtype, shapes, row_counts, parts_choices, invariant: bool) -> list[str]:
    """Kernel vs reference on fresh inputs, and (invariant) each row of every call equal to that row alone, bit for
    bit."""
    gen = torch.Generator().manual_seed(0)
    done = []
    for N, K, with_bias in shapes:
        w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device=device, dtype=dtype)
        b = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if with_bias else None
        x_all = torch.randn(max(row_counts), K, generator=gen).to(device=device, dtype=dtype)
        for parts in parts_choices:
            alone = torch.cat([skinny_linear_triton(x_all[i:i + 1], w, b, parts=parts) for i in range(len(x_all))])
            for M in row_counts:
                got = torch.full((M, N), float("nan"), dtype=dtype, device=device)  # poisoned: all must be written
                skinny_linear_triton(x_all[:M], w, b, parts=parts, out=got)
                context = f"N={N} K={K} bias={with_bias} parts={parts} M={M}"
                assert_close(got, skinny_linear_reference(x_all[:M], w, b), context)
                assert not invariant or torch.equal(got, alone[:M]), \
                    f"{context}: a row differs from the same row computed alone"
            done.append(f"N={N} K={K} parts={parts}")
    return done


def check_float32_out_and_leading_dims(device: str, dtype) -> list[str]:
    """Logits-style use: bf16 inputs, float32 output; x with leading dims [B, T, K]."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 96, generator=gen).to(device=device, dtype=dtype)
    x = torch.randn(2, 3, 96, generator=gen).to(device=device, dtype=dtype)
    got = skinny_linear_triton(x, w, out_dtype=torch.float32)
    want = skinny_linear_reference(x, w, out_dtype=torch.float32)
    assert got.shape == (2, 3, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-3, rtol=1e-3)
    return ["float32 out, [2, 3, K] input"]


CHECKS = {
    "shapes": lambda: check_shapes("cpu", torch.float32, [(100, 300, True), (64, 256, False), (33, 70, False)],
                                   [1, 5, 16, 17, 40], [1, 3], invariant=False),
    "out_dtype": lambda: check_float32_out_and_leading_dims("cpu", torch.float32),
}


@pytest.mark.cpu
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_interpreted(check):
    assert_interpreted_ok(MODULE, check)


@pytest.mark.cpu
def test_reference_is_linear():
    gen = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(7, 32, generator=gen), torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    torch.testing.assert_close(skinny_linear_reference(x, w, b), torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(skinny_linear(x, w, b), torch.nn.functional.linear(x, w, b))  # CPU: F.linear


@pytest.mark.cpu
def test_split_k_depends_on_the_weight_and_the_gpu_only():
    # 8B shapes on 132 SMs: wide weights are not split, narrow ones are, every part at least 4 K blocks
    assert split_k(24576, 4096, 132) == 1 and split_k(151936, 4096, 132) == 1
    assert split_k(4096, 4096, 132) == 5 and split_k(4096, 12288, 132) == 5 and split_k(6144, 4096, 132) == 3
    assert split_k(64, 128, 132) == 1  # too short to split


def verify_and_decode(model, prompt: list[int], chain: list[int]):
    """The hidden states and logits of `chain` after `prompt`: verified in one forward pass (causal over the chain),
    and decoded one token per forward pass; each [len(chain), ...]."""
    dev, n, T = model.device, len(prompt), len(chain)
    out = []
    for rows in (T, 1):
        cache = model.new_cache(n + T + 1)
        ids = torch.tensor(prompt, device=dev)[None]
        model(ids, torch.arange(n, device=dev)[None], cache, torch.ones(n, n, dtype=torch.bool, device=dev).tril())
        cache.keep_prefix(n)
        cache.start.fill_(n)
        hidden = []
        for first in range(0, T, rows):
            step = torch.tensor(chain[first:first + rows], device=dev)[None]
            h, _ = model(step, (n + first + torch.arange(rows, device=dev))[None], cache,
                         torch.ones(rows, rows, dtype=torch.bool, device=dev).tril())
            cache.keep_prefix(rows)  # a chain: attention rows stay where written, a recurrence keeps its last state
            cache.start.add_(rows)
            hidden.append(h[0])
        hidden = torch.cat(hidden)
        out.append((hidden, model.logits(hidden)))
    return out


@pytest.mark.cpu
def test_the_switch_changes_nothing_on_a_cpu(monkeypatch):
    """ENGINE_SKINNY_GEMM=1 on a CPU: the model's linears stay F.linear, the same numbers."""
    import engine

    model = engine.load_target("synthetic:hybrid-tiny", "cpu", torch.float32).model
    prompt, chain = list(range(3, 12)), [40, 41, 42, 43]
    off = verify_and_decode(model, prompt, chain)
    monkeypatch.setenv("ENGINE_SKINNY_GEMM", "1")
    on = verify_and_decode(model, prompt, chain)
    for (h0, l0), (h1, l1) in zip(off, on):
        assert torch.equal(h0, h1) and torch.equal(l0, l1)
    torch.testing.assert_close(off[0][0], off[1][0], atol=1e-4, rtol=1e-4)  # verified rows are the decoded ones


# ------------------------------------------------------------------------------------------------------------ GPU

QWEN3_8B = [(6144, 4096, False), (4096, 4096, False), (24576, 4096, False), (4096, 12288, False), (2048, 1024, True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_projection_shapes_batch_invariant():
    check_shapes("cuda", torch.bfloat16, QWEN3_8B, [1, 2, 16, 17, 64, 65, MAX_ROWS], [None, 1], invariant=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_float32_out_and_graph_replay():
    check_float32_out_and_leading_dims("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 4096, generator=gen).to("cuda", torch.bfloat16)
    x = torch.randn(16, 4096, generator=gen).to("cuda", torch.bfloat16)
    out = skinny_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w)
    x.copy_(torch.randn(16, 4096, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    assert torch.equal(out, skinny_linear_triton(x, w))



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [16, 65, MAX_ROWS])
def test_gpu_with_the_switch_a_verified_row_equals_its_decode_step_bit_for_bit(monkeypatch, rows):
    """ENGINE_SKINNY_GEMM=1 on synthetic:qwen3-0.6b (bfloat16): every row of a verify of `rows` tokens has the
    hidden state and logits of the same token decoded alone, bit for bit (what makes verify lossless without
    near-ties)."""
    import engine

    monkeypatch.setenv("ENGINE_SKINNY_GEMM", "1")
    model = engine.load_target("synthetic:qwen3-0.6b", "cuda", torch.bfloat16).model
    gen = torch.Generator().manual_seed(4)
    prompt, chain = (torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (37, rows))
    (hv, lv), (hd, ld) = verify_and_decode(model, prompt, chain)
    assert torch.equal(hv, hd), f"hidden: rows {(hv != hd).any(-1).nonzero().flatten()[:8].tolist()} differ"
    assert torch.equal(lv, ld)


if __name__ == "__main__":
    names = CHECKS[sys.argv[1]]()
    print("\n".join(names))
    print("OK")
