"""kernels.verify_rows: a verify pass's inputs from one kernel, equal to the PyTorch ops they replace bit for bit.

Fresh random cases with poisoned outputs: trees of 0 to 99 nodes with random ancestor masks and arbitrary masks,
tokens at the vocabulary's ends, the bonus token at the last slot, a start at the table's last position, widths
that are not powers of two (partial rotary tables, a hidden size spanning several chunks), an embedding with a
row stride, no embedding (tensor parallelism). On CPU under the Triton interpreter (a subprocess: `python -m
correctness.test_kernel_verify_rows CHECK`); on a GPU at the engine's shapes and inside a replayed CUDA graph; and
the engine's verify (Transformer.verify) against its forward over the same ids.
"""
from __future__ import annotations

import pytest
import torch

from correctness.kernel_harness import assert_interpreted_ok, programs_in_reverse, run_checks_main
from kernels.verify_rows import verify_rows, verify_rows_reference, verify_rows_triton

POISON = -777


def random_mask(gen: torch.Generator, T: int, tree: bool) -> torch.Tensor:
    """An ancestor-or-self mask of a random tree over [root, nodes], or any mask with its diagonal set."""
    if not tree:
        return (torch.rand(T, T, generator=gen) < 0.4) | torch.eye(T, dtype=torch.bool)
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_case(gen: torch.Generator, n: int, vocab: int, hidden: int | None, rot: int, positions: int, dtype,
              device, tree: bool = True, strided: bool = False):
    """(args, where the bonus sits) of one call: start near the table's end where it can be."""
    T = n + 1
    C = positions + 8
    start = int(torch.randint(0, positions - n, (1,), generator=gen)) if positions > n else 0
    if float(torch.rand(1, generator=gen)) < 0.5:
        start = positions - 1 - n  # the last node at the table's last position
    tokens = torch.randint(0, vocab, (C,), generator=gen)
    tokens[start] = vocab - 1
    tree_tokens = torch.randint(0, vocab, (n,), generator=gen)
    if n:
        tree_tokens[0] = 0
    depths = torch.randint(1, max(2, n + 1), (n,), generator=gen)
    if n:
        depths[-1] = n  # the deepest position: start + n <= positions - 1
    mask = random_mask(gen, T, tree)
    embed = None
    if hidden is not None:
        full = torch.randn(vocab, hidden + (24 if strided else 0), generator=gen).to(dtype)
        embed = full[:, :hidden]
    table = torch.randn(2, positions, rot, generator=gen).to(dtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return tuple(to(t) for t in (tokens, torch.tensor(start), tree_tokens, depths, mask, embed, table))


def poisoned_out(T: int, hidden: int | None, rot: int, dtype, device) -> tuple:
    def full(shape, dt, value):
        return torch.full(shape, value, dtype=dt, device=device)
    return (full((T,), torch.long, POISON), None if hidden is None else full((1, T, hidden), dtype, float("nan")),
            full((1, T, rot), dtype, float("nan")), full((1, T, rot), dtype, float("nan")),
            full((T,), torch.long, POISON), full((T, T), torch.int32, POISON))


def check_case(args, context: str) -> None:
    tokens, start, tree_tokens, depths, mask, embed, table = args
    T, rot = tree_tokens.shape[0] + 1, table.shape[2]
    out = poisoned_out(T, None if embed is None else embed.shape[1], rot, table.dtype, tokens.device)
    got = verify_rows_triton(*args, out=out)
    want = verify_rows_reference(*(None if a is None else a.cpu() for a in args))
    names = ("ids", "x", "cos", "sin", "slots", "visible")
    for name, g, o, w in zip(names, got, out, want):
        if w is None:
            assert g is None and o is None, f"{context}: {name} should be None"
            continue
        assert g is o, f"{context}: {name} not written into out"
        assert g.dtype == w.dtype and g.shape == w.shape, f"{context}: {name} {g.dtype} {tuple(g.shape)}"
        assert torch.equal(g.cpu(), w), f"{context}: {name}\n got  {g.cpu().flatten()[:12].tolist()}\n want " \
                                        f"{w.flatten()[:12].tolist()}"


SHAPES = [  # (nodes, vocab, hidden, rotary dims, positions)
    (0, 50, 576, 64, 256),      # AR at SmolLM2's shape
    (15, 1000, 576, 64, 512),   # DDTree-15
    (16, 777, 40, 24, 256),     # a partial rotary table, odd widths
    (64, 300, 2500, 128, 512),  # DDTree-64; a hidden size of three chunks
    (99, 64, 96, 80, 256),      # more nodes than a power of two
    (3, 10, None, 32, 256),     # no embedding (tensor parallelism)
]


def random_cases(gen: torch.Generator, device, dtypes=(torch.float32, torch.bfloat16)) -> int:
    n = 0
    for nodes, vocab, hidden, rot, positions in SHAPES:
        for dtype in dtypes:
            for tree in (True, False):
                args = make_case(gen, nodes, vocab, hidden, rot, positions, dtype, device, tree, strided=n % 2 == 1)
                check_case(args, f"nodes={nodes} hidden={hidden} rot={rot} {dtype} tree={tree}")
                n += 1
    return n


def reversed_cases(gen: torch.Generator) -> int:
    with programs_in_reverse():  # row 0 runs last: a program writing another row's list or slot would show
        return random_cases(gen, "cpu", dtypes=(torch.float16,))


def _interpreted_checks():
    gen = torch.Generator().manual_seed(41)
    return {"random": lambda: f"{random_cases(gen, 'cpu')} cases",
            "reversed": lambda: f"{reversed_cases(gen)} cases with the programs in reverse"}


@pytest.mark.cpu
@pytest.mark.parametrize("check", ["random", "reversed"])
def test_triton_verify_rows_under_interpreter(check):
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_verify_rows", check)


@pytest.mark.cpu
def test_reference_and_errors_on_cpu():
    gen = torch.Generator().manual_seed(3)
    tokens, start, tree_tokens, depths, mask, embed, table = make_case(gen, 4, 20, 8, 4, 32, torch.float32, "cpu")
    ids, x, cos, sin, slots, visible = verify_rows(tokens, start, tree_tokens, depths, mask, embed, table)
    s = int(start)
    assert ids.tolist() == [int(tokens[s])] + tree_tokens.tolist()
    assert torch.equal(x[0], embed[ids]) and torch.equal(slots, torch.arange(s, s + 5))
    positions = [s] + [s + int(d) for d in depths]
    assert torch.equal(cos[0], table[0, positions]) and torch.equal(sin[0], table[1, positions])
    for t in range(5):  # the rows row t sees, in order, then 5
        seen = mask[t].nonzero().flatten().tolist()
        assert visible[t].tolist() == seen + [5] * (5 - len(seen))
    with pytest.raises(ValueError, match="node_mask must be bool"):
        verify_rows(tokens, start, tree_tokens, depths, mask[:4, :4], embed, table)
    with pytest.raises(ValueError, match="int64"):
        verify_rows(tokens.int(), start, tree_tokens, depths, mask, embed, table)
    with pytest.raises(ValueError, match="start must hold one value"):
        verify_rows(tokens, tokens[:2], tree_tokens, depths, mask, embed, table)
    with pytest.raises(ValueError, match="rope_table"):
        verify_rows(tokens, start, tree_tokens, depths, mask, embed, table[0])
    with pytest.raises(ValueError, match="embed_weight"):
        verify_rows(tokens, start, tree_tokens, depths, mask, embed.half(), table)
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="out must be"):
        verify_rows_triton(tokens, start, tree_tokens, depths, mask, embed, table,
                           out=poisoned_out(5, 8, 4, torch.float16, "cpu"))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_verify_rows_matches_reference():
    gen = torch.Generator().manual_seed(43)
    random_cases(gen, "cuda", dtypes=(torch.float32, torch.bfloat16, torch.float16))
    for nodes, hidden, rot in ((0, 4096, 128), (15, 4096, 128), (64, 5120, 64), (15, 576, 64)):  # 8B, 27B, 135M
        check_case(make_case(gen, nodes, 151936, hidden, rot, 4096, torch.bfloat16, "cuda"), f"real {nodes} {hidden}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replays_with_new_inputs():
    """Captured once, replayed after the tokens, start, tree and mask change in place (as a decode round's do)."""
    gen = torch.Generator().manual_seed(47)
    args = make_case(gen, 15, 1000, 576, 64, 512, torch.bfloat16, "cuda")
    tokens, start, tree_tokens, depths, mask, embed, table = args
    verify_rows(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = verify_rows(*args)
    for step in range(4):
        fresh = make_case(gen, 15, 1000, 576, 64, 512, torch.bfloat16, "cuda", tree=step % 2 == 0)
        for dst, src in zip((tokens, start, tree_tokens, depths, mask), fresh[:5]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = verify_rows_reference(*(a.cpu() for a in args))
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w), f"replay {step}"


@pytest.mark.cpu
@pytest.mark.parametrize("name,tree", [("llama-tied-mha-rope3", True), ("qwen3-gqa-untied-sharded", True),
                                       ("synthetic:hybrid-tiny", False)])
def test_model_verify_equals_forward_over_the_same_ids(tiny_checkpoints, name, tree):
    """Transformer.verify (its inputs from verify_rows) against forward over [tokens[start], nodes...] at start +
    depths, on small random models (a tree; a chain for the hybrid): the same ids, hidden states and cache rows."""
    from engine.loading import load_target
    spec = name if name.startswith("synthetic:") else str(tiny_checkpoints[name][0])
    target = load_target(spec, "cpu", torch.float32).model
    gen = torch.Generator().manual_seed(5)
    n, capacity, start = 6, 64, 9
    mask = random_mask(gen, n + 1, tree) if tree else torch.ones(n + 1, n + 1, dtype=torch.bool).tril()
    depths = mask[1:].sum(-1) - 1  # a node's depth: its ancestors, the root included
    vocab = target.cfg.vocab_size
    tree_tokens = torch.randint(0, vocab, (n,), generator=gen)
    tokens = torch.randint(0, vocab, (capacity,), generator=gen)
    results = []
    for fused in (True, False):
        cache = target.new_cache(capacity)
        cache.start.fill_(start)
        if fused:
            ids, hidden, _ = target.verify(tokens, tree_tokens, depths, mask, cache)
        else:
            ids = torch.cat((tokens[start:start + 1], tree_tokens))
            positions = start + torch.cat((torch.zeros(1, dtype=torch.long), depths))
            hidden, _ = target(ids[None], positions[None], cache, mask)
        layer = next(c for c in cache.layers if hasattr(c, "k"))
        results.append((ids, hidden, layer.k[..., start:start + n + 1, :].clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


if __name__ == "__main__":
    run_checks_main(_interpreted_checks())
