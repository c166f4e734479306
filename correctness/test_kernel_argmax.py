"""kernels.argmax: the one-launch Triton argmax against torch.argmax, on fresh random logits with poisoned outputs.

Exact equality: the first index of the largest value, a NaN larger than everything (the first NaN wins), +inf,
rows of -inf (index 0), -0.0 equal to +0.0, ties planted inside a chunk and across chunk boundaries. On CPU under
the Triton interpreter (a subprocess: `python -m correctness.test_kernel_argmax CHECK`), with the programs also
run in reverse order (so that another program arrives last and merges the row); on a GPU at real vocabularies,
through the dispatcher's shapes, and captured in a CUDA graph and replayed with new logits.
"""
from __future__ import annotations

import pytest
import torch

from correctness.kernel_harness import assert_interpreted_ok, hard_logit_cases, programs_in_reverse, run_checks_main
from kernels.argmax import argmax, argmax_reference, argmax_triton

POISON = -777
VOCABS = (7, 1000, 4097, 49152, 151936)  # 4097: a last chunk of one logit
NAN, INF = float("nan"), float("inf")


def check_case(x: torch.Tensor, chunk=None, context="") -> None:
    want = x.cpu().argmax(-1)
    out = torch.full((x.shape[0],), POISON, dtype=torch.long, device=x.device)
    got = argmax_triton(x, out=out, chunk=chunk)
    ctx = f"{context} shape={tuple(x.shape)} {x.dtype} chunk={chunk}"
    assert got is out and got.dtype == torch.long, ctx
    assert torch.equal(got.cpu(), want), f"{ctx}:\n got  {got.tolist()}\n want {want.tolist()}"
    if x.device.type == "cpu":  # every counter the call used is back at 0 for the next call
        from kernels import _COUNTERS
        counters = _COUNTERS.get(torch.device("cpu"))
        assert counters is None or not counters[:x.shape[0]].any(), f"{ctx}: counters left {counters[:4].tolist()}"


def planted(gen: torch.Generator, rows: int, vocab: int, dtype, chunk: int) -> list[tuple[str, torch.Tensor]]:
    """Rows whose answer a kernel can get wrong: equal maxima within a chunk and in different chunks (at chunk
    boundaries), NaN (first one wins, also when it sits in a later chunk than a +inf), +inf, all -inf, -0.0."""
    base = lambda: torch.randn(rows, vocab, generator=gen).to(dtype)  # noqa: E731
    pick = lambda n: sorted(torch.randperm(vocab, generator=gen)[:n].tolist())  # noqa: E731
    cases = []
    ties = base()
    for r in range(rows):  # the same max at 2-4 places: some rows across chunks, some within one
        spots = pick(min(vocab, 2 + r % 3)) if r % 2 else [i for i in (chunk - 1, chunk, 2 * chunk - 1) if i < vocab]
        ties[r, spots or [0]] = 10.0
    cases.append(("planted ties", ties))
    edge = base()  # the max at the last index of a chunk, tied with the first index of the next
    for r in range(rows):
        c = (r % max(1, vocab // chunk)) * chunk
        edge[r, [i for i in (c + chunk - 1, c + chunk) if i < vocab] or [vocab - 1]] = 7.0
    cases.append(("chunk-edge ties", edge))
    nan = base()
    for r in range(rows):
        spots = pick(min(vocab, 1 + r % 3))
        nan[r, spots] = NAN
        if r % 2 and spots[0] > 0:
            nan[r, spots[0] - 1] = INF  # +inf just before the first NaN: the NaN still wins
        if r % 3 == 2:
            nan[r, spots[0]] = -NAN  # a negative NaN is a NaN too
    cases.append(("NaN", nan))
    inf = base()
    for r in range(rows):
        inf[r, pick(min(vocab, 1 + r % 2))] = INF
    inf[0, -1] = -INF
    cases.append(("+inf", inf))
    cases.append(("all -inf", torch.full((rows, vocab), -INF, dtype=dtype)))
    zeros = -torch.rand(rows, vocab, generator=gen).to(dtype) - 1
    zeros[:, pick(min(vocab, 3))] = -0.0
    zeros[:, -1] = 0.0  # +0.0 after -0.0: equal, the first -0.0 wins
    cases.append(("-0.0 and +0.0", zeros))
    return cases


def random_cases(gen: torch.Generator, device, vocabs=VOCABS, rows=(1, 3)) -> int:
    n = 0
    for vocab in vocabs:
        for R in rows:
            for dtype in (torch.float32, torch.bfloat16):  # bf16 rounding makes ties too
                check_case((torch.randn(R, vocab, generator=gen) * 4).to(dtype).to(device), None, "random")
                n += 1
    return n


def hard_cases(gen: torch.Generator, device, vocabs=VOCABS, rows=3) -> int:
    from kernels.argmax import _chunk_size
    n = 0
    for vocab in vocabs:
        for dtype in (torch.float32, torch.bfloat16):
            for chunk in sorted({None, 64} if vocab < 5000 else {None}, key=str):  # small V: a merge too
                size = chunk or _chunk_size(vocab)
                for name, x in planted(gen, rows, vocab, dtype, size):
                    check_case(x.to(device), chunk, name)
                    n += 1
        for name, x, _ in hard_logit_cases(gen, rows, vocab if vocab < 5000 else 4097):  # ties, -inf tail, stride
            check_case(x.to(device), 256, name)
            n += 1
    return n


def reversed_cases(gen: torch.Generator) -> int:
    with programs_in_reverse():  # chunk 0 arrives last and merges
        return random_cases(gen, "cpu", vocabs=(1000, 4097, 49152), rows=(2,)) + \
            hard_cases(gen, "cpu", vocabs=(1000, 4097), rows=2)


def strided_out_case(gen: torch.Generator) -> str:
    x = torch.randn(4, 9000, generator=gen)[:, 100:8900]  # row stride 9000, not V
    buf = torch.full((8,), POISON, dtype=torch.long)
    argmax_triton(x, out=buf[::2])
    assert torch.equal(buf[::2], x.argmax(-1)) and (buf[1::2] == POISON).all(), buf.tolist()
    x16 = (torch.randn(3, 5000, generator=gen) * 3).half()
    assert torch.equal(argmax_triton(x16), x16.argmax(-1))
    return "strided rows and out, float16"


def _interpreted_checks():
    gen = torch.Generator().manual_seed(17)
    return {"random": lambda: f"{random_cases(gen, 'cpu')} random cases",
            "hard": lambda: f"{hard_cases(gen, 'cpu')} tie / NaN / inf / -0.0 cases",
            "reversed": lambda: f"{reversed_cases(gen)} cases with the programs in reverse",
            "strided": lambda: strided_out_case(gen)}


@pytest.mark.cpu
@pytest.mark.parametrize("check", ["random", "hard", "reversed", "strided"])
def test_triton_argmax_under_interpreter(check):
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_argmax", check)


@pytest.mark.cpu
def test_reference_and_dispatch_on_cpu(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 50, generator=gen)
    x[0, 1, [4, 9]] = 9.0
    x[1, 2, [7, 3]] = NAN
    assert torch.equal(argmax(x), x.argmax(-1)) and argmax(x).shape == (2, 3)
    assert argmax(x[0, 0]).shape == () and int(argmax(x[0, 0])) == int(x[0, 0].argmax())
    assert argmax(x[0, 1]).item() == 4 and argmax(x[1, 2]).item() == 3
    assert torch.equal(argmax_reference(x[0]), x[0].argmax(-1))
    assert argmax_reference(torch.full((1, 5), -INF)).item() == 0
    with pytest.raises(ValueError, match="expected float logits"):
        argmax_reference(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="empty vocabulary"):
        argmax_reference(torch.zeros(3, 0))
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="unsupported dtype"):
        argmax_triton(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        argmax_triton(torch.zeros(2, 5), out=torch.zeros(3, dtype=torch.long))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_argmax_matches_torch():
    gen = torch.Generator().manual_seed(23)
    random_cases(gen, "cuda")
    hard_cases(gen, "cuda")
    for vocab in (49152, 151936, 128256, 32000):
        for R in (1, 16, 65):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = (torch.randn(R, vocab, generator=gen) * 4).to(dtype).cuda()
                check_case(x, None, "real shape")
                for name, y in planted(gen, R, vocab, dtype, 4096):
                    y = y.cuda()
                    assert torch.equal(argmax_triton(y), y.argmax(-1)), f"{name} {vocab} {R} {dtype}"
    for shape in ((49152,), (3, 5, 49152), (2, 1, 7)):  # the dispatcher's leading dims, as torch shapes them
        x = torch.randn(*shape, generator=gen).cuda()
        got = argmax(x)
        assert got.shape == x.argmax(-1).shape and torch.equal(got, x.argmax(-1)), shape


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replays_with_new_logits():
    """Captured twice in one graph (the counters must be back at 0 between calls), replayed with new logits."""
    gen = torch.Generator().manual_seed(29)
    static = torch.randn(16, 49152, generator=gen).cuda()
    small = torch.randn(1, 151936, generator=gen).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile and allocate the counters outside the capture
        argmax(static), argmax(small)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = argmax(static)
        b = argmax(small)
        c = argmax(static[:, :40000])
    for step in range(5):
        static.copy_(torch.randn(16, 49152, generator=gen))
        small.copy_(torch.randn(1, 151936, generator=gen))
        if step % 2:
            static[:, [5, 4096, 40001]] = 50.0  # a planted tie across chunks (and past the sliced view)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(a, static.argmax(-1)), f"replay {step}"
        assert torch.equal(b, small.argmax(-1)), f"replay {step}"
        assert torch.equal(c, static[:, :40000].argmax(-1)), f"replay {step}"


if __name__ == "__main__":
    run_checks_main(_interpreted_checks())
