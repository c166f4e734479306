"""kernels.tree_ops references (what the decode loop runs on CPU and what the kernels are checked against): best-first
build_tree_reference against brute force, its ancestor mask, walk_tree_reference against a plain walk, and the
DFlash chain (engine.decode.RoundTree.chain)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.decode import RoundTree
from kernels.tree_ops import build_tree_reference, walk_tree_reference

# Two distinct rank paths whose scores differ by less than this are treated as tied. build_tree_reference sums
# float32 scores incrementally (a sibling's score is score - logp[d][r] + logp[d][r+1]), the brute force sums the
# same float32 log-probs directly in float64, so the two differ by a few float32 ulps (under 1e-6 at these sizes);
# float32 rounding can even make two paths exactly equal that float64 would order, and then push order decides.
# So a path left out may outscore a chosen one by at most TIE_EPS, and the chosen set must be exactly the brute
# force's top `budget` only when the gap at the budget boundary exceeds TIE_EPS.
TIE_EPS = 1e-5


# ---------------------------------------------------------------------------------------------------- helpers

def random_logits(seed: int, depths: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(depths, vocab, generator=gen) * 2.0


def topk_tables(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode loop's build_tree inputs: top-k of the log-softmax, float32 log-probs and int64 ids."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def build(logits: torch.Tensor, budget: int, cap: int):
    """build_tree_reference on the logits' top-K tables, K = min(budget, cap, vocab) as in the decode loop.
    Returns (tokens, parents, depths, visible, count) and the tables as lists."""
    k = min(budget, cap, logits.shape[-1])
    logp, ids = topk_tables(logits, k)
    return build_tree_reference(logp, ids, budget), logp.tolist(), ids.tolist()


def real_nodes(tree) -> tuple[list[int], list[int], list[int]]:
    """tokens, parents, depths of the real nodes (index i -> node i+1)."""
    n = int(tree[4])
    return tree[0][:n].tolist(), tree[1][:n].tolist(), tree[2][:n].tolist()


def all_rank_paths(depths: int, k: int):
    for d in range(1, depths + 1):
        yield from itertools.product(range(k), repeat=d)


def path_score(path: tuple[int, ...], logp: list[list[float]]) -> float:
    return sum(logp[d][r] for d, r in enumerate(path))


def tree_rank_paths(tree, ids: list[list[int]]) -> list[tuple[int, ...]]:
    """Rank path of every node (index i -> node i+1), from parents, depths, tokens and the top-k ids."""
    paths: list[tuple[int, ...]] = []
    for i, (token, parent, depth) in enumerate(zip(*real_nodes(tree)), start=1):
        assert 0 <= parent < i, f"node {i} has parent {parent}, not numbered before it"
        prefix = () if parent == 0 else paths[parent - 1]
        assert depth == len(prefix) + 1, f"node {i}: depth {depth} but parent depth {len(prefix)}"
        assert token in ids[depth - 1], f"node {i}: token {token} is not in the top-k at depth {depth}"
        paths.append(prefix + (ids[depth - 1].index(token),))
    return paths


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    """Node i and its ancestors up to the root; parents[j - 1] is node j's parent."""
    out = {i}
    while i != 0:
        i = parents[i - 1]
        out.add(i)
    return out


def expected_visible(parents: list[int], budget: int) -> torch.Tensor:
    """[budget+1]^2: row i of a real node marks i and its ancestors; padded rows only their diagonal."""
    want = torch.eye(budget + 1, dtype=torch.bool)
    for i in range(1, len(parents) + 1):
        for j in ancestors_or_self(parents, i):
            want[i, j] = True
    return want


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """A random tree (tokens, parents, depths) with parents numbered before children, distinct sibling tokens."""
    tokens, parents, depths = [], [], []
    used: dict[int, set[int]] = {0: set()}
    for i in range(1, n + 1):
        parent = rng.choice([p for p in range(i) if len(used[p]) < vocab])
        token = rng.choice([t for t in range(vocab) if t not in used[parent]])
        used[parent].add(token)
        used[i] = set()
        tokens.append(token)
        parents.append(parent)
        depths.append((0 if parent == 0 else depths[parent - 1]) + 1)
    return tokens, parents, depths


def padded(rng: random.Random, tokens: list[int], parents: list[int], extra: int, vocab: int):
    """Tensors [n + extra] whose extra entries look like real children of real nodes (count excludes them)."""
    n = len(tokens)
    toks = tokens + [rng.randrange(vocab) for _ in range(extra)]
    pars = parents + [rng.randrange(n + 1) for _ in range(extra)]
    return torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long), torch.tensor(n)


def reference_walk(tokens: list[int], parents: list[int], posterior: list[int], max_depth: int
                   ) -> tuple[list[int], int]:
    """The plain walk: from the root, step to the child whose token is the target's choice, at most max_depth
    steps. Returns the accepted nodes (root first) and the bonus."""
    cur, path = 0, [0]
    while len(path) <= max_depth:
        kids = [j for j in range(1, len(tokens) + 1) if parents[j - 1] == cur and tokens[j - 1] == posterior[cur]]
        if not kids:
            break
        cur = kids[0]
        path.append(cur)
    return path, posterior[cur]


def walk(posterior: list[int], tokens: torch.Tensor, parents: torch.Tensor, count, max_depth: int
         ) -> tuple[list[int], int]:
    """walk_tree_reference with its padding checked and stripped: (accepted nodes, bonus)."""
    path, accepted, bonus = walk_tree_reference(torch.tensor(posterior, dtype=torch.long), tokens, parents, count,
                                                max_depth)
    a = int(accepted)
    assert path.shape == (max_depth + 1,) and 1 <= a <= max_depth + 1
    assert path[a:].eq(0).all(), f"path padding {path.tolist()}"
    return path[:a].tolist(), int(bonus)


CASES = [
    # (seed, depths, vocab, budget, topk_cap)
    (seed, depths, vocab, budget, cap)
    for seed, (depths, vocab, budget, cap) in enumerate(
        [(1, 6, 1, 1), (1, 8, 5, 3), (1, 12, 20, 5), (2, 6, 3, 2), (2, 7, 7, 3), (3, 9, 10, 4), (3, 6, 20, 5),
         (4, 10, 15, 2), (4, 12, 20, 5), (5, 8, 1, 5), (5, 11, 9, 3), (5, 6, 20, 1), (5, 12, 16, 4),
         (4, 6, 20, 20), (2, 9, 20, 2), (3, 10, 13, 5), (5, 7, 20, 3), (1, 10, 20, 5), (5, 12, 2, 5)])
]


# ---------------------------------------------------------------------------------------------------- build_tree

def check_against_brute_force(logits: torch.Tensor, budget: int, cap: int) -> bool:
    """Asserts the chosen rank paths are a prefix-closed set of the `budget` best (up to TIE_EPS); returns whether
    the boundary was clear of ties, so that the exact top-`budget` set was compared too."""
    depths, vocab = logits.shape
    k = min(budget, cap, vocab)
    tree, logp, ids = build(logits, budget, cap)
    paths = tree_rank_paths(tree, ids)
    chosen = set(paths)
    assert len(chosen) == len(paths), "two nodes map to the same rank path"
    everything = list(all_rank_paths(depths, k))
    assert int(tree[4]) == min(budget, len(everything))

    # prefix-closed: every proper prefix of a chosen path is chosen
    for p in chosen:
        for cut in range(1, len(p)):
            assert p[:cut] in chosen, f"{p} chosen without its prefix {p[:cut]}"

    # optimal: nothing left out scores above anything chosen (beyond float32 rounding)
    scores = {p: path_score(p, logp) for p in everything}
    if len(chosen) == len(everything):
        assert chosen == set(everything)
        return True
    worst_in = min(scores[p] for p in chosen)
    best_out = max(scores[p] for p in everything if p not in chosen)
    assert worst_in >= best_out - TIE_EPS, f"left out a path scoring {best_out}, kept one scoring {worst_in}"
    # away from ties the set is exactly the top `budget` of the brute-force ranking
    ranked = sorted(everything, key=lambda p: -scores[p])
    if scores[ranked[budget - 1]] - scores[ranked[budget]] > TIE_EPS:
        assert chosen == set(ranked[:budget])
        return True
    return False


@pytest.mark.parametrize("seed,depths,vocab,budget,cap", CASES)
@pytest.mark.parametrize("rep", range(3))
def test_build_tree_matches_brute_force(seed, depths, vocab, budget, cap, rep):
    """The chosen rank paths are the `budget` highest-scoring ones (all if fewer), and they are prefix-closed."""
    clear = check_against_brute_force(random_logits(1000 * rep + seed, depths, vocab), budget, cap)
    assert clear, "continuous random logits gave a near-tie at the budget boundary: pick another seed"


@pytest.mark.parametrize("seed", range(10))
def test_build_tree_tied_logits_optimal(seed):
    """Logits with few distinct values (exact ties everywhere): the chosen set is still prefix-closed and optimal."""
    gen = torch.Generator().manual_seed(200 + seed)
    rng = random.Random(200 + seed)
    depths, vocab = rng.randint(1, 4), rng.randint(3, 8)
    logits = torch.randint(0, 3, (depths, vocab), generator=gen).float()
    check_against_brute_force(logits, rng.randint(1, 20), rng.randint(1, 4))


@pytest.mark.parametrize("seed", range(12))
def test_build_tree_structure(seed):
    """Parents before children, depth = parent depth + 1, distinct sibling tokens, budget/depth/top-k limits,
    padding past count."""
    rng = random.Random(seed)
    depths, vocab = rng.randint(1, 5), rng.randint(6, 12)
    budget, cap = rng.randint(1, 20), rng.randint(1, 5)
    tree, _, _ = build(random_logits(50 + seed, depths, vocab), budget, cap)
    tokens_t, parents_t, depths_t, visible, count = tree
    assert tokens_t.shape == parents_t.shape == depths_t.shape == (budget,) and count.shape == ()
    assert tokens_t.dtype == parents_t.dtype == depths_t.dtype == count.dtype == torch.long
    assert visible.shape == (budget + 1, budget + 1) and visible.dtype == torch.bool
    n = int(count)
    assert 1 <= n <= budget
    tokens, parents, dep = real_nodes(tree)
    siblings: dict[int, list[int]] = {}
    for i, (token, parent, depth) in enumerate(zip(tokens, parents, dep), start=1):
        assert 0 <= parent < i
        assert depth == (0 if parent == 0 else dep[parent - 1]) + 1
        assert 1 <= depth <= depths
        assert 0 <= token < vocab
        siblings.setdefault(parent, []).append(token)
    for parent, toks in siblings.items():
        assert len(toks) == len(set(toks)), f"children of {parent} repeat a token: {toks}"
        assert len(toks) <= min(budget, cap, vocab)
    assert tokens_t[n:].eq(0).all() and parents_t[n:].eq(-1).all() and depths_t[n:].eq(0).all(), "padding"


def test_build_tree_first_node_is_depth1_argmax():
    """Node 1 is the most likely depth-1 token, a child of the root."""
    logits = random_logits(7, 3, 9)
    tokens, parents, depths = real_nodes(build(logits, 5, 3)[0])
    assert parents[0] == 0 and depths[0] == 1
    assert tokens[0] == int(logits[0].argmax())


def test_build_tree_hand_worked_order():
    """Exact (power-of-two) log-probs: the pop order worked out by hand, including a deeper node that outranks a
    shallower one and a later node whose parent is not the previous node."""
    logp = torch.tensor([[-1.0, -1.5], [-0.25, -3.0], [-0.75, -4.0]])
    ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    # pops: (d0 r0) -1 | child -1.25 | root's r1 -1.5 | its child -1.75 | node 2's child -2.0 | node 4's child -2.5
    tokens, parents, depths, visible, count = build_tree_reference(logp, ids, 5)
    assert tokens.tolist() == [5, 7, 6, 7, 9]
    assert parents.tolist() == [0, 1, 0, 3, 2]
    assert depths.tolist() == [1, 2, 1, 2, 3]
    assert int(count) == 5
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(visible, expected)
    tokens6, parents6, _, _, _ = build_tree_reference(logp, ids, 6)
    assert tokens6.tolist() == [5, 7, 6, 7, 9, 9] and parents6.tolist() == [0, 1, 0, 3, 2, 4]


def test_build_tree_peaked_logits_is_the_argmax_chain():
    """A draft that is certain at every depth gives the argmax chain, the same tree as DFlash's RoundTree.chain."""
    vocab, depths = 10, 4
    target = [3, 7, 1, 9]
    logits = torch.full((depths, vocab), -30.0)
    for d, t in enumerate(target):
        logits[d, t] = 30.0
    tree = build(logits, depths, 4)[0]
    chain = RoundTree.chain(depths, "cpu")
    chain.tokens.copy_(logits.argmax(-1))
    for name, got, want in zip(("tokens", "parents", "depths", "visible", "count"), tree,
                               (chain.tokens, chain.parents, chain.depths, chain.visible, chain.n_nodes)):
        assert torch.equal(got, want), name
    assert tree[0].tolist() == target


@pytest.mark.parametrize("budget,depths", [(0, 3), (-1, 3), (4, 0)])
def test_build_tree_rejects_empty(budget, depths):
    """Budget < 1 or no depths is refused (the decode loop runs budget 0 as AR and needs block size >= 2)."""
    logp, ids = topk_tables(torch.randn(depths, 8, generator=torch.Generator().manual_seed(budget + 5)), 2)
    with pytest.raises(ValueError):
        build_tree_reference(logp, ids, budget)


@pytest.mark.parametrize("depths", [1, 2, 3])
def test_build_tree_respects_depths(depths):
    """With budget larger than the number of paths, the whole K-ary tree of the given depth is built, then padding."""
    vocab, cap, budget = 8, 2, 100
    tree, _, _ = build(random_logits(3 + depths, depths, vocab), budget, cap)
    n = sum(cap ** d for d in range(1, depths + 1))
    assert int(tree[4]) == n
    assert max(tree[2].tolist()) == depths
    assert tree[1][n:].eq(-1).all() and tree[2][n:].eq(0).all()


# ---------------------------------------------------------------------------------------------------- ancestor mask

@pytest.mark.parametrize("seed", range(8))
def test_visible_is_ancestor_or_self(seed):
    """visible[i, j] iff j is i or an ancestor of i (root included); padded rows see only themselves."""
    rng = random.Random(seed)
    budget = rng.randint(1, 40)
    tree, _, _ = build(random_logits(seed, rng.randint(1, 5), rng.randint(6, 12)), budget, rng.randint(1, 5))
    _, parents, _ = real_nodes(tree)
    visible = tree[3]
    assert visible.shape == (budget + 1, budget + 1) and visible.dtype == torch.bool
    want = expected_visible(parents, budget)
    for i in range(budget + 1):
        for j in range(budget + 1):
            assert bool(visible[i, j]) == bool(want[i, j]), f"visible[{i}, {j}]"


# ---------------------------------------------------------------------------------------------------- walk

@pytest.mark.parametrize("seed", range(30))
def test_walk_matches_reference_on_random_trees(seed):
    """walk_tree_reference follows the target's choices like the plain walk, ignores nodes past count, and stops
    after max_depth steps."""
    rng = random.Random(seed)
    vocab = rng.randint(3, 8)
    tokens, parents, depths = random_tree(rng, rng.randint(0, 25), vocab)
    tok_t, par_t, count = padded(rng, tokens, parents, rng.randint(0, 4), vocab)
    deepest = max(depths, default=0)
    for trial in range(20):
        max_depth = deepest if trial % 4 else rng.randint(0, deepest + 2)
        posterior = [rng.randrange(vocab) for _ in range(len(tok_t) + 1)]
        if trial % 2:  # steer toward long walks: along a random node's ancestors
            nodes = sorted(ancestors_or_self(parents, rng.randint(0, len(tokens))))
            for a, b in zip(nodes, nodes[1:]):
                posterior[a] = tokens[b - 1]
        path, bonus = walk(posterior, tok_t, par_t, count, max_depth)
        assert (path, bonus) == reference_walk(tokens, parents, posterior, max_depth)
        assert path[0] == 0 and bonus == posterior[path[-1]]


@pytest.mark.parametrize("seed", range(20))
def test_walk_follows_side_branch(seed):
    """A posterior that steers into a non-first branch and then down it (depth >= 2) is followed to the end."""
    rng = random.Random(100 + seed)
    vocab = 6
    tree = None
    while tree is None:
        tokens, parents, depths = random_tree(rng, rng.randint(6, 25), vocab)
        # a deepest node of depth >= 2 whose depth-1 ancestor is not node 1 (not the first branch)
        deep = [i for i in range(1, len(tokens) + 1) if depths[i - 1] >= 2]
        deep = [i for i in deep if min(ancestors_or_self(parents, i) - {0}) != 1]
        if deep:
            tree, leaf = (tokens, parents, depths), max(deep, key=lambda i: depths[i - 1])
    chain_nodes = sorted(ancestors_or_self(parents, leaf))
    posterior = [rng.randrange(vocab) for _ in range(len(tokens) + 1)]
    for a, b in zip(chain_nodes, chain_nodes[1:]):
        posterior[a] = tokens[b - 1]
    # at the leaf, pick a token that no child of the leaf has, so the walk stops there
    leaf_kids = {tokens[j - 1] for j in range(1, len(tokens) + 1) if parents[j - 1] == leaf}
    posterior[leaf] = next(t for t in range(vocab) if t not in leaf_kids)
    path, bonus = walk(posterior, torch.tensor(tokens), torch.tensor(parents), len(tokens), max(depths))
    assert path == chain_nodes
    assert len(path) >= 3
    assert bonus == posterior[leaf]


def test_walk_on_built_tree_side_branch():
    """On a built tree, a posterior choosing the rank-1 token at depth 1 then rank-0 goes down that branch."""
    logits = random_logits(11, 3, 10)
    tree, _, ids = build(logits, 20, 3)
    tokens, parents, _ = real_nodes(tree)
    n = len(tokens)
    node_a = next(i for i in range(1, n + 1) if parents[i - 1] == 0 and tokens[i - 1] == ids[0][1])
    node_b = next(i for i in range(1, n + 1) if parents[i - 1] == node_a and tokens[i - 1] == ids[1][0])
    posterior = [ids[0][1]] + [0] * 20
    posterior[node_a] = ids[1][0]
    kids_b = {tokens[j - 1] for j in range(1, n + 1) if parents[j - 1] == node_b}
    posterior[node_b] = next(t for t in range(10) if t not in kids_b)
    path, bonus = walk(posterior, tree[0], tree[1], tree[4], 3)
    assert path == [0, node_a, node_b]
    assert bonus == posterior[node_b]


def test_walk_empty_tree():
    """With no real draft nodes the walk accepts only the root and the bonus is the root's posterior."""
    empty = torch.zeros(0, dtype=torch.long)
    assert walk([42], empty, empty, 0, 0) == ([0], 42)
    assert walk([42], empty, empty, 0, 3) == ([0], 42)
    # padded entries past count 0 that would match are not nodes
    assert walk([42, 43, 44], torch.tensor([42, 43]), torch.tensor([0, 1]), torch.tensor(0), 2) == ([0], 42)


# ---------------------------------------------------------------------------------------------------- chain

@pytest.mark.parametrize("n", [0, 1, 2, 5, 15])
def test_chain_shape(n):
    """RoundTree.chain(n): node i's parent is i-1, its depth i, visible lower-triangular (= ancestor-or-self)."""
    tree = RoundTree.chain(n, "cpu")
    assert tree.tokens.shape == (n,) and tree.tokens.dtype == torch.long
    assert tree.parents.tolist() == list(range(n))
    assert tree.depths.tolist() == list(range(1, n + 1))
    assert int(tree.n_nodes) == n
    assert torch.equal(tree.visible, torch.ones(n + 1, n + 1, dtype=torch.bool).tril())
    assert torch.equal(tree.visible, expected_visible(list(range(n)), n))


@pytest.mark.parametrize("seed", range(30))
def test_chain_walk_is_longest_prefix_acceptance(seed):
    """Walking DFlash's argmax chain accepts the longest prefix with d_i == posterior[i-1]; the bonus is the
    target's choice after it."""
    rng = random.Random(seed)
    vocab = rng.randint(2, 4)
    n = rng.randint(0, 10)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(300 + seed))
    tree = RoundTree.chain(n, "cpu")
    tree.tokens.copy_(logits.argmax(-1))  # what the decode loop's tree stage does for DFlash
    draft = tree.tokens.tolist()
    posterior = [rng.randrange(vocab) for _ in range(n + 1)]
    # bias toward long acceptances: copy a random-length prefix of the draft into the posterior
    keep = rng.randint(0, n)
    posterior[:keep] = draft[:keep]
    accepted = 0
    while accepted < n and draft[accepted] == posterior[accepted]:
        accepted += 1
    path, bonus = walk(posterior, tree.tokens, tree.parents, tree.n_nodes, n)
    assert path == list(range(accepted + 1))
    assert bonus == posterior[accepted]
