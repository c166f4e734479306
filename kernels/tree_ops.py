"""DDTree round bookkeeping on the device: build the draft tree, walk it, compact the KV cache, commit the tokens.

Four functions of the decode loop (docs/design.md, "DDTree"), each in three forms:

- `*_reference`: plain PyTorch / Python, readable; the CPU path and the tests' oracle (reads values on the host).
- `*_triton`: a Triton kernel. No host synchronisation, no Python control flow on tensor values, outputs of
  static shapes written on the device: safe to capture in a CUDA graph and replay with new inputs copied in place.
  They take optional `out=` tensors. Under TRITON_INTERPRET=1 they also run on CPU tensors (tests).
- the dispatcher (`build_tree`, `walk_tree`, `compact_kv`, `commit_tokens`): the kernel for CUDA tensors, else the
  reference. `ENGINE_DISABLE_TRITON=1` in the environment (read at each call) forces the reference.

build_tree(topk_logp [Dp, K] f32, topk_ids [Dp, K] i64, budget) -> tokens, parents, depths, visible, count
    (batched decoding: [B, Dp, K] inputs, one tree per sequence, every output with a leading B; walk_tree likewise)
    Best-first selection (docs/design.md) with float32 scores: a candidate is
    (depth index d, rank r, parent p, score); start (0, 0, root, logp[0][0]); the best candidate (ties: the one
    pushed first) becomes node n = 1, 2, ...; it pushes its sibling (d, r+1, p, score - logp[d][r] + logp[d][r+1])
    if r+1 < K, then its child (d+1, 0, n, score + logp[d+1][0]) if d+1 < Dp; stop at `budget` nodes or when no
    candidate is left. Outputs have fixed sizes: tokens/parents/depths [budget] (node i+1 at index i; parents index
    [root=0, nodes 1..budget]; depth of the root 0), visible [budget+1, budget+1] (ancestor-or-self over
    [root, nodes]), count 0-d (real nodes). Padding for nodes past count: token 0, parent -1, depth 0, visible row =
    only the diagonal (no real node sees a padded one).

walk_tree(posterior [N+1], tokens [N], parents [N], count, max_depth) -> path [max_depth+1], accepted, bonus
    cur = root; while a real node c (1 <= c <= count) has parent(c) == cur and token(c) == posterior[cur]: cur = c
    (at most max_depth steps). path lists the accepted nodes, root first, padded with 0; accepted counts them
    (root included, >= 1); bonus = posterior[last accepted node].

compact_kv(k, v, start, path, accepted)
    k, v [L, B, KVH, CAP, Dh] (every layer in one tensor, last dim contiguous): for i < accepted, row start+i <-
    row start+path[i], in place, all layers in one launch. Batch rows that are separate sequences (batched decoding)
    each have their own: start [B], path [B, P], accepted [B].

commit_tokens(path [P], accepted, bonus, ids [N+1], start, tokens [C], round_out [1+P], n_features=None)
    After the walk (one sequence; every tensor on one device, 0-d values as tensors, all int64): the round's new
    tokens new[i] = ids[path[i+1]] for i < accepted - 1, new[accepted - 1] = bonus, 0 past accepted; then
    tokens[start + 1 + i] = new[i] for i < P, round_out = [accepted, new...], n_features = accepted (if given) and,
    last, start += accepted, in place. The eleven small PyTorch kernels of this bookkeeping in one launch.

Kernel designs
--------------
build_tree: one program, one warp. The candidate set lives in a register vector of CAP = next_pow2(budget + 2)
int64 keys; a key packs (score as an order-preserving int32) << 32 | (inverted push number) << CODE_BITS | code,
so a single max reduction picks the best score and, among equal scores, the earliest push. The push number is
virtual: node n pushes 2n-1 (sibling) and 2n (child), the start candidate is 0; that is the host's push order with
gaps. code = parent * (Dp*K) + d*K + r identifies the candidate, so the popped key alone gives the next loads
(when the bits do not fit in 32, a second reduction over a separate code vector fetches it: same results,
slower). The popped slot takes the sibling, slot n takes the child (slot n is never used before iteration n).
Node (d*K + r, parent, depth) go into register vectors; after the loop tokens are gathered from topk_ids and all
outputs stored at once. The visible mask: fill [budget+1]^2 with zeros (flat, vector stores), barrier, then
scatter the diagonal, and every real node walks up its ancestors (Dp gathers from the stored parents) scattering
True into its row.

walk_tree: one program. First, in parallel, node c is "good" if it is real and token(c) == posterior[parent(c)].
The accepted path is then the chain of good nodes from the root (siblings have distinct tokens, so a node has at
most one good child): max_depth steps of one max reduction each.

commit_tokens: one program, one warp: vector loads of path and the nodes' ids, vector stores, then (after a
barrier: every thread has read start) the new start.

compact_kv: grid (L * B * KVH, Dh chunks); each program loops i = 0..P-1 in order over its row chunk of k and v,
copying row start+path[i] to start+i when i < accepted and path[i] != i. Rows only move down and a row written at
step i is never a later source, so in-order copying inside a program is exact; the same thread owns the same
column at every step. Programs never touch each other's rows.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch

from kernels import row_values, tl, triton, triton_disabled

__all__ = [
    "build_tree", "build_tree_reference", "build_tree_triton",
    "walk_tree", "walk_tree_reference", "walk_tree_triton",
    "compact_kv", "compact_kv_reference", "compact_kv_triton",
    "commit_tokens", "commit_tokens_reference", "commit_tokens_triton",
    "triton_disabled",
]


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and not triton_disabled()


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _deliver(result, out, specs, device):
    """A reference's host results, on the inputs' device: new tensors, or copied into `out`."""
    if out is None:
        return tuple(t.to(device) for t in result)
    out = _check_out(out, specs, device)
    for o, t in zip(out, result):
        o.copy_(t)
    return out


def _check_out(out, specs, device):
    """out: None or a tuple of tensors matching specs [(shape, dtype)]; returns the tensors to write."""
    if out is None:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)
    out = tuple(out)
    if len(out) != len(specs):
        raise ValueError(f"out must hold {len(specs)} tensors, got {len(out)}")
    for t, (shape, dtype) in zip(out, specs):
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != torch.device(device) \
                or not t.is_contiguous():
            raise ValueError(f"out tensor {tuple(t.shape)} {t.dtype} on {t.device}: expected contiguous "
                             f"{tuple(shape)} {dtype} on {device}")
    return out


def _build_specs(budget: int, batch: tuple = ()):
    return [(batch + (budget,), torch.long), (batch + (budget,), torch.long), (batch + (budget,), torch.long),
            (batch + (budget + 1, budget + 1), torch.bool), (batch, torch.long)]


def _walk_specs(max_depth: int, batch: tuple = ()):
    return [(batch + (max_depth + 1,), torch.long), (batch, torch.long), (batch, torch.long)]


def _stack_rows(rows: list[tuple]) -> tuple:
    """Per-sequence results of a reference, stacked along a new batch dimension."""
    return tuple(torch.stack(parts) for parts in zip(*rows))


def _check_build_inputs(topk_logp, topk_ids, budget):
    if topk_logp.dim() not in (2, 3) or topk_ids.shape != topk_logp.shape:
        raise ValueError(f"expected topk_logp and topk_ids [Dp, K] (or [B, Dp, K]), got {tuple(topk_logp.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    if topk_logp.dtype != torch.float32 or topk_ids.dtype != torch.long:
        raise ValueError(f"expected float32 topk_logp and int64 topk_ids, got {topk_logp.dtype}, {topk_ids.dtype}")
    if topk_logp.device != topk_ids.device:
        raise ValueError("topk_logp and topk_ids must be on the same device")
    if int(budget) != budget or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget}")
    if topk_logp.shape[-2] < 1 or topk_logp.shape[-1] < 1:
        raise ValueError(f"need at least one depth and one rank, got {tuple(topk_logp.shape)}")


# ==================================================================================================== references

def build_tree_reference(topk_logp: torch.Tensor, topk_ids: torch.Tensor, budget: int, out=None):
    """Best-first tree selection with a heap, float32 scores (numpy.float32 scalars) and push-order tie-breaking.
    [B, Dp, K] inputs: one tree per sequence, outputs with a leading B."""
    _check_build_inputs(topk_logp, topk_ids, budget)
    if topk_logp.dim() == 3:
        rows = _stack_rows([build_tree_reference(lp, ids, budget) for lp, ids in zip(topk_logp, topk_ids)])
        return _deliver(rows, out, _build_specs(budget, topk_logp.shape[:1]), topk_logp.device)
    Dp, K = topk_logp.shape
    logp = topk_logp.detach().cpu().numpy().astype(np.float32, copy=False)
    ids = topk_ids.detach().cpu().tolist()
    tokens, parents, depths = [], [], []
    heap = [(-logp[0, 0], 0, 0, 0, 0)]  # (-score, push number, depth index, rank, parent)
    pushed = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        score = -neg
        tokens.append(ids[d][r])
        parents.append(parent)
        depths.append(d + 1)
        node = len(tokens)
        if r + 1 < K:
            heapq.heappush(heap, (-(score - logp[d, r] + logp[d, r + 1]), pushed, d, r + 1, parent))
            pushed += 1
        if d + 1 < Dp:
            heapq.heappush(heap, (-(score + logp[d + 1, 0]), pushed, d + 1, 0, node))
            pushed += 1
    n = len(tokens)
    pad = budget - n
    visible = torch.eye(budget + 1, dtype=torch.bool)
    for i, parent in enumerate(parents, start=1):
        visible[i] = visible[parent]
        visible[i, i] = True
    result = (torch.tensor(tokens + [0] * pad, dtype=torch.long), torch.tensor(parents + [-1] * pad, dtype=torch.long),
              torch.tensor(depths + [0] * pad, dtype=torch.long), visible, torch.tensor(n, dtype=torch.long))
    dev = topk_logp.device
    return _deliver(result, out, _build_specs(budget), dev)


def walk_tree_reference(posterior: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, count, max_depth: int,
                        out=None):
    """Follow the target's greedy choices from the root through the real nodes (at most max_depth steps). Batched
    inputs ([B, N+1], [B, N], [B, N], [B]): one walk per sequence, outputs with a leading B."""
    if posterior.dim() == 2:
        counts = (count if isinstance(count, torch.Tensor) else torch.tensor(count)).reshape(-1).expand(len(posterior))
        rows = _stack_rows([walk_tree_reference(*row, max_depth) for row in zip(posterior, tokens, parents, counts)])
        return _deliver(rows, out, _walk_specs(max_depth, posterior.shape[:1]), posterior.device)
    post = posterior.detach().cpu().tolist()
    toks = tokens.detach().cpu().tolist()
    pars = parents.detach().cpu().tolist()
    n = min(int(count), len(toks))
    path = [0]
    while len(path) <= max_depth:
        cur = path[-1]
        nxt = [c for c in range(1, n + 1) if pars[c - 1] == cur and toks[c - 1] == post[cur]]
        if not nxt:
            break
        path.append(nxt[0])
    accepted = len(path)
    result = (torch.tensor(path + [0] * (max_depth + 1 - accepted), dtype=torch.long),
              torch.tensor(accepted, dtype=torch.long), torch.tensor(post[path[-1]], dtype=torch.long))
    dev = posterior.device
    return _deliver(result, out, _walk_specs(max_depth), dev)


def compact_kv_reference(k: torch.Tensor, v: torch.Tensor, start, path: torch.Tensor, accepted) -> None:
    """Rows start+path[i] -> start+i for i < accepted, in every layer/batch/head of k and v (gather, then write:
    the same as copying in order, since no source row is overwritten before it is read). Batch rows that are separate
    sequences have their own start [B], path [B, P] and accepted [B]."""
    B = k.shape[1]
    starts, accs = row_values(start, B), row_values(accepted, B, "accepted")
    if path.dim() == 2 or len(set(starts)) > 1 or len(set(accs)) > 1:  # sequences apart: one row at a time
        paths = path if path.dim() == 2 else path.expand(B, -1)
        for b in range(B):
            compact_kv_reference(k[:, b:b + 1], v[:, b:b + 1], starts[b], paths[b], accs[b])
        return
    s, a = starts[0], accs[0]
    src = path[:a].to(device=k.device, dtype=torch.long) + s
    for t in (k, v):
        t[:, :, :, s:s + a] = t.index_select(3, src)


def _check_commit(path, accepted, bonus, ids, start, tokens, round_out, n_features):
    P = path.shape[0] if path.dim() == 1 else -1
    if P < 1 or ids.dim() != 1 or tokens.dim() != 1 or tuple(round_out.shape) != (1 + P,):
        raise ValueError(f"expected path [P >= 1], ids [N+1], tokens [C] and round_out [1+P]; got {tuple(path.shape)}, "
                         f"{tuple(ids.shape)}, {tuple(tokens.shape)}, {tuple(round_out.shape)}")
    scalars = [accepted, bonus, start] + ([] if n_features is None else [n_features])
    if any(t.numel() != 1 for t in scalars):
        raise ValueError("accepted, bonus, start and n_features must hold one value each")
    tensors = [path, ids, tokens, round_out] + scalars
    if any(t.dtype != torch.long for t in tensors) or len({t.device for t in tensors}) != 1:
        raise ValueError("commit_tokens takes int64 tensors on one device")


def commit_tokens_reference(path: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, ids: torch.Tensor,
                            start: torch.Tensor, tokens: torch.Tensor, round_out: torch.Tensor,
                            n_features: torch.Tensor | None = None) -> None:
    """Plain PyTorch (no host read): see the module docstring."""
    _check_commit(path, accepted, bonus, ids, start, tokens, round_out, n_features)
    i = torch.arange(path.shape[0], device=path.device)
    nodes = ids.index_select(0, torch.cat((path[1:], path[:1])))  # ids[path[i + 1]]; the last entry is padding
    new = torch.where(i < accepted - 1, nodes, torch.where(i == accepted - 1, bonus, torch.zeros_like(nodes)))
    tokens.index_copy_(0, start.reshape(1) + 1 + i, new)
    round_out.copy_(torch.cat((accepted.reshape(1), new)))
    if n_features is not None:
        n_features.copy_(accepted.reshape(n_features.shape))
    start.add_(accepted.reshape(start.shape))


# ==================================================================================================== kernels

if triton is not None:
    @triton.jit
    def _sortable(score):
        """float32 -> int32 with the same order (signed compare); -0.0 is mapped like +0.0."""
        score = tl.where(score == 0.0, 0.0, score)
        b = score.to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _unsortable(s):
        b = s ^ ((s >> 31) & 0x7FFFFFFF)
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _build_tree_kernel(logp_ptr, ids_ptr, tokens_ptr, parents_ptr, depths_ptr, visible_ptr, count_ptr,
                           DP: tl.constexpr, K: tl.constexpr, BUDGET: tl.constexpr, CAP: tl.constexpr,
                           NCAP: tl.constexpr, VMAX: tl.constexpr, CODE_BITS: tl.constexpr, PACKED: tl.constexpr,
                           FILL: tl.constexpr, WCAP: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)  # a batch of sequences: each program builds one tree
        logp_ptr += seq * DP * K
        ids_ptr += seq * DP * K
        tokens_ptr += seq * BUDGET
        parents_ptr += seq * BUDGET
        depths_ptr += seq * BUDGET
        visible_ptr += seq * (BUDGET + 1) * (BUDGET + 1)
        count_ptr += seq
        DK: tl.constexpr = DP * K
        EMPTY: tl.constexpr = -9223372036854775807 - 1
        CODE_MASK: tl.constexpr = (1 << CODE_BITS) - 1
        slot = tl.arange(0, CAP)
        nidx = tl.arange(0, NCAP)

        # the start candidate: (d 0, r 0, parent root), push number 0, in slot 0
        s0 = _sortable(tl.load(logp_ptr))
        vmax = tl.full([], VMAX, tl.int64)
        key0 = (s0.to(tl.int64) << 32) | (vmax << CODE_BITS)  # CODE_BITS is 0 when not PACKED; code 0
        keys = tl.where(slot == 0, key0, EMPTY)
        codes = tl.zeros([CAP], dtype=tl.int64)  # only read when not PACKED
        node_f = tl.zeros([NCAP], dtype=tl.int32)      # d*K + r of node index i (node i+1)
        node_p = tl.zeros([NCAP], dtype=tl.int32)      # parent
        node_d = tl.zeros([NCAP], dtype=tl.int32)      # depth index d
        count = tl.sum(tl.zeros([NCAP], dtype=tl.int32), axis=0)

        for it in range(BUDGET):
            best = tl.max(keys, axis=0)
            live = best != EMPTY          # once empty, always empty: live <=> node n = it + 1 exists
            hit = keys == best            # the popped slot (keys are unique)
            if PACKED:
                code = (best & CODE_MASK).to(tl.int32)
            else:
                code = tl.sum(tl.where(hit, codes, 0), axis=0).to(tl.int32)  # 0 when not live
            score = _unsortable((best >> 32).to(tl.int32))
            p = code // DK
            f = code - p * DK
            d = f // K
            r = f - d * K
            n = it + 1
            n64 = n.to(tl.int64)
            has_sib = live & (r + 1 < K)
            has_child = live & (d + 1 < DP)
            lp = tl.load(logp_ptr + f, mask=live, other=0.0)
            lp_next = tl.load(logp_ptr + f + 1, mask=has_sib, other=0.0)
            lp_child = tl.load(logp_ptr + (f - r + K), mask=has_child, other=0.0)
            sib_score = score - lp + lp_next
            child_score = score + lp_child
            sib_code = p * DK + f + 1
            child_code = n * DK + f - r + K
            sib_low = (vmax - (2 * n64 - 1)) << CODE_BITS
            child_low = (vmax - 2 * n64) << CODE_BITS
            if PACKED:
                sib_low = sib_low | sib_code.to(tl.int64)
                child_low = child_low | child_code.to(tl.int64)
            sib_key = (_sortable(sib_score).to(tl.int64) << 32) | sib_low
            child_key = (_sortable(child_score).to(tl.int64) << 32) | child_low
            pop = hit & (keys != EMPTY)  # the popped slot; nothing when not live
            keys = tl.where(pop, tl.where(has_sib, sib_key, EMPTY), keys)
            put_child = slot == tl.where(has_child, n, -1)
            keys = tl.where(put_child, child_key, keys)
            if not PACKED:
                codes = tl.where(pop, sib_code.to(tl.int64), codes)
                codes = tl.where(put_child, child_code.to(tl.int64), codes)
            at = nidx == tl.where(live, it, -1)
            node_f = tl.where(at, f, node_f)
            node_p = tl.where(at, p, node_p)
            node_d = tl.where(at, d, node_d)
            count += live.to(tl.int32)

        real = nidx < count
        inb = nidx < BUDGET
        toks = tl.load(ids_ptr + node_f, mask=real & inb, other=0)
        tl.store(tokens_ptr + nidx, toks, mask=inb)
        tl.store(parents_ptr + nidx, tl.where(real, node_p, -1).to(tl.int64), mask=inb)
        tl.store(depths_ptr + nidx, tl.where(real, node_d + 1, 0).to(tl.int64), mask=inb)
        tl.store(count_ptr, count.to(tl.int64))

        # visible: zeros, then the diagonal, then each real node's ancestors (root included) in its row
        W: tl.constexpr = BUDGET + 1
        FULL: tl.constexpr = (W * W) // FILL * FILL
        fa = tl.arange(0, FILL)
        zeros = tl.zeros([FILL], dtype=tl.int1)
        for e0 in range(0, FULL, FILL):  # flat, unmasked: vector stores
            tl.store(visible_ptr + tl.multiple_of(e0, FILL) + fa, zeros)
        if FULL < W * W:
            tl.store(visible_ptr + FULL + fa, zeros, mask=fa < W * W - FULL)
        tl.debug_barrier()  # the zeros and the parents are visible to every thread of the program
        wi = tl.arange(0, WCAP)
        tl.store(visible_ptr + wi * (W + 1), tl.full([WCAP], 1, dtype=tl.int1), mask=wi < W)  # the diagonal
        row = nidx + 1
        anc = tl.where(real & inb, row, 0)
        ones = tl.full([NCAP], 1, dtype=tl.int1)
        for _ in range(DP):
            up = anc >= 1
            anc = tl.load(parents_ptr + anc - 1, mask=up, other=-1).to(tl.int32)
            tl.store(visible_ptr + row * W + anc, ones, mask=up & (anc >= 0))

    @triton.jit
    def _walk_tree_kernel(post_ptr, tokens_ptr, parents_ptr, count_ptr, path_ptr, accepted_ptr, bonus_ptr,
                          N: tl.constexpr, NCAP: tl.constexpr, MAXD: tl.constexpr, PCAP: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)  # a batch of sequences: each program walks one tree
        post_ptr += seq * (N + 1)
        tokens_ptr += seq * N
        parents_ptr += seq * N
        count_ptr += seq
        path_ptr += seq * (MAXD + 1)
        accepted_ptr += seq
        bonus_ptr += seq
        idx = tl.arange(0, NCAP)
        cnt = tl.load(count_ptr)
        real = (idx < N) & (idx < cnt)
        tok = tl.load(tokens_ptr + idx, mask=real, other=0)
        par = tl.load(parents_ptr + idx, mask=real, other=-1)
        has_par = real & (par >= 0)
        want = tl.load(post_ptr + par, mask=has_par, other=-1)
        good = has_par & (tok == want)  # node idx+1 is the target's choice after its parent
        node = (idx + 1).to(tl.int64)
        pidx = tl.arange(0, PCAP)
        path = tl.zeros([PCAP], dtype=tl.int64)
        cur = tl.sum(tl.zeros([NCAP], dtype=tl.int64), axis=0)
        acc = tl.sum(tl.zeros([NCAP], dtype=tl.int64), axis=0) + 1
        for s in range(MAXD):
            c = tl.max(tl.where(good & (par == cur), node, 0), axis=0)
            step = c > 0
            cur = tl.where(step, c, cur)
            path = tl.where(pidx == tl.where(step, s + 1, -1), c, path)
            acc += step.to(tl.int64)
        tl.store(path_ptr + pidx, path, mask=pidx < MAXD + 1)
        tl.store(accepted_ptr, acc)
        tl.store(bonus_ptr, tl.load(post_ptr + cur))

    @triton.jit
    def _commit_tokens_kernel(path_ptr, accepted_ptr, bonus_ptr, ids_ptr, start_ptr, tokens_ptr, out_ptr, nf_ptr,
                              P: tl.constexpr, PCAP: tl.constexpr, HAS_NF: tl.constexpr):
        i = tl.arange(0, PCAP)
        accepted = tl.load(accepted_ptr)
        start = tl.load(start_ptr)
        node = tl.load(path_ptr + i + 1, mask=i + 1 < P, other=0)
        new = tl.load(ids_ptr + node, mask=i < accepted - 1, other=0)
        new = tl.where(i == accepted - 1, tl.load(bonus_ptr), new)
        tl.store(tokens_ptr + start + 1 + i, new, mask=i < P)
        tl.store(out_ptr + 1 + i, new, mask=i < P)
        tl.store(out_ptr, accepted)
        if HAS_NF:
            tl.store(nf_ptr, accepted)
        tl.debug_barrier()  # every thread has read start
        tl.store(start_ptr, start + accepted)

    @triton.jit
    def _compact_kv_kernel(k_ptr, v_ptr, start_ptr, path_ptr, accepted_ptr, s_start, s_path, s_acc,
                           sk_l, sk_b, sk_h, sk_r, sv_l, sv_b, sv_h, sv_r,
                           B: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, P: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        l = pid // (B * H)
        b = (pid // H) % B
        h = pid % H
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = offs < DH
        start = tl.load(start_ptr + b * s_start).to(tl.int64)  # strides 0: one sequence's values for all rows
        acc = tl.load(accepted_ptr + b * s_acc)
        kb = k_ptr + l * sk_l + b * sk_b + h * sk_h + offs
        vb = v_ptr + l * sv_l + b * sv_b + h * sv_h + offs
        for i in range(P):  # in order: see the module docstring
            pi = tl.load(path_ptr + b * s_path + i)
            m = tl.where((i < acc) & (pi != i), dm, False)
            src = start + pi
            dst = start + i
            kx = tl.load(kb + src * sk_r, mask=m)
            vx = tl.load(vb + src * sv_r, mask=m)
            tl.store(kb + dst * sk_r, kx, mask=m)
            tl.store(vb + dst * sv_r, vx, mask=m)


def _require_triton():
    if triton is None:
        raise RuntimeError("Triton is not installed")


def build_tree_triton(topk_logp: torch.Tensor, topk_ids: torch.Tensor, budget: int, out=None, _packed=None):
    """The Triton build_tree (one program per sequence, one launch). _packed=False forces the two-reduction variant
    (tests)."""
    _require_triton()
    _check_build_inputs(topk_logp, topk_ids, budget)
    batch = tuple(topk_logp.shape[:-2])
    Dp, K = topk_logp.shape[-2:]
    dev = topk_logp.device
    tokens, parents, depths, visible, count = _check_out(out, _build_specs(budget, batch), dev)
    logp = topk_logp.contiguous()
    ids = topk_ids.contiguous()
    v_bits = (2 * budget).bit_length()            # virtual push numbers 0..2*budget
    code_bits = max(1, ((budget + 1) * Dp * K - 1).bit_length())
    if code_bits > 31:
        raise ValueError(f"tree too large for the kernel: (budget + 1) * Dp * K = {(budget + 1) * Dp * K}")
    packed = v_bits + code_bits <= 32 if _packed is None else bool(_packed)
    if packed and v_bits + code_bits > 32:
        raise ValueError("the packed key does not fit")
    _build_tree_kernel[(batch[0] if batch else 1,)](
        logp, ids, tokens, parents, depths, visible.view(torch.uint8), count,
        DP=Dp, K=K, BUDGET=budget, CAP=_next_pow2(budget + 2), NCAP=max(2, _next_pow2(budget)),
        VMAX=(1 << v_bits) - 1, CODE_BITS=code_bits if packed else 0, PACKED=packed,
        FILL=min(4096, max(32, _next_pow2((budget + 1) ** 2) // 8)), WCAP=_next_pow2(budget + 1), num_warps=1)
    return tokens, parents, depths, visible, count


def walk_tree_triton(posterior: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, count: torch.Tensor,
                     max_depth: int, out=None):
    """The Triton walk_tree (one program per sequence, one launch)."""
    _require_triton()
    batch = tuple(tokens.shape[:-1])
    N = tokens.shape[-1]
    if tokens.dim() > 2 or posterior.shape != batch + (N + 1,) or parents.shape != batch + (N,) \
            or count.numel() != (batch[0] if batch else 1):
        raise ValueError(f"expected posterior [N+1], tokens and parents [N], count 0-d (or [B, N+1], [B, N], [B]); got "
                         f"{tuple(posterior.shape)}, {tuple(tokens.shape)}, {tuple(parents.shape)}, "
                         f"{tuple(count.shape)}")
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    dev = posterior.device
    path, accepted, bonus = _check_out(out, _walk_specs(max_depth, batch), dev)
    posterior = posterior.contiguous()
    if N == 0:  # nothing to read: pass a valid pointer for the (fully masked) node loads
        tokens = parents = posterior
    else:
        tokens, parents = tokens.contiguous(), parents.contiguous()
    _walk_tree_kernel[(batch[0] if batch else 1,)](
        posterior, tokens, parents, count.contiguous(), path, accepted, bonus, N=N, NCAP=max(2, _next_pow2(N)),
        MAXD=max_depth, PCAP=max(2, _next_pow2(max_depth + 1)), num_warps=1)
    return path, accepted, bonus


def compact_kv_triton(k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, path: torch.Tensor,
                      accepted: torch.Tensor) -> None:
    """The Triton compact_kv: every layer, batch and kv head of k and v in one launch; start, path and accepted one
    for all batch rows ([], [P], []) or one per row ([B], [B, P], [B])."""
    _require_triton()
    if k.dim() != 5 or v.shape != k.shape or k.dtype != v.dtype:
        raise ValueError(f"expected k = v [L, B, KVH, CAP, Dh] of one dtype, got {tuple(k.shape)} {k.dtype}, "
                         f"{tuple(v.shape)} {v.dtype}")
    if k.stride(4) != 1 or v.stride(4) != 1:
        raise ValueError("k and v need a contiguous last dimension")
    L, B, H, _, Dh = k.shape
    P = path.shape[-1]
    if path.dim() not in (1, 2) or P == 0 or (path.dim() == 2 and path.shape[0] != B):
        raise ValueError(f"path must be [P] or [{B}, P] with P >= 1, got {tuple(path.shape)}")
    for name, x in (("start", start), ("accepted", accepted)):
        if x.numel() not in (1, B):
            raise ValueError(f"{name} must hold one value or one per batch row ({B}), got {tuple(x.shape)}")
    if L * B * H * Dh == 0:
        return
    path = path.contiguous()
    block_d = min(128, _next_pow2(Dh))
    grid = (L * B * H, triton.cdiv(Dh, block_d))
    start, accepted = start.reshape(-1), accepted.reshape(-1)
    _compact_kv_kernel[grid](k, v, start, path, accepted, int(start.numel() > 1), path.stride(0) if path.dim() == 2
                             else 0, int(accepted.numel() > 1),
                             k.stride(0), k.stride(1), k.stride(2), k.stride(3),
                             v.stride(0), v.stride(1), v.stride(2), v.stride(3),
                             B=B, H=H, DH=Dh, P=P, BLOCK_D=block_d, num_warps=1 if block_d <= 128 else 2)


def commit_tokens_triton(path: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, ids: torch.Tensor,
                         start: torch.Tensor, tokens: torch.Tensor, round_out: torch.Tensor,
                         n_features: torch.Tensor | None = None) -> None:
    """The Triton commit_tokens (one program, one launch)."""
    _require_triton()
    _check_commit(path, accepted, bonus, ids, start, tokens, round_out, n_features)
    if tokens.stride(0) != 1 or round_out.stride(0) != 1:
        raise ValueError("tokens and round_out must be contiguous")
    P = path.shape[0]
    _commit_tokens_kernel[(1,)](path.contiguous(), accepted, bonus, ids.contiguous(), start, tokens, round_out,
                                start if n_features is None else n_features, P=P, PCAP=max(2, _next_pow2(P)),
                                HAS_NF=n_features is not None, num_warps=1)


# ==================================================================================================== dispatchers

def build_tree(topk_logp: torch.Tensor, topk_ids: torch.Tensor, budget: int, out=None):
    """DDTree best-first selection: the kernel on CUDA, else the reference. See the module docstring."""
    if _use_triton(topk_logp):
        return build_tree_triton(topk_logp, topk_ids, budget, out=out)
    return build_tree_reference(topk_logp, topk_ids, budget, out=out)


def walk_tree(posterior: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, count, max_depth: int,
              out=None):
    """The DDTree walk: the kernel on CUDA, else the reference. Returns (path, accepted, bonus)."""
    if _use_triton(posterior) and isinstance(count, torch.Tensor):
        return walk_tree_triton(posterior, tokens, parents, count, max_depth, out=out)
    return walk_tree_reference(posterior, tokens, parents, count, max_depth, out=out)


def compact_kv(k: torch.Tensor, v: torch.Tensor, start, path: torch.Tensor, accepted) -> None:
    """KV-cache compaction after the walk: the kernel on CUDA, else the reference."""
    if _use_triton(k) and isinstance(start, torch.Tensor) and isinstance(accepted, torch.Tensor):
        compact_kv_triton(k, v, start, path, accepted)
    else:
        compact_kv_reference(k, v, start, path, accepted)


def commit_tokens(path: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, ids: torch.Tensor,
                  start: torch.Tensor, tokens: torch.Tensor, round_out: torch.Tensor,
                  n_features: torch.Tensor | None = None) -> None:
    """A round's token bookkeeping after the walk: the kernel on CUDA, else the reference (module docstring)."""
    if _use_triton(path):
        commit_tokens_triton(path, accepted, bonus, ids, start, tokens, round_out, n_features)
    else:
        commit_tokens_reference(path, accepted, bonus, ids, start, tokens, round_out, n_features)
