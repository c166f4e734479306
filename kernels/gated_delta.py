"""Gated DeltaNet over a draft tree: every row's conv window and recurrent state come from its own ancestors.

A verify pass runs rows [root, nodes...] whose `parents` index earlier rows (-1: the committed state, before the
root). A recurrence cannot be masked like attention: a node's state must be computed from its parent's state,
never from a sibling's, or siblings leak into each other ("state leakage"). So:

tree_causal_conv_reference(x [B, T, C], weight [C, K], window [B, C, K-1], parents [T] | None) -> y [B, T, C]
    The depthwise causal conv with SiLU, each row over the last K inputs along its ancestor path: its own input, its
    parent's, ... and, above the root, the committed window (the last K-1 inputs before it). parents None: a chain.

tree_gated_delta_reference(q, k, v [B, T, H, d], g, beta [B, T, H], parents [T] | None, state [B, H, dk, dv])
        -> (out [B, T, H, dv] float32, the last row's state)
    S_r = delta_update(S_parent(r), k_r, v_r, g_r, beta_r), out_r = S_r^T q_r, the committed state above the root.
    parents None: a chain (prefill, DFlash), one state kept at a time.

replay_gated_delta(state, k, v, g, beta, path [P], accepted) -> the state after the accepted path
    What commit keeps: the verify pass's rows are not kept, their inputs are, and the accepted path (root first,
    `accepted` of its P entries real, a device tensor) is replayed from the committed state with the same update, so
    the committed state is bit for bit what verify computed for the last accepted row.

Each is plain PyTorch, computes in float32, reads nothing on the host (a CUDA graph may hold it), and processes rows
one at a time with the same shapes whatever T is, so a row's state does not depend on the rows around it. The update
is transformers' `torch_recurrent_gated_delta_rule` (q and k already l2-normed and q scaled by dk ** -0.5).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def delta_update(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> torch.Tensor:
    """One step of the gated delta rule: state [B, H, dk, dv] f32; k [B, H, dk]; v [B, H, dv]; g, beta [B, H]."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)                # [B, H, dv]: what the state recalls for k
    delta = (v - remembered) * beta[..., None]
    return state + k[..., None] * delta[..., None, :]


def ancestor_rows(parents: torch.Tensor | None, T: int, depth: int, device) -> torch.Tensor:
    """[T, depth] indices into cat(window (depth slots, oldest first), rows): each row's 1st..depth-th ancestor, the
    window's slots above the root. parents None: a chain (row r's parent is r - 1)."""
    rows = torch.arange(T, device=device)
    if parents is None:
        parents = rows - 1
    # parent of every entry of [window slots 0..depth-1, rows]: a slot's is the slot before it, the root's the last slot
    up = torch.cat((torch.arange(depth, device=device).sub(1).clamp(min=0),
                    torch.where(parents < 0, depth - 1, parents + depth)))
    ancestors, cur = [], rows + depth
    for _ in range(depth):
        cur = up.index_select(0, cur)
        ancestors.append(cur)
    return torch.stack(ancestors, dim=1)


def tree_causal_conv_reference(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                               parents: torch.Tensor | None) -> torch.Tensor:
    B, T, C = x.shape
    K = weight.shape[1]
    inputs = [x]  # newest first: the row's own input, then its ancestors' (the window's above the root)
    if K > 1:
        ext = torch.cat((window.transpose(1, 2).to(x.dtype), x), dim=1)           # [B, K-1+T, C]
        anc = ancestor_rows(parents, T, K - 1, x.device)                        # [T, K-1]: 1st ancestor first
        inputs += [ext.index_select(1, anc[:, j]) for j in range(K - 1)]
    w = weight.float()
    y = inputs[K - 1].float() * w[:, 0]
    for j in range(1, K):  # oldest input first, as conv1d sums them
        y = y + inputs[K - 1 - j].float() * w[:, j]
    return F.silu(y).to(x.dtype)


def conv_window(x: torch.Tensor, window: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The committed window after a round [B, C, K-1]: the last K-1 inputs along the accepted path (root first,
    `accepted` entries real), the old window's tail where the path is shorter."""
    K1 = window.shape[2]
    ext = torch.cat((window.transpose(1, 2).to(x.dtype), x), dim=1)               # [B, K-1+T, C]
    order = torch.cat((torch.arange(K1, device=x.device), path + K1))            # the window, then the path
    last = order.index_select(0, accepted + torch.arange(K1, device=x.device))   # entries accepted .. accepted+K-2
    return ext.index_select(1, last).transpose(1, 2).to(window.dtype)


def tree_gated_delta_reference(q, k, v, g, beta, parents: torch.Tensor | None, state: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, dv = v.shape
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    out = torch.empty(B, T, H, dv, dtype=torch.float32, device=v.device)
    if parents is None:  # a chain: the previous row's state is the one to start from
        cur = state.float()
        for r in range(T):
            cur = delta_update(cur, k[:, r], v[:, r], g[:, r], beta[:, r])
            out[:, r] = (cur * q[:, r, ..., None]).sum(-2)
        return out, cur
    states = torch.empty(T + 1, *state.shape, dtype=torch.float32, device=state.device)
    states[0] = state
    for r in range(T):  # parents come before their children
        prev = states.index_select(0, parents[r:r + 1] + 1)[0]
        states[r + 1] = delta_update(prev, k[:, r], v[:, r], g[:, r], beta[:, r])
        out[:, r] = (states[r + 1] * q[:, r, ..., None]).sum(-2)
    return out, states[T]


def replay_gated_delta(state, k, v, g, beta, path: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    k, v, g, beta = (t.float() for t in (k, v, g, beta))
    cur = state.float()
    for j in range(path.shape[0]):
        r = path[j:j + 1]
        step = delta_update(cur, k.index_select(1, r)[:, 0], v.index_select(1, r)[:, 0], g.index_select(1, r)[:, 0],
                            beta.index_select(1, r)[:, 0])
        cur = torch.where(j < accepted, step, cur)
    return cur
