"""kernels.tree_ops: the Triton build_tree / walk_tree / compact_kv / commit_tokens against their references, the
references' own invariants, and three of the kernels captured together in a CUDA graph (correctness/test_tree.py
checks the references against brute force).

CPU: the references are checked directly; the Triton kernels run under the Triton interpreter in a subprocess
(TRITON_INTERPRET=1 must be set before triton is imported), one subprocess per kernel: `python -m
correctness.test_kernel_tree_ops CHECK` runs one of CHECKS and prints what it compared. GPU: the kernels at real
shapes, a CUDA-graph round, timings (print with -s).

Every kernel output is poisoned first (integers POISON, the bool mask's bytes 0xAB) so that an element the kernel
forgot to write shows up; integer and bool outputs are compared exactly (the float32 score arithmetic of the
kernel and of the reference is the same, operation for operation).
"""
from __future__ import annotations

import random

import pytest
import torch

from kernels import tree_ops

from correctness.kernel_harness import assert_interpreted_ok, run_checks_main
from kernels.tree_ops import (build_tree_reference, build_tree_triton, commit_tokens_reference, commit_tokens_triton,
                              compact_kv_reference, compact_kv_triton, walk_tree_reference, walk_tree_triton)

POISON = -777
MASK_POISON = 0xAB

DPS, KS, BUDGETS = (1, 3, 15), (1, 2, 8), (1, 2, 15, 32, 64)


# ---------------------------------------------------------------------------------------------------- helpers

def topk_inputs(gen: torch.Generator, depths: int, k: int, vocab: int, device="cpu", logits=None):
    """Random draft logits (continuous: no ties) -> (logits, topk_logp, topk_ids), as the decode loop feeds them."""
    if logits is None:
        logits = torch.randn(depths, vocab, generator=gen) * 2.0
    logits = logits.to(device)
    logp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return logits, logp, ids


def tied_logits(gen: torch.Generator, depths: int, vocab: int) -> torch.Tensor:
    """Logits with many exact ties: few distinct values, and every depth the same row."""
    row = torch.randint(0, 3, (vocab,), generator=gen).float()
    return row.expand(depths, vocab).clone()


# a float32 tie that float64 arithmetic would break (see test_build_reference_out_and_float32_scores)
F32_TIE = (torch.tensor([[-0.2, -0.6], [-0.2, -0.4]]), torch.tensor([[1, 2], [3, 4]]))


def build_out(budget: int, device="cpu"):
    """Poisoned output tensors for build_tree."""
    out = (torch.full((budget,), POISON, dtype=torch.long, device=device),
           torch.full((budget,), POISON, dtype=torch.long, device=device),
           torch.full((budget,), POISON, dtype=torch.long, device=device),
           torch.empty(budget + 1, budget + 1, dtype=torch.bool, device=device),
           torch.full((), POISON, dtype=torch.long, device=device))
    out[3].view(torch.uint8).fill_(MASK_POISON)
    return out


def walk_out(max_depth: int, device="cpu"):
    return (torch.full((max_depth + 1,), POISON, dtype=torch.long, device=device),
            torch.full((), POISON, dtype=torch.long, device=device),
            torch.full((), POISON, dtype=torch.long, device=device))


def assert_same(names, got, want, context: str) -> None:
    for name, g, w in zip(names, got, want):
        if g.dtype == torch.bool:
            raw = g.view(torch.uint8).cpu()
            assert bool(((raw == 0) | (raw == 1)).all()), f"{context}: {name} has unwritten or non-bool bytes"
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{context}: {name} {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        if not torch.equal(g.cpu(), w.cpu()):
            bad = (g.cpu() != w.cpu()).nonzero()[:8].tolist()
            raise AssertionError(f"{context}: {name} differs at {bad}\n got  {g.cpu().tolist()}\n"
                                 f" want {w.cpu().tolist()}")


BUILD_NAMES = ("tokens", "parents", "depths", "visible", "count")
WALK_NAMES = ("path", "accepted", "bonus")


def check_build_kernel(fn, logp, ids, budget, context, **kw) -> tuple:
    want = build_tree_reference(logp, ids, budget)
    out = build_out(budget, logp.device)
    got = fn(logp, ids, budget, out=out, **kw)
    assert all(g is o for g, o in zip(got, out)), f"{context}: outputs not written into out="
    assert_same(BUILD_NAMES, got, want, context)
    return want


def check_tree_invariants(tree, budget: int, depths: int, k: int, context: str) -> None:
    """Structure of a reference tree: numbering, padding, the mask = ancestor-or-self computed from parents."""
    tokens, parents, dep, visible, count = (t.cpu() for t in tree)
    n = int(count)
    assert 1 <= n <= budget and n <= sum(k ** d for d in range(1, depths + 1)), context
    assert n == min(budget, sum(k ** d for d in range(1, depths + 1))), f"{context}: count {n}"
    for i in range(n):
        p = int(parents[i])
        assert 0 <= p <= i, f"{context}: node {i + 1} parent {p}"
        assert int(dep[i]) == (0 if p == 0 else int(dep[p - 1])) + 1, f"{context}: node {i + 1} depth"
    assert tokens[n:].eq(0).all() and parents[n:].eq(-1).all() and dep[n:].eq(0).all(), f"{context}: padding"
    want = torch.eye(budget + 1, dtype=torch.bool)
    for i in range(1, n + 1):
        j = i
        while j != 0:
            j = int(parents[j - 1])
            want[i, j] = True
    assert torch.equal(visible, want), f"{context}: visible"


def posterior_for_path(gen: random.Random, tree, vocab: int, end: int) -> torch.Tensor:
    """A posterior [N+1] whose walk accepts exactly root..end: random tokens elsewhere (side branches may match
    off the path, which the walk never visits)."""
    tokens, parents, _, _, count = (t.cpu() for t in tree)
    n, N = int(count), tokens.shape[0]
    post = [gen.randrange(vocab) for _ in range(N + 1)]
    chain = [end]
    while chain[-1] != 0:
        chain.append(int(parents[chain[-1] - 1]))
    chain.reverse()
    for a, b in zip(chain, chain[1:]):
        post[a] = int(tokens[b - 1])
    children = {int(tokens[c - 1]) for c in range(1, n + 1) if int(parents[c - 1]) == end}
    while post[end] in children:
        post[end] = gen.randrange(vocab)
    return torch.tensor(post, dtype=torch.long)


def expected_path(tree, end: int) -> list[int]:
    parents = tree[1].cpu()
    chain = [end]
    while chain[-1] != 0:
        chain.append(int(parents[chain[-1] - 1]))
    return chain[::-1]


def random_path(gen: random.Random, nodes: int, length: int, accepted: int, garbage: bool) -> torch.Tensor:
    """A walk-like path [length]: 0, then accepted-1 strictly increasing node numbers <= nodes, then padding."""
    rest = sorted(gen.sample(range(1, nodes + 1), accepted - 1))
    pad = [gen.randrange(nodes + 1) for _ in range(length - accepted)] if garbage else [0] * (length - accepted)
    return torch.tensor([0] + rest + pad, dtype=torch.long)


def compact_case(gen: random.Random, L, B, H, CAP, Dh, P, nodes, dtype, device="cpu", garbage=False):
    tgen = torch.Generator(device=device).manual_seed(gen.randrange(1 << 30))
    k = torch.randn(L, B, H, CAP, Dh, generator=tgen, device=device).to(dtype)
    v = torch.randn(L, B, H, CAP, Dh, generator=tgen, device=device).to(dtype)
    accepted = gen.randint(1, P)
    path = random_path(gen, nodes, P, accepted, garbage)
    start = gen.randrange(0, CAP - nodes)
    return (k, v, torch.tensor(start, device=device), path.to(device), torch.tensor(accepted, device=device))


def sequential_compact(k, v, start: int, path: list[int], accepted: int) -> None:
    """The definition: for i in order, row start+i <- row start+path[i]."""
    for i in range(accepted):
        for t in (k, v):
            t[:, :, :, start + i] = t[:, :, :, start + path[i]]


def check_walk_cases(build_fn, walk_fn, device, shapes, seed: int, vocab_range=(50, 1000)) -> int:
    """Random trees, posteriors following random root-to-node paths and random ones; returns cases run."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = 0
    for depths, k, budget in shapes:
        vocab = rng.randrange(*vocab_range)
        _, logp, ids = topk_inputs(gen, depths, k, vocab, device)
        tree = build_fn(logp, ids, budget)
        n = int(tree[4])
        ends = [0, n] + [rng.randrange(n + 1) for _ in range(4)]
        posts = [posterior_for_path(rng, tree, vocab, e) for e in ends]
        small = tree[0][:n].cpu().tolist() + [0]
        posts += [torch.tensor([rng.choice(small) for _ in range(budget + 1)]) for _ in range(3)]
        for j, post in enumerate(posts):
            post = post.to(device)
            ctx = f"walk depths={depths} k={k} budget={budget} case {j}"
            want = walk_tree_reference(post, tree[0], tree[1], tree[4], depths)
            if j < len(ends):
                assert want[0].tolist()[:int(want[1])] == expected_path(tree, ends[j]), ctx
            got = walk_fn(post, tree[0], tree[1], tree[4], depths, out=walk_out(depths, device))
            assert_same(WALK_NAMES, got, want, ctx)
            cases += 1
    # no nodes (AR), chains (DFlash), a padded chain whose padding would match, a truncated walk
    for N, count, max_depth in ((0, 0, 0), (0, 0, 3), (1, 1, 1), (15, 15, 15), (15, 5, 15), (15, 15, 6), (7, 0, 7)):
        tokens = torch.tensor([rng.randrange(100) for _ in range(N)], dtype=torch.long, device=device)
        parents = torch.arange(N, dtype=torch.long, device=device)
        for stop in range(0, N + 1, max(1, N // 3)):
            post = torch.tensor([rng.randrange(100, 200) for _ in range(N + 1)], dtype=torch.long)
            post[:stop] = tokens[:stop].cpu()
            post = post.to(device)
            count_t = torch.tensor(count, device=device)
            ctx = f"chain N={N} count={count} max_depth={max_depth} stop={stop}"
            want = walk_tree_reference(post, tokens, parents, count_t, max_depth)
            acc = min(stop, count, max_depth) + 1
            assert int(want[1]) == acc and want[0].tolist() == list(range(acc)) + [0] * (max_depth + 1 - acc), ctx
            assert int(want[2]) == int(post[acc - 1]), ctx
            got = walk_fn(post, tokens, parents, count_t, max_depth, out=walk_out(max_depth, device))
            assert_same(WALK_NAMES, got, want, ctx)
            cases += 1
    return cases


def commit_case(rng: random.Random, P: int, nodes: int, accepted: int, with_features: bool, device="cpu"):
    """Inputs of commit_tokens after a walk that accepted `accepted` rows of a path of P (root first, distinct node
    indices, padded with 0), every output poisoned; and what the module docstring says they become."""
    ids = torch.tensor([rng.randrange(0, 150000) for _ in range(nodes + 1)])
    chosen = sorted(rng.sample(range(1, nodes + 1), accepted - 1)) if nodes else []
    path = torch.tensor([0] + chosen + [0] * (P - accepted))
    bonus, start, C = rng.randrange(0, 150000), rng.randrange(0, 300), 300 + P + 1
    new = [int(ids[n]) for n in chosen] + [bonus] + [0] * (P - accepted)
    want_tokens = torch.full((C,), POISON)
    want_tokens[start + 1:start + 1 + P] = torch.tensor(new)
    want = dict(tokens=want_tokens, round_out=torch.tensor([accepted] + new), start=torch.tensor(start + accepted),
                n_features=torch.tensor(accepted) if with_features else None)
    args = dict(path=path, accepted=torch.tensor(accepted), bonus=torch.tensor(bonus), ids=ids,
                start=torch.tensor(start), tokens=torch.full((C,), POISON), round_out=torch.full((1 + P,), POISON),
                n_features=torch.tensor(POISON) if with_features else None)
    move = lambda d: {k: None if t is None else t.to(device) for k, t in d.items()}  # noqa: E731
    return move(args), move(want)


def check_commit_cases(commit_fn, device, seed: int) -> int:
    """commit_tokens against the module docstring's definition: chains and trees, every accepted count, with and
    without features, at P = 1 (AR), 2, 16 (a 16-token block) and 65 (DDTree-64's path)."""
    rng = random.Random(seed)
    cases = 0
    for P, nodes in ((1, 0), (2, 1), (16, 15), (16, 64), (65, 64)):
        for accepted in sorted({1, 2, P // 2 + 1, P} & set(range(1, min(P, nodes + 1) + 1))):
            for with_features in (False, True):
                args, want = commit_case(rng, P, nodes, accepted, with_features, device)
                commit_fn(**args)
                ctx = f"commit P={P} nodes={nodes} accepted={accepted} path={args['path'].tolist()}"
                for name, w in want.items():
                    assert w is None or torch.equal(args[name].cpu(), w.cpu()), f"{ctx}: {name}"
                cases += 1
    return cases

# ------------------------------------------------------------------------------ interpreter checks (subprocess)

def _interp_build() -> str:
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    cases = 0
    for depths in DPS:
        for k in KS:
            for budget in BUDGETS:
                _, logp, ids = topk_inputs(gen, depths, k, rng.randrange(50, 1000))
                check_build_kernel(build_tree_triton, logp, ids, budget, f"build depths={depths} k={k} b={budget}")
                cases += 1
    for depths, k, budget in ((15, 8, 64), (3, 2, 15), (1, 8, 2)):  # the two-reduction variant
        _, logp, ids = topk_inputs(gen, depths, k, 300)
        check_build_kernel(build_tree_triton, logp, ids, budget, f"unpacked {depths} {k} {budget}", _packed=False)
        cases += 1
    got = build_tree_triton(logp, ids, 2)  # fresh outputs without out=
    assert_same(BUILD_NAMES, got, build_tree_reference(logp, ids, 2), "no out=")
    return f"{cases} build_tree cases"


def _interp_ties() -> str:
    gen = torch.Generator().manual_seed(2)
    cases = ties = 0
    for depths, k, budget in ((3, 8, 32), (15, 8, 64), (15, 2, 64), (2, 8, 15), (15, 8, 15)):
        for _ in range(2):
            _, logp, ids = topk_inputs(gen, depths, k, 60, logits=tied_logits(gen, depths, 60))
            ties += int((logp[:, 1:] == logp[:, :-1]).sum())
            check_build_kernel(build_tree_triton, logp, ids, budget, f"ties {depths} {k} {budget}")
            check_build_kernel(build_tree_triton, logp, ids, budget, f"ties unpacked {depths} {k} {budget}",
                               _packed=False)
            cases += 1
    # all-equal log-probs: every candidate at a depth ties; and logp = 0 exactly (one-hot softmax)
    for logits in (torch.zeros(4, 8), torch.tensor([[0.0, -200.0, -200.0]] * 5)):
        _, logp, ids = topk_inputs(gen, 0, 3, 0, logits=logits)
        check_build_kernel(build_tree_triton, logp, ids, 40, "flat")
        cases += 1
    check_build_kernel(build_tree_triton, *F32_TIE, 6, "float32 tie")
    check_build_kernel(build_tree_triton, *F32_TIE, 6, "float32 tie unpacked", _packed=False)
    assert ties > 50, f"the tie inputs produced only {ties} tied top-k neighbours"
    return f"{cases} tie cases ({ties} tied top-k neighbours)"


def _interp_walk() -> str:
    shapes = [(d, k, b) for d in DPS for k in (2, 8) for b in (1, 15, 64)]
    return f"{check_walk_cases(build_tree_triton, walk_tree_triton, 'cpu', shapes, seed=3)} walk_tree cases"


def _interp_compact() -> str:
    rng = random.Random(4)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for P, nodes in ((16, 40), (16, 15), (4, 3), (1, 1)):
            for garbage in (False, True):
                k, v, start, path, acc = compact_case(rng, 3, 1, 2, 64, 16, P, nodes, dtype, garbage=garbage)
                wk, wv = k.clone(), v.clone()
                compact_kv_reference(wk, wv, start, path, acc)
                compact_kv_triton(k, v, start, path, acc)
                ctx = f"compact {dtype} P={P} path={path.tolist()} acc={int(acc)} start={int(start)}"
                assert torch.equal(k, wk) and torch.equal(v, wv), ctx
                cases += 1
    # a non-power-of-two head dim, batch 2, and a non-contiguous (strided) layer view
    k, v, start, path, acc = compact_case(rng, 2, 2, 3, 40, 24, 8, 20, torch.float32)
    base_k, base_v = torch.randn(2, 2, 3, 40, 32), torch.randn(2, 2, 3, 40, 32)
    base_k[..., :24], base_v[..., :24] = k, v
    k, v = base_k[..., :24], base_v[..., :24]
    wk, wv = base_k.clone(), base_v.clone()
    compact_kv_reference(wk[..., :24], wv[..., :24], start, path, acc)
    compact_kv_triton(k, v, start, path, acc)
    assert torch.equal(base_k, wk) and torch.equal(base_v, wv), "strided compact"
    k, v, starts, paths, accs = batched_compact_case(rng)
    wk, wv = k.clone(), v.clone()
    compact_kv_reference(wk, wv, starts, paths, accs)
    compact_kv_triton(k, v, starts, paths, accs)
    assert torch.equal(k, wk) and torch.equal(v, wv), "batched compact"
    return f"{cases + 2} compact_kv cases"


def batched_compact_case(rng: random.Random, B: int = 3):
    """Batch rows that are separate sequences: each with its own start, path and accepted count."""
    cases = [compact_case(rng, 2, 1, 2, 48, 8, 6, 12, torch.float32) for _ in range(B)]
    k, v = (torch.cat([c[i] for c in cases], dim=1) for i in (0, 1))
    return k, v, *(torch.stack([c[i] for c in cases]) for i in (2, 3, 4))


def check_batched_trees(build_fn, walk_fn, device, B: int = 3, depths: int = 6, k: int = 4, budget: int = 15) -> str:
    """Several sequences in one call: each sequence's tree and walk equal those of the reference run on it alone."""
    gen = torch.Generator().manual_seed(15)
    rows = [topk_inputs(gen, depths, k, 200, device) for _ in range(B)]
    logp, ids = torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows])
    built = build_fn(logp, ids, budget)
    tokens, parents, _, _, count = built
    posterior = torch.randint(0, 200, (B, budget + 1), generator=gen).to(device)
    posterior[:, 0] = tokens[:, 0]  # each walk accepts at least its first node, then follows random choices
    walked = walk_fn(posterior, tokens, parents, count, depths)
    for b in range(B):
        alone = build_tree_reference(logp[b], ids[b], budget)
        assert_same(BUILD_NAMES, tuple(t[b] for t in built), alone, f"sequence {b}'s tree")
        alone = walk_tree_reference(posterior[b], tokens[b], parents[b], count[b], depths)
        assert all(torch.equal(g[b].cpu(), w.cpu()) for g, w in zip(walked, alone)), f"sequence {b}'s walk"
    return f"{B} sequences built and walked in one call each"


def _interp_batched() -> str:
    return check_batched_trees(build_tree_triton, walk_tree_triton, "cpu")


def _interp_commit() -> str:
    return f"{check_commit_cases(commit_tokens_triton, 'cpu', seed=16)} commit_tokens cases"


CHECKS = {"build": _interp_build, "ties": _interp_ties, "walk": _interp_walk, "compact": _interp_compact,
          "batched": _interp_batched, "commit": _interp_commit}


# ---------------------------------------------------------------------------------------------------- CPU tests

@pytest.mark.cpu
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_triton_kernels_under_interpreter(name):
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_tree_ops", name)


@pytest.mark.cpu
def test_build_reference_invariants():
    """Reference trees at the kernel test shapes: numbering, depths, count, padding, the ancestor mask."""
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    for depths in DPS:
        for k in KS:
            for budget in BUDGETS:
                _, logp, ids = topk_inputs(gen, depths, k, rng.randrange(50, 1000))
                ctx = f"depths={depths} k={k} budget={budget}"
                tree = build_tree_reference(logp, ids, budget)
                check_tree_invariants(tree, budget, depths, k, ctx)


@pytest.mark.cpu
def test_build_reference_out_and_float32_scores():
    gen = torch.Generator().manual_seed(6)
    _, logp, ids = topk_inputs(gen, 15, 8, 500)
    out = build_out(32)
    got = build_tree_reference(logp, ids, 32, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert_same(BUILD_NAMES, got, build_tree_reference(logp, ids, 32), "reference out=")
    # exact ties (small integers: exact sums): the earlier push wins (the heap's push counter)
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    ids = torch.tensor([[1, 2], [3, 4]])
    tokens, parents, depths, visible, count = build_tree_reference(logp, ids, 6)
    assert tokens.tolist() == [1, 2, 3, 3, 4, 4] and parents.tolist() == [0, 0, 1, 2, 1, 2]
    assert depths.tolist() == [1, 1, 2, 2, 2, 2] and int(count) == 6
    # float32 scores: node 2's sibling scores (-0.4 - -0.2) + -0.4, which rounds in float32 to exactly the first
    # sibling's -0.6 (pushed earlier: it wins); in float64 the same float32 inputs give -0.60000001 > -0.60000002
    tokens, parents, _, _, _ = build_tree_reference(*F32_TIE, 6)
    assert tokens.tolist() == [1, 3, 2, 4, 3, 4] and parents.tolist() == [0, 1, 0, 1, 3, 3]
    with pytest.raises(ValueError):
        build_tree_reference(logp.double(), ids, 4)
    with pytest.raises(ValueError):
        build_tree_reference(logp, ids, 0)


@pytest.mark.cpu
def test_walk_reference_follows_planted_paths():
    """Posteriors planted along root..end paths of reference trees: the reference walk accepts exactly that path."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for depths, k, budget in [(15, 8, 64), (3, 2, 15), (15, 1, 15), (1, 8, 8), (15, 8, 32)]:
        vocab = rng.randrange(50, 1000)
        _, logp, ids = topk_inputs(gen, depths, k, vocab)
        tree = build_tree_reference(logp, ids, budget)
        n = int(tree[4])
        for end in [0, n] + [rng.randrange(n + 1) for _ in range(6)]:
            post = posterior_for_path(rng, tree, vocab, end)
            path, accepted, bonus = walk_tree_reference(post, tree[0], tree[1], tree[4], depths)
            want_path = expected_path(tree, end)
            assert path.tolist() == want_path + [0] * (depths + 1 - len(want_path))
            assert int(accepted) == len(want_path) and int(bonus) == int(post[end])
    # the chain cases and N = 0 (reference only)
    check_walk_cases(build_tree_reference, walk_tree_reference, "cpu", [], seed=8)


@pytest.mark.cpu
def test_compact_reference_matches_sequential_definition():
    rng = random.Random(9)
    for P, nodes in ((16, 64), (16, 15), (5, 40), (1, 1)):
        for garbage in (False, True):
            k, v, start, path, acc = compact_case(rng, 3, 1, 2, 128, 16, P, nodes, torch.float32, garbage=garbage)
            wk, wv = k.clone(), v.clone()
            sequential_compact(wk, wv, int(start), path.tolist(), int(acc))
            compact_kv_reference(k, v, start, path, acc)
            assert torch.equal(k, wk) and torch.equal(v, wv), f"path={path.tolist()} acc={int(acc)}"
    # a path with gaps where later destinations are earlier sources: rows only move down
    k = torch.arange(10.0).view(1, 1, 1, 10, 1).repeat(2, 1, 1, 1, 3)
    v = -k.clone()
    compact_kv_reference(k, v, torch.tensor(2), torch.tensor([0, 2, 3, 5, 0]), torch.tensor(4))
    assert k[0, 0, 0, :, 0].tolist() == [0, 1, 2, 4, 5, 7, 6, 7, 8, 9] and torch.equal(v, -k)


@pytest.mark.cpu
def test_commit_reference_matches_definition():
    assert check_commit_cases(commit_tokens_reference, "cpu", seed=17) >= 20
    args, _ = commit_case(random.Random(18), 4, 3, 2, False)
    with pytest.raises(ValueError, match="int64"):
        commit_tokens_reference(**dict(args, ids=args["ids"].int()))
    with pytest.raises(ValueError, match="round_out"):
        commit_tokens_reference(**dict(args, round_out=args["round_out"][:3]))


@pytest.mark.cpu
def test_references_build_and_walk_batched_sequences():
    check_batched_trees(build_tree_reference, walk_tree_reference, "cpu")


@pytest.mark.cpu
def test_compact_reference_batched_rows_follow_their_own_paths():
    k, v, starts, paths, accs = batched_compact_case(random.Random(12))
    wk, wv = k.clone(), v.clone()
    for b in range(k.shape[1]):
        sequential_compact(wk[:, b:b + 1], wv[:, b:b + 1], int(starts[b]), paths[b].tolist(), int(accs[b]))
    compact_kv_reference(k, v, starts, paths, accs)
    assert torch.equal(k, wk) and torch.equal(v, wv)
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="one per batch row"):  # refused before any launch
        compact_kv_triton(k, v, starts[:2], paths, accs)


@pytest.mark.cpu
def test_dispatchers_use_the_references_on_cpu(monkeypatch):
    gen = torch.Generator().manual_seed(10)
    _, logp, ids = topk_inputs(gen, 3, 2, 100)
    called = []
    if tree_ops.triton is not None:
        monkeypatch.setattr(tree_ops, "build_tree_triton", lambda *a, **k: called.append(1))
        monkeypatch.setattr(tree_ops, "walk_tree_triton", lambda *a, **k: called.append(1))
        monkeypatch.setattr(tree_ops, "compact_kv_triton", lambda *a, **k: called.append(1))
        monkeypatch.setattr(tree_ops, "commit_tokens_triton", lambda *a, **k: called.append(1))
    tree = tree_ops.build_tree(logp, ids, 15)
    assert_same(BUILD_NAMES, tree, build_tree_reference(logp, ids, 15), "dispatch build")
    post = torch.zeros(16, dtype=torch.long)
    walked = tree_ops.walk_tree(post, tree[0], tree[1], tree[4], 3)
    assert_same(WALK_NAMES, walked, walk_tree_reference(post, tree[0], tree[1], tree[4], 3), "dispatch walk")
    k = torch.randn(2, 1, 1, 8, 4)
    v, k0 = k.clone(), k.clone()
    tree_ops.compact_kv(k, v, torch.tensor(1), torch.tensor([0, 2, 0]), torch.tensor(2))
    assert torch.equal(k[:, :, :, 2], k0[:, :, :, 3]) and torch.equal(k, v)
    args, want = commit_case(random.Random(20), 3, 2, 2, True)
    tree_ops.commit_tokens(**args)
    assert torch.equal(args["round_out"], want["round_out"])
    assert not called
    monkeypatch.setenv("ENGINE_DISABLE_TRITON", "1")
    assert tree_ops.triton_disabled()
    monkeypatch.setenv("ENGINE_DISABLE_TRITON", "0")
    assert not tree_ops.triton_disabled()


# ---------------------------------------------------------------------------------------------------- GPU tests

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or tree_ops.triton is None,
                                reason="needs a CUDA GPU and Triton")
VOCAB = 151936


@pytest.mark.gpu
@needs_cuda
def test_gpu_build_tree_matches_reference():
    real_shape_build_checks("cuda", VOCAB)


def real_shape_build_checks(dev, vocab: int) -> None:
    gen = torch.Generator().manual_seed(11)
    shapes = [(15, 8, b) for b in (15, 32, 64)] + [(15, 8, 1), (15, 8, 2), (1, 1, 1), (3, 2, 64), (15, 1, 15)]
    for depths, k, budget in shapes:
        for rep in range(3):
            _, logp, ids = topk_inputs(gen, depths, k, vocab, dev)
            ctx = f"gpu build depths={depths} k={k} budget={budget} rep={rep}"
            check_build_kernel(build_tree_triton, logp, ids, budget, ctx)
            check_build_kernel(tree_ops.build_tree, logp, ids, budget, ctx + " (dispatcher)")
    _, logp, ids = topk_inputs(gen, 15, 8, vocab, dev)
    check_build_kernel(build_tree_triton, logp, ids, 64, "gpu unpacked", _packed=False)
    for depths, k, budget in ((15, 8, 64), (15, 8, 15), (3, 8, 32)):
        _, logp, ids = topk_inputs(gen, depths, k, 60, dev, logits=tied_logits(gen, depths, 60))
        check_build_kernel(build_tree_triton, logp, ids, budget, f"gpu ties {depths} {k} {budget}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_walk_tree_matches_reference():
    real_shape_walk_checks("cuda", VOCAB)


def real_shape_walk_checks(dev, vocab: int) -> None:
    shapes = [(15, 8, b) for b in (15, 32, 64)] + [(3, 2, 15), (1, 8, 8)]
    check_walk_cases(build_tree_triton, walk_tree_triton, dev, shapes, seed=12, vocab_range=(vocab, vocab + 1))


@pytest.mark.gpu
@needs_cuda
def test_gpu_compact_kv_matches_reference():
    real_shape_compact_checks("cuda", 36)


@pytest.mark.gpu
@needs_cuda
def test_gpu_commit_tokens_matches_definition():
    assert check_commit_cases(tree_ops.commit_tokens, "cuda", seed=19) >= 20


@pytest.mark.gpu
@needs_cuda
def test_gpu_batched_trees_match_reference():
    check_batched_trees(tree_ops.build_tree, tree_ops.walk_tree, "cuda", B=8, depths=15, k=8, budget=64)


def real_shape_compact_checks(dev, layers: int) -> None:
    rng = random.Random(13)
    for P, nodes, garbage in ((16, 64, False), (16, 15, False), (16, 64, True), (1, 1, False)):
        k, v, start, path, acc = compact_case(rng, layers, 1, 8, 4096, 128, P, nodes, torch.bfloat16, dev, garbage)
        wk, wv = k.clone(), v.clone()
        compact_kv_reference(wk, wv, start, path, acc)
        tree_ops.compact_kv(k, v, start, path, acc)
        assert torch.equal(k, wk) and torch.equal(v, wv), f"path={path.tolist()} acc={int(acc)}"
    k, v, starts, paths, accs = (t.to(dev) for t in batched_compact_case(rng))
    wk, wv = k.clone(), v.clone()
    compact_kv_reference(wk, wv, starts, paths, accs)
    tree_ops.compact_kv(k, v, starts, paths, accs)
    assert torch.equal(k, wk) and torch.equal(v, wv), "batched rows"


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_round():
    """build_tree -> walk_tree -> compact_kv captured in one CUDA graph, replayed with new inputs copied in."""
    if tree_ops.triton_disabled():
        pytest.skip("ENGINE_DISABLE_TRITON=1: the references read values on the host and cannot be captured")
    dev, depths, k, budget = "cuda", 15, 8, 64
    L, H, CAP, Dh = 4, 8, 1024, 128
    rng = random.Random(14)
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(depths, VOCAB, generator=gen).to(dev)
    posterior = torch.zeros(budget + 1, dtype=torch.long, device=dev)
    kc = torch.zeros(L, 1, H, CAP, Dh, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    start = torch.zeros((), dtype=torch.long, device=dev)

    def round_():
        logp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        tree = tree_ops.build_tree(logp, ids, budget)
        walked = tree_ops.walk_tree(posterior, tree[0], tree[1], tree[4], depths)
        tree_ops.compact_kv(kc, vc, start, walked[0], walked[1])
        return tree, walked

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        round_()  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree_g, walked_g = round_()
    for trial in range(4):
        logits.copy_(torch.randn(depths, VOCAB, generator=gen).to(dev))
        logp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        want_tree = build_tree_reference(logp, ids, budget)
        n = int(want_tree[4])
        posterior.copy_(posterior_for_path(rng, want_tree, VOCAB, rng.randrange(n + 1)).to(dev))
        want_walk = walk_tree_reference(posterior, want_tree[0], want_tree[1], want_tree[4], depths)
        kc.copy_(torch.randn(kc.shape, generator=gen).to(kc))
        vc.copy_(torch.randn(vc.shape, generator=gen).to(vc))
        start.fill_(rng.randrange(0, CAP - budget - 1))
        wk, wv = kc.clone(), vc.clone()
        compact_kv_reference(wk, wv, start, want_walk[0], want_walk[1])
        for t in (*tree_g, *walked_g):
            if t.dtype == torch.bool:
                t.view(torch.uint8).fill_(MASK_POISON)
            else:
                t.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(BUILD_NAMES, tree_g, want_tree, f"graph trial {trial}")
        assert_same(WALK_NAMES, walked_g, want_walk, f"graph trial {trial}")
        assert torch.equal(kc, wk) and torch.equal(vc, wv), f"graph trial {trial}: compacted cache"


if __name__ == "__main__":  # python -m correctness.test_kernel_tree_ops CHECK  (with TRITON_INTERPRET=1)
    run_checks_main(CHECKS)
