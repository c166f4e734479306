"""kernels/gated_delta.py: the tree-safe Gated DeltaNet references against the plain definition on fresh random
trees (chains, stars, deep and bushy trees, padded rows, up to 257 rows): every row's state and output are those of
the delta rule run along its own root-to-row path, its conv those of the inputs along that path, and what commit keeps
(the replayed path, the new conv window) is the last accepted row's. The chain form equals transformers' recurrence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_delta import (ancestor_rows, conv_window, delta_update, replay_gated_delta,
                                 tree_causal_conv_reference, tree_gated_delta_reference)


def random_tree(kind: str, T: int, gen: torch.Generator) -> torch.Tensor:
    """parents [T]: row 0 is the root (-1, the committed state); each other row's parent is an earlier row; "padded"
    trees end in rows whose parent is -1 too (unused budget, as build_tree pads)."""
    if kind == "chain":
        return torch.arange(T) - 1
    if kind == "star":
        return torch.tensor([-1] + [0] * (T - 1))
    parents = [-1]
    for i in range(1, T):
        lo = max(0, i - 3) if kind == "deep" else 0
        parents.append(int(torch.randint(lo, i, (1,), generator=gen)))
    if kind == "padded":
        parents[T - T // 4:] = [-1] * (T // 4)
    return torch.tensor(parents)


def path_to(parents: torch.Tensor, r: int) -> list[int]:
    path = []
    while r >= 0:
        path.append(r)
        r = int(parents[r])
    return path[::-1]


def inputs(gen, B, T, H, dk, dv):
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 2
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


CASES = [(kind, T) for kind in ("chain", "star", "deep", "bushy", "padded") for T in (1, 2, 9, 33)] + \
    [("bushy", 65), ("deep", 129), ("bushy", 257)]


@pytest.mark.parametrize("kind,T", CASES)
def test_tree_recurrence_follows_each_rows_own_path(kind, T):
    gen = torch.Generator().manual_seed(T * 31 + len(kind))
    B, H, dk, dv = 2, 3, 8, 5
    parents = random_tree(kind, T, gen)
    q, k, v, g, beta, state = inputs(gen, B, T, H, dk, dv)
    out = torch.full((B, T, H, dv), float("nan"))
    out[:], last = tree_gated_delta_reference(q, k, v, g, beta, parents, state)
    for r in range(T):
        s = state
        for j in path_to(parents, r):
            s = delta_update(s, k[:, j], v[:, j], g[:, j], beta[:, j])
        torch.testing.assert_close(out[:, r], (s * q[:, r, ..., None]).sum(-2), rtol=1e-5, atol=1e-5)
        if r == T - 1:
            torch.testing.assert_close(last, s, rtol=1e-5, atol=1e-5)
    # what commit keeps: the state replayed along an accepted path is the verify pass's state of its last row
    leaf = int(torch.randint(T, (1,), generator=gen))
    path = path_to(parents, leaf)
    padded = torch.tensor(path + [0] * (8 - len(path) % 8))  # a fixed-length path, padded past `accepted`
    kept = replay_gated_delta(state, k, v, g, beta, padded, torch.tensor(len(path)))
    _, want = tree_gated_delta_reference(q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], None, state)
    assert torch.equal(kept, want)


def test_chain_form_equals_transformers_recurrence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(5)
    B, T, Hk, Hv, dk, dv = 2, 11, 2, 4, 8, 6
    q, k = torch.randn(B, T, Hk, dk, generator=gen), torch.randn(B, T, Hk, dk, generator=gen)
    v = torch.randn(B, T, Hv, dv, generator=gen)
    g, beta = -torch.rand(B, T, Hv, generator=gen), torch.rand(B, T, Hv, generator=gen)
    state = torch.randn(B, Hv, dk, dv, generator=gen)
    want, want_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = (F.normalize(q, dim=-1, eps=0) * dk ** -0.5).repeat_interleave(Hv // Hk, dim=2)
    kn = F.normalize(k, dim=-1, eps=0).repeat_interleave(Hv // Hk, dim=2)
    got, got_state = tree_gated_delta_reference(qn, kn, v, g, beta, None, state)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    chain, chain_state = tree_gated_delta_reference(qn, kn, v, g, beta, torch.arange(T) - 1, state)
    assert torch.equal(chain, got) and torch.equal(chain_state, got_state)  # explicit parents: the same chain


@pytest.mark.parametrize("kind,T", CASES[:12] + [("bushy", 65)])
@pytest.mark.parametrize("K", (1, 2, 4))
def test_tree_conv_reads_each_rows_own_ancestors(kind, T, K):
    gen = torch.Generator().manual_seed(T + 7 * K)
    B, C = 2, 5
    parents = random_tree(kind, T, gen)
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    window = torch.randn(B, C, K - 1, generator=gen)
    y = tree_causal_conv_reference(x, w, window, parents)
    for r in range(T):
        seq = torch.cat((window, x[:, path_to(parents, r)].transpose(1, 2)), dim=2)[:, :, -K:]  # oldest first
        torch.testing.assert_close(y[:, r], F.silu((seq * w).sum(-1)), rtol=1e-5, atol=1e-5)
    if K > 1:
        leaf = int(torch.randint(T, (1,), generator=gen))
        path = path_to(parents, leaf)
        padded = torch.tensor(path + [0] * 3)
        kept = conv_window(x, window, padded, torch.tensor(len(path)))
        want = torch.cat((window, x[:, path].transpose(1, 2)), dim=2)[:, :, -(K - 1):]
        assert torch.equal(kept, want)


def test_ancestor_rows_of_a_chain_reach_into_the_window():
    anc = ancestor_rows(None, 4, 3, "cpu")  # entries 0..2 are the window's slots, rows start at 3
    assert anc.tolist() == [[2, 1, 0], [3, 2, 1], [4, 3, 2], [5, 4, 3]]
