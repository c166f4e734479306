"""engine.tree: best-first tree construction against brute force, the ancestor mask, the walk, chains."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.tree import DraftTree, build_tree, chain

# Two distinct rank paths whose scores differ by less than this are treated as tied (the engine sums scores
# incrementally, the brute force directly, so they may round differently by ~1e-15).
TIE_EPS = 1e-9


# ---------------------------------------------------------------------------------------------------- helpers

def random_logits(seed: int, depths: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(depths, vocab, generator=gen) * 2.0


def topk_tables(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    logp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return logp.tolist(), ids.tolist()


def all_rank_paths(depths: int, k: int):
    for d in range(1, depths + 1):
        yield from itertools.product(range(k), repeat=d)


def path_score(path: tuple[int, ...], logp: list[list[float]]) -> float:
    return sum(logp[d][r] for d, r in enumerate(path))


def tree_rank_paths(tree: DraftTree, ids: list[list[int]]) -> list[tuple[int, ...]]:
    """Rank path of every node (index i -> node i+1), from parents, depths, tokens and the top-k ids."""
    paths: list[tuple[int, ...]] = []
    for i, (token, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths), start=1):
        assert 0 <= parent < i, f"node {i} has parent {parent}, not numbered before it"
        prefix = () if parent == 0 else paths[parent - 1]
        assert depth == len(prefix) + 1, f"node {i}: depth {depth} but parent depth {len(prefix)}"
        assert token in ids[depth - 1], f"node {i}: token {token} is not in the top-k at depth {depth}"
        paths.append(prefix + (ids[depth - 1].index(token),))
    return paths


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    """A random tree with parents numbered before children and distinct tokens among siblings."""
    tokens, parents, depths = [], [], []
    used: dict[int, set[int]] = {0: set()}
    for i in range(1, n + 1):
        candidates = [p for p in range(i) if len(used[p]) < vocab]
        parent = rng.choice(candidates)
        token = rng.choice([t for t in range(vocab) if t not in used[parent]])
        used[parent].add(token)
        used[i] = set()
        tokens.append(token)
        parents.append(parent)
        depths.append(0 if parent == 0 else depths[parent - 1])
        depths[-1] += 1
    return DraftTree(tokens, parents, depths)


def ancestors_or_self(tree: DraftTree, i: int) -> set[int]:
    out = {i}
    while i != 0:
        i = tree.parents[i - 1]
        out.add(i)
    return out


def reference_walk(tree: DraftTree, posterior: list[int]) -> tuple[list[int], int]:
    cur, path = 0, [0]
    while True:
        kids = [j for j in range(1, len(tree) + 1) if tree.parents[j - 1] == cur and tree.tokens[j - 1] == posterior[cur]]
        if not kids:
            return path, posterior[cur]
        cur = kids[0]
        path.append(cur)


CASES = [
    # (seed, depths, vocab, budget, topk_cap)
    (seed, depths, vocab, budget, cap)
    for seed, (depths, vocab, budget, cap) in enumerate(
        [(1, 6, 1, 1), (1, 8, 5, 3), (1, 12, 20, 5), (2, 6, 3, 2), (2, 7, 7, 3), (3, 9, 10, 4), (3, 6, 20, 5),
         (4, 10, 15, 2), (4, 12, 20, 5), (5, 8, 1, 5), (5, 11, 9, 3), (5, 6, 20, 1), (5, 12, 16, 4),
         (4, 6, 20, 20), (2, 9, 20, 2), (3, 10, 13, 5), (5, 7, 20, 3), (1, 10, 20, 5), (5, 12, 2, 5)])
]


# ---------------------------------------------------------------------------------------------------- build_tree

@pytest.mark.parametrize("seed,depths,vocab,budget,cap", CASES)
@pytest.mark.parametrize("rep", range(3))
def test_build_tree_matches_brute_force(seed, depths, vocab, budget, cap, rep):
    """The chosen rank paths are the `budget` highest-scoring ones (all if fewer), and they are prefix-closed."""
    logits = random_logits(1000 * rep + seed, depths, vocab)
    k = min(budget, cap, vocab)
    logp, ids = topk_tables(logits, k)
    tree = build_tree(logits, budget, cap)

    paths = tree_rank_paths(tree, ids)
    chosen = set(paths)
    assert len(chosen) == len(paths), "two nodes map to the same rank path"
    everything = list(all_rank_paths(depths, k))
    assert len(tree) == min(budget, len(everything))

    # prefix-closed: every proper prefix of a chosen path is chosen
    for p in chosen:
        for cut in range(1, len(p)):
            assert p[:cut] in chosen, f"{p} chosen without its prefix {p[:cut]}"

    # optimal: nothing left out scores above anything chosen
    scores = {p: path_score(p, logp) for p in everything}
    if len(chosen) < len(everything):
        worst_in = min(scores[p] for p in chosen)
        best_out = max(scores[p] for p in everything if p not in chosen)
        assert worst_in >= best_out - TIE_EPS
        # away from ties the set is exactly the top `budget` of the brute-force ranking
        ranked = sorted(everything, key=lambda p: -scores[p])
        if scores[ranked[budget - 1]] - scores[ranked[budget]] > TIE_EPS:
            assert chosen == set(ranked[:budget])
    else:
        assert chosen == set(everything)


@pytest.mark.parametrize("seed", range(12))
def test_build_tree_structure(seed):
    """Parents come before children, depth = parent depth + 1, siblings have distinct tokens, depth limit kept."""
    rng = random.Random(seed)
    depths, vocab = rng.randint(1, 5), rng.randint(6, 12)
    budget, cap = rng.randint(1, 20), rng.randint(1, 5)
    logits = random_logits(50 + seed, depths, vocab)
    tree = build_tree(logits, budget, cap)
    assert len(tree.tokens) == len(tree.parents) == len(tree.depths) == len(tree) > 0
    siblings: dict[int, list[int]] = {}
    for i, (token, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths), start=1):
        assert 0 <= parent < i
        assert depth == (0 if parent == 0 else tree.depths[parent - 1]) + 1
        assert 1 <= depth <= depths
        assert 0 <= token < vocab
        siblings.setdefault(parent, []).append(token)
    for parent, toks in siblings.items():
        assert len(toks) == len(set(toks)), f"children of {parent} repeat a token: {toks}"
        assert len(toks) <= min(budget, cap, vocab)


def test_build_tree_first_node_is_depth1_argmax():
    """Node 1 is the most likely depth-1 token, a child of the root."""
    logits = random_logits(7, 3, 9)
    tree = build_tree(logits, 5, 3)
    assert tree.parents[0] == 0 and tree.depths[0] == 1
    assert tree.tokens[0] == int(logits[0].argmax())


def test_build_tree_peaked_logits_is_a_chain():
    """A draft that is certain at every depth gives the argmax chain first."""
    vocab, depths = 10, 4
    target = [3, 7, 1, 9]
    logits = torch.full((depths, vocab), -30.0)
    for d, t in enumerate(target):
        logits[d, t] = 30.0
    tree = build_tree(logits, depths, 4)
    assert tree.tokens == target
    assert tree.parents == [0, 1, 2, 3]
    assert tree.depths == [1, 2, 3, 4]


@pytest.mark.parametrize("budget", [0, -1])
def test_build_tree_zero_budget_is_empty(budget):
    """Budget 0 (or below) gives an empty tree."""
    tree = build_tree(random_logits(0, 3, 8), budget, 4)
    assert (tree.tokens, tree.parents, tree.depths) == ([], [], [])
    assert len(tree) == 0


def test_build_tree_no_depths_is_empty():
    """A draft with no depths (block size 1) gives an empty tree."""
    tree = build_tree(torch.zeros(0, 8), 10, 4)
    assert len(tree) == 0


@pytest.mark.parametrize("depths", [1, 2, 3])
def test_build_tree_respects_depths(depths):
    """With budget larger than the number of paths, the whole K-ary tree of the given depth is built."""
    vocab, cap = 8, 2
    tree = build_tree(random_logits(3, depths, vocab), 100, cap)
    assert max(tree.depths) == depths
    assert len(tree) == sum(cap ** d for d in range(1, depths + 1))


# ---------------------------------------------------------------------------------------------------- ancestor_mask

@pytest.mark.parametrize("seed", range(8))
def test_ancestor_mask_on_built_trees(seed):
    """Node i sees node j iff j is i or an ancestor of i (root included)."""
    rng = random.Random(seed)
    tree = build_tree(random_logits(seed, rng.randint(1, 5), rng.randint(6, 12)), rng.randint(1, 20), rng.randint(1, 5))
    mask = tree.ancestor_mask()
    n = len(tree) + 1
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        expect = ancestors_or_self(tree, i)
        for j in range(n):
            assert bool(mask[i, j]) == (j in expect), f"mask[{i}, {j}]"


def test_ancestor_mask_small_example():
    """A hand-made tree: root -> 1 -> 3, root -> 2 -> 4 -> 5."""
    tree = DraftTree([5, 6, 7, 8, 9], [0, 0, 1, 2, 4], [1, 1, 2, 2, 3])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)


def test_ancestor_mask_empty_tree():
    """The empty tree's mask is the root alone."""
    assert torch.equal(DraftTree([], [], []).ancestor_mask(), torch.ones(1, 1, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------- walk

@pytest.mark.parametrize("seed", range(30))
def test_walk_matches_reference_on_random_trees(seed):
    """walk() follows the target's choices exactly like the straightforward reference walk."""
    rng = random.Random(seed)
    vocab = rng.randint(3, 8)
    tree = random_tree(rng, rng.randint(0, 25), vocab)
    for _ in range(20):
        posterior = [rng.randrange(vocab) for _ in range(len(tree) + 1)]
        path, bonus = tree.walk(posterior)
        assert (path, bonus) == reference_walk(tree, posterior)
        assert path[0] == 0 and bonus == posterior[path[-1]]


@pytest.mark.parametrize("seed", range(20))
def test_walk_follows_side_branch(seed):
    """A posterior that steers into a non-first branch and then down it (depth >= 2) is followed to the end."""
    rng = random.Random(100 + seed)
    vocab = 6
    tree = None
    while tree is None:
        cand = random_tree(rng, rng.randint(6, 25), vocab)
        # a deepest node of depth >= 2 whose depth-1 ancestor is not node 1 (not the first branch)
        deep = [i for i in range(1, len(cand) + 1) if cand.depths[i - 1] >= 2]
        deep = [i for i in deep if min(ancestors_or_self(cand, i) - {0}) != 1]
        if deep:
            tree, leaf = cand, max(deep, key=lambda i: cand.depths[i - 1])
    chain_nodes = sorted(ancestors_or_self(tree, leaf))
    posterior = [rng.randrange(vocab) for _ in range(len(tree) + 1)]
    for a, b in zip(chain_nodes, chain_nodes[1:]):
        posterior[a] = tree.tokens[b - 1]
    # at the leaf, pick a token that no child of the leaf has, so the walk stops there
    leaf_kids = {tree.tokens[j - 1] for j in range(1, len(tree) + 1) if tree.parents[j - 1] == leaf}
    posterior[leaf] = next(t for t in range(vocab) if t not in leaf_kids)
    path, bonus = tree.walk(posterior)
    assert path == chain_nodes
    assert len(path) >= 3
    assert bonus == posterior[leaf]


def test_walk_on_built_tree_side_branch():
    """On a built tree, a posterior choosing the rank-1 token at depth 1 then rank-0 goes down that branch."""
    logits = random_logits(11, 3, 10)
    tree = build_tree(logits, 20, 3)
    _, ids = topk_tables(logits, 3)
    node_a = next(i for i in range(1, len(tree) + 1) if tree.parents[i - 1] == 0 and tree.tokens[i - 1] == ids[0][1])
    node_b = next(i for i in range(1, len(tree) + 1) if tree.parents[i - 1] == node_a and tree.tokens[i - 1] == ids[1][0])
    posterior = [ids[0][1]] + [0] * len(tree)
    posterior[node_a] = ids[1][0]
    kids_b = {tree.tokens[j - 1] for j in range(1, len(tree) + 1) if tree.parents[j - 1] == node_b}
    posterior[node_b] = next(t for t in range(10) if t not in kids_b)
    path, bonus = tree.walk(posterior)
    assert path == [0, node_a, node_b]
    assert bonus == posterior[node_b]


def test_walk_empty_tree():
    """With no draft nodes the walk accepts only the root and the bonus is the root's posterior."""
    assert DraftTree([], [], []).walk([42]) == ([0], 42)


# ---------------------------------------------------------------------------------------------------- chain

@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_chain_shape(n):
    """chain(tokens): node i's parent is i-1 and its depth is i."""
    tokens = [10 + i for i in range(n)]
    tree = chain(tokens)
    assert tree.tokens == tokens
    assert tree.parents == list(range(n))
    assert tree.depths == list(range(1, n + 1))
    mask = tree.ancestor_mask()
    assert torch.equal(mask, torch.ones(n + 1, n + 1, dtype=torch.bool).tril())


@pytest.mark.parametrize("seed", range(30))
def test_chain_walk_is_longest_prefix_acceptance(seed):
    """Walking a chain accepts the longest prefix with d_i == posterior[i-1]; the bonus is the first mismatch."""
    rng = random.Random(seed)
    vocab = rng.randint(2, 4)
    n = rng.randint(0, 10)
    draft = [rng.randrange(vocab) for _ in range(n)]
    posterior = [rng.randrange(vocab) for _ in range(n + 1)]
    # bias toward long acceptances: copy a random-length prefix of the draft into the posterior
    keep = rng.randint(0, n)
    posterior[:keep] = draft[:keep]
    accepted = 0
    while accepted < n and draft[accepted] == posterior[accepted]:
        accepted += 1
    path, bonus = chain(draft).walk(posterior)
    assert path == list(range(accepted + 1))
    assert bonus == posterior[accepted]
