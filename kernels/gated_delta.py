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

The layer's path (what engine/gated_delta.py calls), a Triton kernel for CUDA tensors and the references otherwise:

tree_schedule(parents [T] | None, node_mask [T, T] | None, T, kernel, device, max_depth) -> TreeSchedule
    Once per forward pass, shared by all Gated DeltaNet layers: each row's conv ancestors, and the tree cut into
    chains (a row and its first children down to a leaf), one per leaf: a chain's program replays the rows above
    its head from the committed state (no outputs), then runs the chain's rows (outputs). On a GPU one Triton
    launch (`_tree_schedule_kernel`, one program) computes what tree_schedule_reference's dozen PyTorch ops do, to
    the same integers.

causal_conv(x [B, T, C], weight [C, K], window [B, C, K-1], schedule) -> SiLU(conv) [B, T, C]
gated_delta_rule(mixed [B, T, C], a, b [B, T, Hv], A_log, dt_bias [Hv], dims, state, schedule, state_out=None)
        -> out [B, T, Hv, dv] in mixed's dtype
    mixed is the conv's output, channels [q (Hk dk) | k (Hk dk) | v (Hv dv)]; in the kernel, per row: q and k
    l2-normed (q scaled by dk ** -0.5), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the update from
    the row's parent's state, out = S^T q. state_out: where to write the state after the schedule's last row.
keep_recurrent(rows, state, window, path, accepted)
    Commit: the same kernel, run over the accepted path from the committed state, writes the new state in place
    (so it is bit for bit the verify pass's state of the last accepted row: one compiled kernel, the same
    arithmetic); the new conv window is gathered from the path's inputs.
gated_rmsnorm(x [..., dv], z [..., dv], weight [dv], eps) -> weight * rmsnorm(x) * silu(z), rounded as the reference.

_gated_delta_kernel: grid (B * Hv, dv / BV, chains). A program keeps a [dk, BV] tile of one head's state (a value
column evolves independently of the others) in registers, reads the committed tile once and walks its chain's
root-to-leaf path; loads run ahead (row indices three rows, inputs two, the next row's normalised k and gates beside
the current row's update). No per-node state ever leaves the chip: the verify pass writes only the rows' outputs, and
every row's state is computed exactly as a decode step computes it, one update per ancestor from the committed state.
So a decode step, a verify pass and commit's replay (a single chain each) run one compiled kernel whose arithmetic does
not depend on the tree (no argument that varies with the rows is specialised on): a verified row reproduces the decode
step bit for bit. The price is the replayed rows above each chain's head (at most the tree's depth per chain); the gain
is that programs of different chains run side by side, so the sequential length is the tree's depth, not its size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import next_pow2, tl, triton, triton_disabled


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


# ------------------------------------------------------------------------------------------------ the layer's path

TILE_COLUMNS, WARPS = 32, 1  # the state tile [dk, TILE_COLUMNS] of one program, and its warps (one config for all)
FP_FUSION = True  # FMA contraction in the recurrence (one compiled kernel serves decode, verify and replay either way)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass(frozen=True)
class DeltaDims:
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int


@dataclass
class TreeSchedule:
    """How one forward pass's rows are run by every Gated DeltaNet layer (built once per pass)."""
    parents: torch.Tensor | None   # [T]: each row's parent row, -1 above the root; None: a chain
    ancestors: torch.Tensor        # [T, K-1]: each row's conv ancestors, indices into cat(window slots, rows)
    paths: torch.Tensor            # [chains, D] int32: each chain's rows from the root down to its last row
    lengths: torch.Tensor          # [chains] int32: rows on the path (0: no chain in this slot)
    starts: torch.Tensor           # [chains] int32: the path index of the chain's head (earlier rows: replay only)


def _conv_ancestors(parents, T: int, kernel: int, device) -> torch.Tensor:
    if kernel > 1:
        return ancestor_rows(parents, T, kernel - 1, device)
    return torch.zeros(T, 0, dtype=torch.long, device=device)


def chain_schedule(T: int, kernel: int, device, path: torch.Tensor | None = None,
                   count: torch.Tensor | None = None) -> TreeSchedule:
    """One chain: T rows run one after the other from the committed state (a prompt, a DFlash block), or commit's
    accepted `path` of which `count` rows are replayed (no outputs)."""
    if path is None:
        return TreeSchedule(None, _conv_ancestors(None, T, kernel, device),
                            torch.arange(T, dtype=torch.int32, device=device)[None],
                            torch.full((1,), T, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int32, device=device))
    count = count.to(torch.int32).view(1)
    return TreeSchedule(None, _conv_ancestors(None, T, kernel, device), path.to(torch.int32)[None], count, count)


def tree_schedule(parents: torch.Tensor | None, node_mask: torch.Tensor | None, T: int, kernel: int, device,
                  max_depth: int = 15) -> TreeSchedule:
    """The schedule of T rows with these parents (node_mask[i, j]: row j is row i or an ancestor of it; max_depth:
    the deepest row's depth below a root). A row's first child (lowest index) continues its chain; every other
    child, and every root, heads a new one; each leaf ends one. All on the device (a CUDA graph may hold it): one
    Triton launch on a GPU (a verify pass builds it every round), the PyTorch reference elsewhere."""
    if parents is None:
        return chain_schedule(T, kernel, device)
    if _use_triton(parents):
        return tree_schedule_triton(parents, node_mask, T, kernel, max_depth)
    return tree_schedule_reference(parents, node_mask, T, kernel, device, max_depth)


def tree_schedule_reference(parents: torch.Tensor, node_mask: torch.Tensor, T: int, kernel: int, device,
                            max_depth: int = 15) -> TreeSchedule:
    ids = torch.arange(T, device=device)
    mask = node_mask.bool()
    depth = mask.long().sum(1) - 1
    child = parents[None, :] == ids[:, None]                                # [i, j]: j is a child of i
    first_child = torch.where(child, ids[None, :], T).min(1).values
    heads = (parents < 0) | (first_child.index_select(0, parents.clamp(min=0)) != ids)
    start = torch.where(mask, (depth * heads)[None, :], 0).max(1).values    # the depth of each row's chain head
    D = max_depth + 1
    column = torch.where(mask & (depth < D)[None, :], depth[None, :], D)     # a row's path: its ancestors by depth
    paths = torch.zeros(T, D + 1, dtype=torch.int32, device=device)
    paths.scatter_(1, column, ids.to(torch.int32).expand(T, T).contiguous())
    leaf = ~child.any(1)
    return TreeSchedule(parents, _conv_ancestors(parents, T, kernel, device), paths[:, :D].contiguous(),
                        torch.where(leaf, depth + 1, 0).to(torch.int32), start.to(torch.int32))


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and not triton_disabled()


def delta_inputs(mixed, a, b, A_log, dt_bias, dims: DeltaDims):
    """The delta rule's float32 inputs from the conv's output and the gate projections (the references' path):
    q, k [B, T, Hv, dk] (l2-normed, q scaled; key heads repeated for their value heads), v [B, T, Hv, dv], g, beta."""
    B, T, _ = mixed.shape
    keys = dims.key_heads * dims.key_dim
    q, k, v = mixed.split([keys, keys, dims.value_heads * dims.value_dim], dim=-1)
    q = l2norm(q.reshape(B, T, dims.key_heads, dims.key_dim).float()) * dims.key_dim ** -0.5
    k = l2norm(k.reshape(B, T, dims.key_heads, dims.key_dim).float())
    groups = dims.value_heads // dims.key_heads
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    v = v.reshape(B, T, dims.value_heads, dims.value_dim)
    beta = b.float().sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q, k, v, g, beta


def causal_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    if _use_triton(x):
        return causal_conv_triton(x, weight, window, schedule.ancestors)
    return tree_causal_conv_reference(x, weight, window, schedule.parents)


def gated_delta_rule(mixed, a, b, A_log, dt_bias, dims: DeltaDims, state: torch.Tensor, schedule: TreeSchedule,
                     state_out: torch.Tensor | None = None) -> torch.Tensor:
    if _use_triton(mixed):
        out = torch.empty(*mixed.shape[:2], dims.value_heads, dims.value_dim, dtype=mixed.dtype, device=mixed.device)
        gated_delta_triton(mixed, a, b, A_log, dt_bias, dims, state, schedule, out, state_out)
        return out
    q, k, v, g, beta = delta_inputs(mixed, a, b, A_log, dt_bias, dims)
    out, last = tree_gated_delta_reference(q, k, v, g, beta, schedule.parents, state)
    if state_out is not None:
        state_out.copy_(last)
    return out.to(mixed.dtype)


@dataclass
class RecurrentRows:
    """What a forward pass over new rows leaves for commit: the conv's inputs and the delta rule's (the conv's
    output and the gate projections), the layer's parameters and dims."""
    conv_in: torch.Tensor      # [B, T, channels]
    mixed: torch.Tensor        # [B, T, channels]
    a: torch.Tensor            # [B, T, heads]
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    dims: DeltaDims
    last_state: torch.Tensor | None = None  # after the last row of a chain (what keeping a whole prompt commits)

    def row(self, b: int) -> "RecurrentRows":
        """Batch row b's rows alone (views)."""
        one = slice(b, b + 1)
        return RecurrentRows(self.conv_in[one], self.mixed[one], self.a[one], self.b[one], self.A_log, self.dt_bias,
                             self.dims, None if self.last_state is None else self.last_state[one])


def path_schedule(path: torch.Tensor, accepted: torch.Tensor) -> TreeSchedule:
    """Commit's schedule: the accepted path (root first, `accepted` entries real) replayed as one chain. Built once
    per commit for all layers."""
    return chain_schedule(path.shape[0], 1, path.device, path, accepted)


def keep_recurrent(rows: RecurrentRows, state: torch.Tensor, window: torch.Tensor, path: torch.Tensor,
                   accepted: torch.Tensor, schedule: TreeSchedule | None = None) -> None:
    """Set state and window in place to those after the accepted path (root first, `accepted` entries real)."""
    if _use_triton(state):
        keep_window_triton(rows.conv_in, window, path, accepted)
        gated_delta_triton(rows.mixed, rows.a, rows.b, rows.A_log, rows.dt_bias, rows.dims, state,
                           schedule or path_schedule(path, accepted), None, state)
        return
    window.copy_(conv_window(rows.conv_in, window, path, accepted))
    _, k, v, g, beta = delta_inputs(rows.mixed, rows.a, rows.b, rows.A_log, rows.dt_bias, rows.dims)
    state.copy_(replay_gated_delta(state, k, v, g, beta, path, accepted))


def gated_rmsnorm_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' gated RMSNorm: weight * rmsnorm(x) (rounded to x's dtype) * silu(z) in float32, rounded."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, T, H, D] (contiguous), z [B, T, H * D] (rows may be strided) -> [B, T, H, D]."""
    if _use_triton(x):
        return gated_rmsnorm_triton(x, z, weight, eps)
    return gated_rmsnorm_reference(x, z.reshape(x.shape), weight, eps)


# ------------------------------------------------------------------------------------------------ Triton kernels

if triton is not None:
    @triton.jit
    def _delta_row(mixed, a_ptr, b_ptr, b, r, s_mb, s_mt, s_ab, s_at, s_bb, s_bt, h, kh, rk, rv, mk, mv, q_len,
                   KH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
        row = mixed + b * s_mb + r * s_mt
        q = tl.load(row + kh * DK + rk, mask=rk < q_len, other=0.0).to(tl.float32)  # 0: a replayed row, no q
        k = tl.load(row + (KH + kh) * DK + rk, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KH * DK + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        ga = tl.load(a_ptr + b * s_ab + r * s_at + h).to(tl.float32)
        gb = tl.load(b_ptr + b * s_bb + r * s_bt + h).to(tl.float32)
        return q, k, v, ga, gb

    @triton.jit
    def _delta_gates(k, ga, gb, neg_a, bias):
        """A row's l2-normed k, its decay exp(g) and beta."""
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        beta = 1.0 / (1.0 + tl.exp(-gb))
        x = ga + bias
        g = neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        return k, tl.exp(g), beta

    @triton.jit(do_not_specialize=["s_mb", "s_mt", "s_ab", "s_at", "s_bb", "s_bt", "s_ob", "s_ot", "s_path",
                                   "write_state"])
    def _gated_delta_kernel(mixed, a_ptr, b_ptr, A_log, dt_bias, state, state_out, out, paths, lengths, starts,
                            s_mb, s_mt, s_ab, s_at, s_bb, s_bt, s_ob, s_ot, s_path, write_state, scale,
                            KH: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            DKP: tl.constexpr, BV: tl.constexpr):
        bh = tl.program_id(0)
        chain = tl.program_id(2)
        n = tl.load(lengths + chain)
        if n > 0:
            b = (bh // HV).to(tl.int64)
            h = bh % HV
            kh = h // (HV // KH)
            rk = tl.arange(0, DKP)
            rv = tl.program_id(1) * BV + tl.arange(0, BV)
            mk = rk < DK
            mv = rv < DV
            tile = (bh * DK + rk[:, None]) * DV + rv[None, :]
            tmask = mk[:, None] & mv[None, :]
            cur = tl.load(state + tile, mask=tmask, other=0.0)
            neg_a = -tl.exp(tl.load(A_log + h).to(tl.float32))
            bias = tl.load(dt_bias + h).to(tl.float32)
            first = tl.load(starts + chain)
            path = paths + chain * s_path
            r = tl.load(path).to(tl.int64)
            r1 = tl.load(path + tl.minimum(1, n - 1)).to(tl.int64)
            r2 = tl.load(path + tl.minimum(2, n - 1)).to(tl.int64)
            q, k, v, ga, gb = _delta_row(mixed, a_ptr, b_ptr, b, r, s_mb, s_mt, s_ab, s_at, s_bb, s_bt, h, kh, rk,
                                         rv, mk, mv, tl.where(first <= 0, DK, 0), KH, DK, DV)
            k, decay, beta = _delta_gates(k, ga, gb, neg_a, bias)
            q1, k1, v1, a1, b1 = _delta_row(mixed, a_ptr, b_ptr, b, r1, s_mb, s_mt, s_ab, s_at, s_bb, s_bt, h, kh, rk,
                                            rv, mk, mv, tl.where(first <= 1, DK, 0), KH, DK, DV)
            for d in range(0, n):
                # Pipelined: the row index three ahead, the raw inputs two ahead, and the next row's normalised k and
                # gates from inputs that arrived during the previous row: independent work beside this row's update.
                r3 = tl.load(path + tl.minimum(d + 3, n - 1)).to(tl.int64)
                q2, k2, v2, a2, b2 = _delta_row(
                    mixed, a_ptr, b_ptr, b, r2, s_mb, s_mt, s_ab, s_at, s_bb, s_bt, h, kh, rk, rv, mk, mv,
                    tl.where(d + 2 >= first, DK, 0), KH, DK, DV)
                k1n, decay1, beta1 = _delta_gates(k1, a1, b1, neg_a, bias)
                s = cur * decay
                remembered = tl.sum(s * k[:, None], axis=0)
                delta = (v - remembered) * beta
                cur = s + k[:, None] * delta[None, :]
                if d >= first:  # replayed rows above the chain's head have no output
                    q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
                    o = tl.sum(cur * q[:, None], axis=0)
                    tl.store(out + b * s_ob + r * s_ot + h * DV + rv, o.to(out.dtype.element_ty), mask=mv)
                r, r1, r2 = r1, r2, r3
                q, k, v, decay, beta = q1, k1n, v1, decay1, beta1
                q1, k1, v1, a1, b1 = q2, k2, v2, a2, b2
            if write_state != 0:
                tl.store(state_out + tile, cur, mask=tmask)

    @triton.jit
    def _tree_schedule_kernel(parents, mask, s_mask, scratch, ancestors, paths, lengths, starts, T, D,
                              K1: tl.constexpr, TP: tl.constexpr, BR: tl.constexpr):
        """One program: every row's depth and first child (into scratch), then by blocks of BR rows the chain
        heads, paths, lengths and conv ancestors, as tree_schedule_reference computes them."""
        cols = tl.arange(0, TP)
        cm = cols < T
        par = tl.load(parents + cols, mask=cm, other=-2)  # -2: past the rows, nobody's child
        for r0 in range(0, T, BR):
            rows = r0 + tl.arange(0, BR)
            rm = rows < T
            m = tl.load(mask + rows[:, None] * s_mask + cols[None, :], mask=rm[:, None] & cm[None, :], other=0) != 0
            tl.store(scratch + rows, tl.sum(m.to(tl.int32), axis=1) - 1, mask=rm)
            child = par[None, :] == rows[:, None]
            tl.store(scratch + TP + rows, tl.min(tl.where(child, cols[None, :], T), axis=1), mask=rm)
        tl.debug_barrier()
        depth = tl.load(scratch + cols, mask=cm, other=-1)
        first_of_parent = tl.load(scratch + TP + tl.maximum(par, 0), mask=cm, other=0)
        head_depth = tl.where((par < 0) | (first_of_parent != cols), depth, 0)
        for r0 in range(0, T, BR):
            rows = r0 + tl.arange(0, BR)
            rm = rows < T
            m = tl.load(mask + rows[:, None] * s_mask + cols[None, :], mask=rm[:, None] & cm[None, :], other=0) != 0
            tl.store(starts + rows, tl.max(tl.where(m, head_depth[None, :], 0), axis=1), mask=rm)
            leaf = tl.load(scratch + TP + rows, mask=rm, other=0) == T
            tl.store(lengths + rows, tl.where(leaf, tl.load(scratch + rows, mask=rm, other=0) + 1, 0), mask=rm)
            for d in range(0, D):  # a row's path: the ancestor (or itself) at each depth
                at = m & (depth[None, :] == d)
                tl.store(paths + rows * D + d, tl.max(tl.where(at, cols[None, :], 0), axis=1), mask=rm)
            cur = rows + K1  # an index into [window slots, rows], walked up K1 times
            for i in tl.static_range(K1):
                p = tl.load(parents + cur - K1, mask=rm & (cur >= K1), other=0)
                cur = tl.where(cur < K1, tl.maximum(cur - 1, 0), tl.where(p < 0, K1 - 1, p + K1))
                tl.store(ancestors + rows * K1 + i, cur.to(tl.int64), mask=rm)

    @triton.jit
    def _causal_conv_kernel(x, window, weight, anc, y, T, C, s_xb, s_xt, s_wb, s_wc, s_yb, s_yt,
                            K: tl.constexpr, BLOCK_C: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        b = pid // T
        t = pid % T
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        m = c < C
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):  # oldest input first, as conv1d sums them
            i = K - 1 - j             # the input's distance up the row's path (0: its own)
            if i == 0:
                val = tl.load(x + b * s_xb + t * s_xt + c, mask=m, other=0.0)
            else:
                e = tl.load(anc + t * (K - 1) + i - 1) + tl.zeros([BLOCK_C], dtype=tl.int64)
                above = e < K - 1     # the committed window's slot e
                wv = tl.load(window + b * s_wb + c * s_wc + e, mask=m & above, other=0.0)
                xv = tl.load(x + b * s_xb + (e - (K - 1)) * s_xt + c, mask=m & (e >= K - 1), other=0.0)
                val = tl.where(above, wv.to(xv.dtype), xv)
            acc = acc + val.to(tl.float32) * tl.load(weight + c * K + j, mask=m, other=0.0).to(tl.float32)
        acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y + b * s_yb + t * s_yt + c, acc.to(y.dtype.element_ty), mask=m)

    @triton.jit
    def _keep_window_kernel(x, window, path, accepted, C, s_xb, s_xt, s_wb, s_wc,
                            K1: tl.constexpr, K1P: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        j = tl.arange(0, K1P)
        e = tl.load(accepted) + j     # entries accepted .. accepted + K1 - 1 of [window, path]
        real = j < K1
        above = e < K1
        row = tl.load(path + (e - K1), mask=real & (e >= K1), other=0)
        m = (c < C)[:, None] & real[None, :]
        wv = tl.load(window + b * s_wb + c[:, None] * s_wc + e[None, :], mask=m & above[None, :], other=0.0)
        xv = tl.load(x + b * s_xb + row[None, :] * s_xt + c[:, None], mask=m & (e >= K1)[None, :], other=0.0)
        tl.store(window + b * s_wb + c[:, None] * s_wc + j[None, :],
                 tl.where(above[None, :], wv, xv.to(wv.dtype)), mask=m)

    @triton.jit
    def _gated_rmsnorm_kernel(x, z, w, y, HV, s_zt, eps, D: tl.constexpr, DP: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = pid // HV
        h = pid % HV
        d = tl.arange(0, DP)
        m = d < D
        xv = tl.load(x + pid * D + d, mask=m, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(xv * xv, axis=0) / D + eps)
        normed = (xv * inv).to(y.dtype.element_ty)
        p = (tl.load(w + d, mask=m, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(y.dtype.element_ty)
        zv = tl.load(z + t * s_zt + h * D + d, mask=m, other=0.0).to(tl.float32)
        out = p.to(tl.float32) * (zv / (1.0 + tl.exp(-zv)))
        tl.store(y + pid * D + d, out.to(y.dtype.element_ty), mask=m)


def gated_delta_triton(mixed, a, b, A_log, dt_bias, dims: DeltaDims, state, schedule: TreeSchedule,
                       out: torch.Tensor | None, state_out: torch.Tensor | None) -> None:
    """The kernel over the schedule's chains: outputs into out [B, T, Hv, dv] (None: discarded), the state after a
    single chain's last row into state_out (None: not written; it may be `state`)."""
    B, T, _ = mixed.shape
    bv = min(TILE_COLUMNS, next_pow2(dims.value_dim))
    o = out if out is not None else mixed.new_empty(B, T, dims.value_heads, dims.value_dim)
    paths = schedule.paths
    _gated_delta_kernel[(B * dims.value_heads, triton.cdiv(dims.value_dim, bv), paths.shape[0])](
        mixed, a, b, A_log, dt_bias, state, state if state_out is None else state_out, o, paths, schedule.lengths,
        schedule.starts, mixed.stride(0), mixed.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        o.stride(0), o.stride(1), paths.stride(0), int(state_out is not None), dims.key_dim ** -0.5,
        KH=dims.key_heads, HV=dims.value_heads, DK=dims.key_dim, DV=dims.value_dim, DKP=next_pow2(dims.key_dim),
        BV=bv, num_warps=WARPS, enable_fp_fusion=FP_FUSION)


def tree_schedule_triton(parents: torch.Tensor, node_mask: torch.Tensor, T: int, kernel: int, max_depth: int = 15
                         ) -> TreeSchedule:
    """tree_schedule_reference in one launch (it is a dozen small PyTorch kernels and as many gaps)."""
    device = parents.device
    mask = node_mask if node_mask.dtype != torch.bool else node_mask.view(torch.uint8)
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    D, K1, TP = max_depth + 1, max(kernel - 1, 0), next_pow2(T)
    scratch = torch.empty(2 * TP, dtype=torch.int32, device=device)
    ancestors = torch.empty(T, K1, dtype=torch.long, device=device)
    paths = torch.empty(T, D, dtype=torch.int32, device=device)
    lengths = torch.empty(T, dtype=torch.int32, device=device)
    starts = torch.empty(T, dtype=torch.int32, device=device)
    _tree_schedule_kernel[(1,)](parents, mask, mask.stride(0), scratch, ancestors, paths, lengths, starts, T, D,
                                K1=K1, TP=TP, BR=min(TP, 16), num_warps=4)
    return TreeSchedule(parents, ancestors, paths, lengths, starts)


def causal_conv_triton(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, ancestors: torch.Tensor
                       ) -> torch.Tensor:
    B, T, C = x.shape
    K = weight.shape[1]
    y = torch.empty_like(x)
    block = min(1024, next_pow2(C))
    _causal_conv_kernel[(B * T, triton.cdiv(C, block))](
        x, window, weight.contiguous(), ancestors.contiguous(), y, T, C, x.stride(0), x.stride(1),
        window.stride(0), window.stride(1), y.stride(0), y.stride(1), K=K, BLOCK_C=block, num_warps=4,
        enable_fp_fusion=False)
    return y


def keep_window_triton(x: torch.Tensor, window: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
    B, _, C = x.shape
    K1 = window.shape[2]
    if K1 == 0:
        return
    block = min(256, next_pow2(C))
    _keep_window_kernel[(B, triton.cdiv(C, block))](
        x, window, path, accepted, C, x.stride(0), x.stride(1), window.stride(0), window.stride(1),
        K1=K1, K1P=next_pow2(K1), BLOCK_C=block, num_warps=4)


def gated_rmsnorm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    B, T, H, D = x.shape
    x = x.contiguous()
    if z.stride(-1) != 1 or (B > 1 and z.stride(0) != T * z.stride(1)):
        z = z.contiguous()
    y = torch.empty_like(x)
    _gated_rmsnorm_kernel[(B * T * H,)](x, z, weight, y, H, z.stride(1), eps, D=D, DP=next_pow2(D),
                                        num_warps=1 if D <= 256 else 4)
    return y
