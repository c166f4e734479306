"""Draft trees: best-first construction from per-depth draft log-probabilities, the ancestor mask, the walk.

Node 0 is the root (the bonus token, already decided); nodes 1..n are draft tokens, numbered so that every
parent comes before its children. A linear DFlash block is the special case of a chain.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: list[int]   # token of node i+1
    parents: list[int]  # parent of node i+1 (0 = root)
    depths: list[int]   # depth of node i+1 (root depth 0)

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[n+1, n+1] bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self.tokens) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i, parent in enumerate(self.parents, start=1):
            mask[i] = mask[parent]
            mask[i, i] = True
        return mask.to(device)

    def walk(self, posterior: list[int]) -> tuple[list[int], int]:
        """Follow the target's greedy choices from the root. Returns the accepted nodes (root first) and the bonus."""
        children: dict[tuple[int, int], int] = {}
        for i, (parent, token) in enumerate(zip(self.parents, self.tokens), start=1):
            children.setdefault((parent, token), i)
        path = [0]
        while (path[-1], posterior[path[-1]]) in children:
            path.append(children[(path[-1], posterior[path[-1]])])
        return path, posterior[path[-1]]


def chain(tokens: list[int]) -> DraftTree:
    """A linear block d1..dk as a tree (what DFlash verifies)."""
    return DraftTree(list(tokens), list(range(len(tokens))), list(range(1, len(tokens) + 1)))


def build_tree(draft_logits: torch.Tensor, budget: int, topk_cap: int) -> DraftTree:
    """Best-first selection of the `budget` highest-scoring prefix-closed rank paths.

    draft_logits [depths, vocab] holds the draft's logits for depths 1..B-1. A node's score is the sum of the
    log-probs of the ranks chosen along its path; popping a candidate pushes its next sibling and first child.
    """
    depths = draft_logits.shape[0]
    k = min(budget, topk_cap, draft_logits.shape[-1])
    if budget <= 0 or depths == 0 or k <= 0:
        return DraftTree([], [], [])
    logp, ids = torch.log_softmax(draft_logits.float(), dim=-1).topk(k, dim=-1)
    logp, ids = logp.tolist(), ids.tolist()
    tree = DraftTree([], [], [])
    # heap entries: (-score, tiebreak, depth index, rank, parent node)
    heap = [(-logp[0][0], 0, 0, 0, 0)]
    pushed = 1
    while heap and len(tree) < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        score = -neg
        tree.tokens.append(ids[d][r])
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        node = len(tree)
        if r + 1 < k:
            heapq.heappush(heap, (-(score - logp[d][r] + logp[d][r + 1]), pushed, d, r + 1, parent))
            pushed += 1
        if d + 1 < depths:
            heapq.heappush(heap, (-(score + logp[d + 1][0]), pushed, d + 1, 0, node))
            pushed += 1
    return tree
