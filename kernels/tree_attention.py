"""Tree-verify attention: T new query rows over a preallocated KV cache, with an ancestor mask among the new rows.

DDTree verifies a whole draft tree in one target pass. The queries are the tree's nodes (root = the bonus token,
then the draft nodes, every parent before its children); the keys are the committed cache rows 0..start-1 plus the
nodes' own rows start..start+T-1, which the caller has already written into the cache. Every node sees the whole
committed prefix; among the new rows, node i sees node j iff node_mask[i, j] (j is i or one of its ancestors).
Rows at or past start+T (stale rows of earlier rounds, unused capacity) are invisible. A linear block (DFlash
verify, a causal prefill chunk) is the special case of a lower-triangular mask, and T = 1 is plain decoding.

    out[b, h, i] = softmax_j( q[b, h, i] . k[b, h // G, j] / sqrt(D) ; j < start or node_mask[i, j - start] ) @ v

with G = H // KVH query heads per kv head (GQA), softmax and accumulation in float32, `out` in q's dtype. Batch rows
may be separate sequences (batched decoding): `start` is then one committed length per row [B] and node_mask one
tree per row [B, T, T]; a row's result does not depend on the rows beside it.

Three entry points:

- `tree_attention_reference`: plain PyTorch (scaled_dot_product_attention), for tests and the CPU path.
- `tree_attention_triton`: a flash-decoding style Triton kernel. `start` is read on the device, never on the host,
  and the launch grid depends only on static shapes, so the call can be captured in a CUDA graph and replayed
  with `start` changed in place.
- `tree_attention`: the dispatcher used by the engine (Triton on CUDA for T <= 128, else the reference).
  `ENGINE_DISABLE_TRITON=1` in the environment (read at each call) or `use_triton=False` forces the reference.

Kernel design (`_tree_attn_fwd`): grid (B * KVH, token groups, key splits). One program owns one kv head and TOK
tokens: its BLOCK_M = max(16, G_P2) rows hold TOK tokens' G query heads, G_P2 = next_pow2(G) rows each. TOK is 1,
or, in batched calls, as many as fit, BLOCK_M // G_P2: tl.dot needs 16 rows, so at G = 4 a
one-token program leaves 12 of them as padding, and each of a tree's tokens reads the whole prefix again. A token's
keys are taken in *logical order*: the committed rows 0..start-1, then its visible new rows in index order (a tree
lists every ancestor before its descendants), logical key start + j being the visible new row of rank j. The program
walks logical keys in BLOCK_N blocks (tl.dot for Q K^T and P V) with an online softmax in base 2 (running max,
running sum, unnormalised float32 accumulator). The blocks wholly inside the committed prefix are the same for every
token: one loop walks them once for all the program's rows, with plain addresses (their loads pipelined ahead).
Then, token by token, a second loop over the same block grid takes the blocks that reach the token's new rows,
gathering their K/V rows through the token's row list (`visible_rows(node_mask)`, built once per forward pass),
masking keys past the token's last one and keeping each block's result for that token's rows only.
So a token's arithmetic, block by block, is that of the one-token decode step at the same position: whether it is
verified alone, in a chain, or deep in a tree whose siblings sit between its ancestors, the result is the same bit
for bit (docs/design.md, "Exactness": then no divergence can happen at all). Earlier designs were not: tiles of
several tokens sharing the blocks that hold new rows, under a mask, put a tree node's ancestors at other offsets
inside a block (tokens now share only whole prefix blocks, where every key sits at the same offset for all of them),
and an earlier pair of loops for whole prefix blocks and masked blocks was compiled to differently-rounding code;
both made verification differ from decoding in the last bit on the H200 (a flipped near-tie on qwen3-8b). Today's
two loops share one block grid and run the same operations with FP contraction off, and the GPU test of verify
against decode checks their bits (it passed on the H200 at 1000 keys for chains, trees and 33-deep trees, with one
token and with packed tokens per program, 2026-12-04). Keys past start + T are never loaded.
Split s covers logical keys [s * SPLIT, (s + 1) * SPLIT); the number of splits is cdiv(CAP, SPLIT): it does not
depend on `start`. With one split the kernel normalises and writes `out` directly. Otherwise a split at or past the
bound min(start + T, CAP) exits at once; the others (the *active* splits) write partials (max,
sum, unnormalised acc; a split past one token's own keys writes a neutral partial, max -inf, sum 0, acc 0), then
count their arrival on the token group's counter (acq_rel), and the last to arrive merges the partials split by
split in split order (log-sum-exp; a neutral partial weighs exp2(-inf) = 0 and changes no bit, and a running max
of -inf is never subtracted from itself, so no NaN), writes `out` and resets the counter. One launch, no merge
kernel after it, and the result does not depend on which split finished last. A group whose keys fit one split
writes `out` directly too: merging a single partial with neutral ones gives the same bits, so decode (one active
split) and verify (maybe more, all but one neutral for that token) agree. The counters are shared by the calls on
a device (`kernels.arrival_counters`): calls on one stream run one after another. FP contraction is
off: every operation rounds as written. Launched with PDL, a program prefetches its split's committed K/V rows
into L2 before its wait (`start` read as a hint there and again after it; ENGINE_ATTN_PREFETCH=0 turns it off): the
rows from HBM arrive while the kernel before it stores the new ones. Each token's key count and the row list of
its first block past the prefix are loaded before the prefix walk, so that their latency overlaps it. The block
body is written inline rather than as a @triton.jit helper: under TRITON_INTERPRET=1 every device-function call
re-patches triton.language, which made the CPU tests several times slower.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels import (arrival_counters, bulk_prefetch_ok, env_switch, next_pow2, pdl_launch, pdl_options, pdl_wait,
                     prefetch_l2, row_values, tl, triton, triton_disabled)

BLOCK_N = 64        # keys per inner-loop block
SPLIT_SIZE = 512    # keys per split (a multiple of BLOCK_N)
MAX_TRITON_T = 128  # the dispatcher uses the kernel up to this many new rows
SMEM_FOR_STAGES = 160 * 1024  # bytes of K/V blocks in flight: the H200 has 227 KiB of shared memory per block
PACK_ROWS_X_KEYS = 65536  # one sequence's tokens share programs from T x capacity = this (docs/performance.md)


def _check_shapes(q, k_cache, v_cache, node_mask):
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [B, H, T, D] and k_cache = v_cache [B, KVH, CAP, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, H, T, D = q.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} disagree on batch or head_dim")
    if H % k_cache.shape[1] != 0:
        raise ValueError(f"query heads {H} not a multiple of kv heads {k_cache.shape[1]}")
    if tuple(node_mask.shape) not in ((T, T), (B, T, T)):
        raise ValueError(f"node_mask must be [{T}, {T}] or [{B}, {T}, {T}], got {tuple(node_mask.shape)}")


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start,
                             node_mask: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch tree attention (reads `start` on the host). Computes in float32 (float64 for float64 inputs).
    start: an int or 1-element tensor, or one committed length per batch row [B]; node_mask [T, T] or per row
    [B, T, T]."""
    _check_shapes(q, k_cache, v_cache, node_mask)
    B = q.shape[0]
    starts = row_values(start, B)
    if node_mask.dim() == 3 or len(set(starts)) > 1:  # rows differ: one row at a time
        masks = node_mask if node_mask.dim() == 3 else node_mask.expand(B, *node_mask.shape)
        return torch.cat([tree_attention_reference(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], starts[b], masks[b])
                          for b in range(B)])
    start = starts[0]
    B, H, T, D = q.shape
    kvh = k_cache.shape[1]
    end = start + T
    if end > k_cache.shape[2]:
        raise ValueError(f"start + T = {end} exceeds the cache capacity {k_cache.shape[2]}")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k_cache[:, :, :end].to(compute)
    v = v_cache[:, :, :end].to(compute)
    if H != kvh:  # GQA: query head h reads kv head h // (H // KVH)
        k = k.repeat_interleave(H // kvh, dim=1)
        v = v.repeat_interleave(H // kvh, dim=1)
    mask = torch.ones(T, end, dtype=torch.bool, device=q.device)
    mask[:, start:] = node_mask.to(device=q.device, dtype=torch.bool)
    out = F.scaled_dot_product_attention(q.to(compute), k, v, attn_mask=mask)
    return out.to(q.dtype)


if triton is not None:

    @triton.jit
    def _tree_attn_fwd(q_ptr, k_ptr, v_ptr, start_ptr, nm_ptr, rows_ptr, out_ptr, pacc_ptr, pm_ptr, pl_ptr,
                       count_ptr, B, T, CAP, H, KVH, qk_scale,
                       stride_qb, stride_qh, stride_qt,
                       stride_kb, stride_kh, stride_kn,
                       stride_vb, stride_vh, stride_vn,
                       stride_start, stride_nmb, stride_nm0, stride_nm1, stride_rows_b, stride_rows,
                       stride_ob, stride_oh, stride_ot,
                       G: tl.constexpr, G_P2: tl.constexpr, TOK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, T_P2: tl.constexpr,
                       SPLIT: tl.constexpr, SPLIT_BLOCKS_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                       FP32_DOT: tl.constexpr, ROUND_P: tl.constexpr, WRITE_OUT: tl.constexpr,
                       PDL: tl.constexpr, PREFETCH: tl.constexpr):
        """Program (b * KVH + kv head, TOK tokens, key split): online softmax over each token's keys in logical
        order; the committed prefix's blocks are shared by the program's tokens. With several splits, the last
        split of a token group to finish merges the group's partials (count_ptr: one arrival counter per group)."""
        pid_bk = tl.program_id(0)
        t0 = tl.program_id(1) * TOK
        pid_s = tl.program_id(2)
        b = (pid_bk // KVH).to(tl.int64)
        kvh = (pid_bk % KVH).to(tl.int64)
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh
        if PREFETCH:  # the split's committed K/V rows into L2 while the kernel before it (the new rows' store) runs
            hint = tl.load(start_ptr + b * stride_start, cache_modifier=".cg").to(tl.int32)  # a hint: read again
            blk = tl.arange(0, SPLIT_BLOCKS_P2)  # the split's blocks (padded to a power of two: tl.arange)
            first = pid_s * SPLIT + blk * BLOCK_N  # each block's first row
            n = tl.where(blk < SPLIT // BLOCK_N, tl.maximum(tl.minimum(tl.minimum(hint, CAP) - first, BLOCK_N), 0), 0)
            elt: tl.constexpr = k_ptr.dtype.element_ty.primitive_bitwidth // 8
            k_bytes = tl.where(n > 0, (n - 1) * stride_kn + D, 0) * elt  # n rows, multiples of 16 bytes (host)
            v_bytes = tl.where(n > 0, (n - 1) * stride_vn + D, 0) * elt
            prefetch_l2(k_base + first.to(tl.int64) * stride_kn, k_bytes.to(tl.int32))
            prefetch_l2(v_base + first.to(tl.int64) * stride_vn, v_bytes.to(tl.int32))
        pdl_wait(PDL)

        start = tl.load(start_ptr + b * stride_start).to(tl.int32)  # on the device: graph replays may change it

        # rows of this program: TOK tokens x the G query heads of the kv head, G_P2 rows per token (tl.dot needs
        # BLOCK_M >= 16: one token's heads alone would leave most rows as padding)
        offs_m = tl.arange(0, BLOCK_M)
        slot = offs_m // G_P2
        tok = t0 + slot
        heads = kvh * G + offs_m % G_P2
        row_ok = (offs_m % G_P2 < G) & (slot < TOK) & (tok < T)  # with TOK = 1, the rows past G_P2 are padding
        offs_d = tl.arange(0, D_P2)
        offs_n = tl.arange(0, BLOCK_N)
        nodes = tl.arange(0, T_P2)
        d_ok = offs_d < D  # D_P2 > D pads the head dim (and D < 16, for tl.dot)
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + tok[:, None] * stride_qt + offs_d[None, :],
                    mask=q_mask, other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        lo = pid_s * SPLIT
        # No token has more keys than start + T (a draft's bidirectional block sees all T new rows), nor than CAP:
        # the splits at or past that bound have nothing to compute, merge or count (and every split counted exists).
        bound = tl.minimum(start + T, CAP)
        active = (bound + SPLIT - 1) // SPLIT
        if not WRITE_OUT:
            if lo >= bound:
                return

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum
        acc = tl.zeros([BLOCK_M, D_P2], dtype=tl.float32)  # unnormalised output

        # A token's keys are logical 0 .. start + (visible new rows) - 1: the committed rows, then its visible new
        # rows in index order (a tree lists ancestors before descendants), the j-th of them rows_ptr[t, j].
        # Split s covers logical keys [lo, lo + SPLIT). Every token sees past `start` (itself at least), so the
        # blocks wholly inside the committed prefix are the same for all of them: walked once for all the rows,
        # with plain addresses and no masks, so the pipeliner issues their loads ahead.
        prefix_end = lo + tl.maximum(tl.minimum(lo + SPLIT, start) - lo, 0) // BLOCK_N * BLOCK_N
        # each token's key count (hi <= lo: no keys in this split; a token past T sees nothing) and the row list of
        # its first block past the prefix, loaded now: their latency overlaps the prefix walk instead of following it
        tids = t0 + tl.arange(0, TOK)
        seen_all = tl.load(nm_ptr + b * stride_nmb + tids[:, None] * stride_nm0 + nodes[None, :] * stride_nm1,
                           mask=(tids[:, None] < T) & (nodes[None, :] < T), other=0) != 0
        hi_all = tl.where(tids < T, tl.minimum(lo + SPLIT, start + tl.sum(seen_all.to(tl.int32), 1)), lo)
        offs0 = prefix_end + offs_n
        new0 = (offs0[None, :] >= start) & (offs0[None, :] < hi_all[:, None])
        node0_all = tl.load(rows_ptr + b * stride_rows_b + tids[:, None] * stride_rows + (offs0 - start)[None, :],
                            mask=new0, other=0)
        for n0 in range(lo, prefix_end, BLOCK_N):
            offs = n0 + offs_n
            kt = tl.load(k_base + offs_d[:, None] + offs[None, :] * stride_kn, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + offs[:, None] * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            if FP32_DOT:
                qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            else:
                qk = tl.dot(q, kt)
            qk = qk * qk_scale
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP32_DOT:
                if ROUND_P:
                    p = p.to(v.dtype).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # The rest, token by token: the block that reaches the token's new rows and those after it, each block's
        # result kept for that token's rows only. The blocks are those of the loop above (BLOCK_N steps from lo)
        # and run the same operations, so a key's block and arithmetic do not depend on where the token's new rows
        # begin: a row equals the one-token decode step at its position bit for bit.
        for j in tl.static_range(TOK):
            tj = t0 + j
            pick = tl.arange(0, TOK) == j
            hi = tl.sum(tl.where(pick, hi_all, 0), 0)
            node0 = tl.sum(tl.where(pick[:, None], node0_all, 0), 0)
            visible = rows_ptr + b * stride_rows_b + tj * stride_rows
            mine = slot == j
            for n0 in range(prefix_end, hi, BLOCK_N):
                offs = n0 + offs_n
                # committed prefix: logical key = cache row; past it, the visible new row of rank offs - start (a
                # gather from the token's row list, as paged attention reads its block table), computed for every
                # block without a branch, so that the addresses stay plain arithmetic the pipeliner can issue ahead.
                new = (offs >= start) & (offs < hi)
                first_block = offs < prefix_end + BLOCK_N  # its row list is loaded already
                node = tl.where(first_block, node0, tl.load(visible + (offs - start), mask=new & ~first_block, other=0))
                cache_row = tl.where(offs < start, offs, start + node)
                kv_ok = (offs < hi) & (cache_row < CAP)
                kt = tl.load(k_base + offs_d[:, None] + cache_row[None, :] * stride_kn,
                             mask=kv_ok[None, :] & d_ok[:, None], other=0.0)  # K^T block [D_P2, BLOCK_N]
                v = tl.load(v_base + cache_row[:, None] * stride_vn + offs_d[None, :],
                            mask=kv_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_P2]
                if FP32_DOT:  # float32 inputs (exact, not TF32), or bfloat16 under the interpreter
                    qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
                else:
                    qk = tl.dot(q, kt)
                qk = tl.where(kv_ok[None, :], qk * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: stay neutral, no NaN
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(qk - m_safe[:, None])
                l_new = l_i * alpha + tl.sum(p, 1)
                if FP32_DOT:
                    if ROUND_P:  # round P to 16 bits as the tensor-core path does
                        p = p.to(v.dtype).to(tl.float32)
                    acc_new = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    acc_new = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                if TOK == 1:
                    m_i, l_i, acc = m_new, l_new, acc_new
                else:
                    m_i = tl.where(mine, m_new, m_i)
                    l_i = tl.where(mine, l_new, l_i)
                    acc = tl.where(mine[:, None], acc_new, acc)

        out_rows = out_ptr + b * stride_ob + heads[:, None] * stride_oh + tok[:, None] * stride_ot + offs_d[None, :]
        if WRITE_OUT:  # a single split: normalise and write the output rows
            _store_normalised(out_rows, acc, l_i, q_mask)
        elif active == 1:  # the group's keys fit this split: merging one partial would change no bit
            _store_normalised(out_rows, acc, l_i, q_mask)
        else:  # partials laid out [split, B, H, T] (+ [D] for acc), contiguous
            row = (b * H + heads) * T + tok
            rows_all = B * H * T
            tl.store(pm_ptr + pid_s * rows_all + row, m_i, mask=row_ok)
            tl.store(pl_ptr + pid_s * rows_all + row, l_i, mask=row_ok)
            tl.store(pacc_ptr + (pid_s * rows_all + row)[:, None] * D + offs_d[None, :], acc, mask=q_mask)
            # Release the partials (every thread's stores before one thread's acq_rel count), then the last of
            # the group's active splits to arrive merges them, split by split, in split order: the result does not
            # depend on which split finished last. It resets the counter for the next call on the stream.
            tl.debug_barrier()
            counter = count_ptr + pid_bk * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, D_P2], dtype=tl.float32)
                for s in range(0, active):  # a neutral partial (max -inf, sum 0) weighs exp2(-inf) = 0
                    part = s * rows_all + row
                    m_s = tl.load(pm_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(pl_ptr + part, mask=row_ok, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(pacc_ptr + part[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0,
                                  cache_modifier=".cg")
                    m_new = tl.maximum(m_run, m_s)
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
                    alpha = tl.exp2(m_run - m_safe)
                    w = tl.exp2(m_s - m_safe)
                    l_run = l_run * alpha + w * l_s
                    acc = acc * alpha[:, None] + w[:, None] * a_s
                    m_run = m_new
                _store_normalised(out_rows, acc, l_run, q_mask)

    @triton.jit
    def _store_normalised(out_rows, acc, l, mask):
        """out = acc / l in the output's dtype (a row that saw no key, l = 0, is written as 0)."""
        l_safe = tl.where(l == 0.0, 1.0, l)
        tl.store(out_rows, (acc / l_safe[:, None]).to(out_rows.dtype.element_ty), mask=mask)


def tokens_per_tile(G: int) -> int:
    """The tokens whose G query heads (next_pow2(G) rows each) fit one program's tile of max(16, next_pow2(G))
    rows: what `tokens_per_program` packs besides 1."""
    return max(16, next_pow2(G)) // next_pow2(G)


def default_tokens_per_program(B: int, T: int, capacity: int, G: int) -> int:
    """Tokens per program by default: packed in batched calls with T > 1, and for one sequence once its T tokens
    times the cache's capacity reach PACK_ROWS_X_KEYS (a 65-row verify over a 1024-key cache: there each token's
    program walking the whole prefix again costs more than a packed program walking its tokens' tails one after
    another; below it packing loses). Shapes only, never `start`: the grid is fixed for CUDA graphs."""
    if T > 1 and (B > 1 or T * capacity >= PACK_ROWS_X_KEYS):
        return tokens_per_tile(G)
    return 1


def _start_tensor(start, B: int, device) -> torch.Tensor:
    """start on the device: one value for all rows, or one per batch row (then contiguous, [B])."""
    if isinstance(start, torch.Tensor):
        if start.numel() not in (1, B) or start.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"start must be one int32/int64 value or one per batch row ({B}), got {start.dtype} "
                             f"{tuple(start.shape)}")
        start = start if start.device == device else start.to(device)  # a host copy is not graph-capturable
        return start.reshape(-1) if start.numel() > 1 else start
    return torch.full((), int(start), dtype=torch.int64, device=device)  # a fill kernel, capturable


def visible_rows(node_mask: torch.Tensor) -> torch.Tensor:
    """[..., T, T] int32 from a [..., T, T] mask: row t lists the new rows that row t sees, in index order, then
    padding (T). On the device, no host read; computed once per forward pass and shared by its attention layers."""
    T = node_mask.shape[-1]
    index = torch.arange(T, dtype=torch.int32, device=node_mask.device)
    return torch.where(node_mask.bool(), index, T).sort(dim=-1).values.contiguous()


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start,
                          node_mask: torch.Tensor, split_size: int | None = None, block_n: int = BLOCK_N,
                          num_warps: int | None = None, num_stages: int | None = None,
                          out: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                          tokens_per_program: int | None = None) -> torch.Tensor:
    """The Triton kernel. `start`: a 1-element int tensor on q's device (read by the kernel), one per batch row [B],
    or a Python int; node_mask [T, T] (all rows) or [B, T, T]. `rows`: visible_rows(node_mask) where the caller has
    it already.

    `out`, if given, is a [B, H, T, D] tensor of q's dtype (any strides with a contiguous last dim) that receives
    the result. `split_size` (keys per split, rounded up to a multiple of `block_n`) fixes the number of splits,
    cdiv(CAP, split_size); the grid depends on shapes only, never on `start`. `num_warps`, `num_stages`: launch
    overrides, for tuning. `tokens_per_program`: 1, or the tokens that fit the 16-row tile (16 // next_pow2(G));
    by default default_tokens_per_program's choice. Both give the same bits (`num_warps` does not: a verify must
    launch as its one-token decode does).
    """
    if triton is None:
        raise RuntimeError("tree_attention_triton needs triton")
    _check_shapes(q, k_cache, v_cache, node_mask)
    B, H, T, D = q.shape
    KVH, CAP = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dimension")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if out is None:
        out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (B, H, T, D) or out.dtype != q.dtype or out.device != q.device or out.stride(3) != 1:
        raise ValueError(f"out must be [{B}, {H}, {T}, {D}] {q.dtype} on {q.device} with a contiguous last dim")
    if T == 0 or B * H == 0:
        return out
    if q.stride(3) != 1:
        q = q.contiguous()
    start_t = _start_tensor(start, B, q.device)
    nm = node_mask.to(device=q.device, dtype=torch.bool).view(torch.uint8)
    if rows is None:
        rows = visible_rows(nm)

    # TOK tokens per program, each in G_P2 rows (its G query heads, padded): BLOCK_M = 16 rows (tl.dot's minimum)
    # hold 16 // G_P2 tokens, which then share the committed prefix's K/V loads. Every row's keys are walked in
    # logical order in the same BLOCK_N blocks whether the token is verified alone, in a chain or in a tree, and
    # a row's arithmetic does not depend on its place in the tile, so the verify pass reproduces the one-token
    # decode step bit for bit.
    g_p2 = next_pow2(G)
    block_m = max(16, g_p2)
    if tokens_per_program is None:
        tok = default_tokens_per_program(B, T, CAP, G)
    elif tokens_per_program in (1, tokens_per_tile(G)):
        tok = tokens_per_program
    else:
        raise ValueError(f"tokens_per_program must be 1 or {tokens_per_tile(G)} for {G} query heads per kv head, "
                         f"got {tokens_per_program}")
    split_size = SPLIT_SIZE if split_size is None else split_size
    d_p2 = max(16, next_pow2(D))
    split = triton.cdiv(max(split_size, block_n), block_n) * block_n
    num_splits = triton.cdiv(CAP, split)
    is_fp32 = q.dtype == torch.float32
    # float32 inputs: exact ("ieee") dots, not TF32. CPU tensors only run under TRITON_INTERPRET=1, whose tl.dot
    # multiplies the raw uint16 bits of bfloat16 operands (triton-lang/triton#11584): dot in float32 there,
    # rounding P to bfloat16 first as the GPU path does.
    fp32_dot = is_fp32 or (q.device.type == "cpu" and q.dtype == torch.bfloat16)
    qk_scale = (1.0 / math.sqrt(D)) * 1.4426950408889634  # softmax in base 2
    if num_warps is None:  # 16-bit tiles of up to 16 x 128: 2 warps, 10-25% faster than 4 on the H200; fp32: 4 or 8
        if block_m * d_p2 <= 16 * 128 and not is_fp32:
            num_warps = 2
        else:
            num_warps = 4 if block_m * d_p2 <= (32 * 128 if is_fp32 else 64 * 128) else 8
    if num_stages is None:  # a deeper pipeline pays where few programs walk many keys (docs/performance.md)
        num_stages = 3 if B * T <= 16 and tok == 1 else 2
        kv_block_bytes = 2 * block_n * d_p2 * q.element_size()  # one K and one V block per stage in flight
        num_stages = max(1, min(num_stages, 1 + SMEM_FOR_STAGES // kv_block_bytes))  # float32 at D = 256: 2

    write_out = num_splits == 1
    if write_out:
        pacc = pm = pl = count = out  # unused
    else:
        pacc = torch.empty(num_splits, B, H, T, D, dtype=torch.float32, device=q.device)
        pm = torch.empty(num_splits, B, H, T, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        count = arrival_counters(B * KVH * triton.cdiv(T, tok), q.device)
    pdl = pdl_launch(q)
    prefetch = (pdl and env_switch("ENGINE_ATTN_PREFETCH") is not False
                and bulk_prefetch_ok(k_cache, k_cache.stride(2), D) and bulk_prefetch_ok(v_cache, v_cache.stride(2), D))
    _tree_attn_fwd[(B * KVH, triton.cdiv(T, tok), num_splits)](
        q, k_cache, v_cache, start_t, nm, rows, out, pacc, pm, pl, count,
        B, T, CAP, H, KVH, qk_scale,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        start_t.stride(0) if start_t.dim() else 0, nm.stride(0) if nm.dim() == 3 else 0, nm.stride(-2), nm.stride(-1),
        rows.stride(0) if rows.dim() == 3 else 0, rows.stride(-2),
        out.stride(0), out.stride(1), out.stride(2),
        G=G, G_P2=g_p2, TOK=tok, BLOCK_M=block_m, BLOCK_N=block_n, T_P2=max(2, next_pow2(T)), SPLIT=split,
        SPLIT_BLOCKS_P2=next_pow2(split // block_n), D=D,
        D_P2=d_p2,
        FP32_DOT=fp32_dot, ROUND_P=not is_fp32, WRITE_OUT=write_out, PDL=pdl, PREFETCH=prefetch,
        num_warps=num_warps,
        num_stages=num_stages, enable_fp_fusion=False, **pdl_options(pdl))
    return out


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start, node_mask: torch.Tensor,
                   use_triton: bool | None = None, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Tree attention: the Triton kernel for CUDA tensors with T <= 128, else the PyTorch reference.

    use_triton=None decides as above (and honours ENGINE_DISABLE_TRITON); False forces the reference (which
    reads `start` on the host); True forces the kernel. `out`: as for tree_attention_triton (the reference's
    result is copied into it).
    """
    if use_triton is None:
        use_triton = (triton is not None and q.is_cuda and q.shape[2] <= MAX_TRITON_T and not triton_disabled()
                      and q.dtype in (torch.float32, torch.float16, torch.bfloat16))
    if use_triton:
        return tree_attention_triton(q, k_cache, v_cache, start, node_mask, rows=rows, out=out)
    result = tree_attention_reference(q, k_cache, v_cache, start, node_mask)
    return result if out is None else out.copy_(result)
