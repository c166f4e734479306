"""The inputs of a verify pass in one launch: the row ids, their embeddings, rotary rows, cache slots and the lists of
new rows each row sees.

A verify pass runs [bonus, node 1, ..., node n] through the target, the bonus token being the sequence's token at
its committed length. In PyTorch its inputs take about a dozen small kernels (an index_select, two cats and an add
for the ids and positions; the embedding; the rotary gather; an arange, a where and a sort for the visible lists; an
arange and an add for the slots). In a launch-bound step that shows: SmolLM2-135M's AR verify graph has 14 launches
fewer and takes 27 us less (607.7 against 634.7 us on an H100, docs/performance.md).

    verify_rows(tokens [C], start, tree_tokens [n], tree_depths [n], node_mask [T, T], embed_weight [V, hidden] |
                None, rope_table [2, P, R]) -> (ids, x, cos, sin, slots, visible)

    T = n + 1; start: the committed length (a 1-element int64 tensor);
    ids [T] int64       = [tokens[start], tree_tokens...]
    x [1, T, hidden]    = embed_weight[ids] (None without embed_weight: tensor parallelism embeds vocab-parallel)
    cos, sin [1, T, R]  = rope_table[0 / 1, start + [0, tree_depths...]] (engine.model.Rotary's position table)
    slots [T] int64     = start + [0, 1, ..., n]
    visible [T, T] int32: row t lists the j with node_mask[t, j] in increasing order, then T
                          (kernels.tree_attention.visible_rows)

Every output is a copy or an integer, so the kernel equals the reference bit for bit.

Kernel: one program per row, one warp; the row's visible list is a scatter to the ranks of the mask's set bits (a
prefix sum) and T past their count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import next_pow2, pdl_launch, pdl_options, pdl_wait, tl, triton, triton_disabled
from kernels.tree_attention import visible_rows

__all__ = ["verify_rows", "verify_rows_reference", "verify_rows_triton"]


def _check(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table) -> int:
    """Validates the arguments; returns T."""
    n = tree_tokens.shape[0] if tree_tokens.dim() == 1 else -1
    if tokens.dim() != 1 or n < 0 or tuple(tree_depths.shape) != (n,):
        raise ValueError(f"expected tokens [C], tree_tokens [n] and tree_depths [n], got {tuple(tokens.shape)}, "
                         f"{tuple(tree_tokens.shape)}, {tuple(tree_depths.shape)}")
    if start.numel() != 1:
        raise ValueError(f"start must hold one value, got {tuple(start.shape)}")
    if any(t.dtype != torch.long for t in (tokens, start, tree_tokens, tree_depths)):
        raise ValueError("tokens, start, tree_tokens and tree_depths must be int64")
    if tuple(node_mask.shape) != (n + 1, n + 1) or node_mask.dtype != torch.bool:
        raise ValueError(f"node_mask must be bool [{n + 1}, {n + 1}], got {node_mask.dtype} {tuple(node_mask.shape)}")
    if rope_table.dim() != 3 or rope_table.shape[0] != 2:
        raise ValueError(f"rope_table must be [2, positions, rotary dims], got {tuple(rope_table.shape)}")
    if embed_weight is not None and (embed_weight.dim() != 2 or embed_weight.dtype != rope_table.dtype):
        raise ValueError(f"embed_weight must be [vocab, hidden] of the table's dtype {rope_table.dtype}, got "
                         f"{embed_weight.dtype} {tuple(embed_weight.shape)}")
    tensors = [tokens, start, tree_tokens, tree_depths, node_mask, rope_table] + \
        ([] if embed_weight is None else [embed_weight])
    if len({t.device for t in tensors}) != 1:
        raise ValueError("verify_rows takes tensors on one device")
    return n + 1


def verify_rows_reference(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table):
    """Plain PyTorch: the ops the kernel replaces."""
    T = _check(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table)
    start = start.reshape(1)
    ids = torch.cat((tokens.index_select(0, start), tree_tokens))
    positions = start + torch.cat((torch.zeros_like(start), tree_depths))
    x = None if embed_weight is None else F.embedding(ids, embed_weight)[None]
    rope = rope_table[:, positions]
    slots = start + torch.arange(T, device=tokens.device)
    return ids, x, rope[0][None], rope[1][None], slots, visible_rows(node_mask)


if triton is not None:

    @triton.jit
    def _verify_rows_kernel(tokens_ptr, start_ptr, tree_ptr, depth_ptr, mask_ptr, emb_ptr, table_ptr,
                            ids_ptr, x_ptr, cos_ptr, sin_ptr, slots_ptr, vis_ptr,
                            T, HIDDEN, R, s_emb, s_mask, s_table0, s_table1,
                            EMBED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        pdl_wait(PDL)
        start = tl.load(start_ptr)
        node = tl.maximum(t - 1, 0)  # row t > 0 is node t (index t - 1 of the tree's arrays)
        is_node = t > 0
        tok = tl.where(is_node, tl.load(tree_ptr + node, mask=is_node, other=0),
                       tl.load(tokens_ptr + start, mask=t == 0, other=0))
        pos = start + tl.load(depth_ptr + node, mask=is_node, other=0)
        tl.store(ids_ptr + t, tok)
        tl.store(slots_ptr + t, start + t)
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        row = table_ptr + pos * s_table1 + r
        tl.store(cos_ptr + t * R + r, tl.load(row, mask=rmask), mask=rmask)
        tl.store(sin_ptr + t * R + r, tl.load(row + s_table0, mask=rmask), mask=rmask)
        if EMBED:
            for h0 in range(0, HIDDEN, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                hmask = h < HIDDEN
                tl.store(x_ptr + t * HIDDEN + h, tl.load(emb_ptr + tok * s_emb + h, mask=hmask), mask=hmask)
        j = tl.arange(0, BLOCK_T)
        jmask = j < T
        seen = tl.load(mask_ptr + t * s_mask + j, mask=jmask, other=0).to(tl.int32)
        rank = tl.cumsum(seen, 0) - 1  # where row t's list holds j
        count = tl.sum(seen, 0)
        tl.store(vis_ptr + t * T + rank, j, mask=seen != 0)
        tl.store(vis_ptr + t * T + j, tl.full([BLOCK_T], 0, tl.int32) + T, mask=jmask & (j >= count))


def _specs(T: int, hidden: int | None, R: int, dtype) -> list:
    x = None if hidden is None else ((1, T, hidden), dtype)
    return [((T,), torch.long), x, ((1, T, R), dtype), ((1, T, R), dtype), ((T,), torch.long), ((T, T), torch.int32)]


def verify_rows_triton(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table, out=None):
    """The kernel (the module docstring); CPU tensors under TRITON_INTERPRET=1. `out`: contiguous tensors that
    receive (ids, x, cos, sin, slots, visible), x None without embed_weight."""
    if triton is None:
        raise RuntimeError("verify_rows_triton needs triton")
    T = _check(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table)
    if embed_weight is not None and embed_weight.stride(1) != 1:
        raise ValueError("embed_weight needs a contiguous last dimension")
    dev = tokens.device
    R = rope_table.shape[2]
    hidden = None if embed_weight is None else embed_weight.shape[1]
    specs = _specs(T, hidden, R, rope_table.dtype)
    if out is None:
        out = tuple(None if spec is None else torch.empty(spec[0], dtype=spec[1], device=dev) for spec in specs)
    elif len(out) != 6 or any((o is None) != (spec is None) for o, spec in zip(out, specs)) or any(
            tuple(o.shape) != spec[0] or o.dtype != spec[1] or o.device != dev or not o.is_contiguous()
            for o, spec in zip(out, specs) if o is not None):
        raise ValueError(f"out must be contiguous tensors (or None for x without embed_weight) of shapes and dtypes "
                         f"{specs} on {dev}")
    ids, x, cos, sin, slots, visible = out
    tokens, tree_tokens, tree_depths = tokens.contiguous(), tree_tokens.contiguous(), tree_depths.contiguous()
    node_mask, rope_table = node_mask.contiguous(), rope_table.contiguous()
    pdl = pdl_launch(tokens)
    _verify_rows_kernel[(T,)](
        tokens, start, tree_tokens, tree_depths, node_mask, ids if embed_weight is None else embed_weight, rope_table,
        ids, ids if x is None else x, cos, sin, slots, visible,
        T, hidden or 0, R, 0 if embed_weight is None else embed_weight.stride(0),
        node_mask.stride(0), rope_table.stride(0), rope_table.stride(1),
        EMBED=embed_weight is not None, BLOCK_H=min(1024, next_pow2(max(hidden or 0, 16))),
        BLOCK_R=next_pow2(max(R, 16)), BLOCK_T=next_pow2(max(T, 16)), PDL=pdl, num_warps=1, **pdl_options(pdl))
    return out


def verify_rows(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table):
    """The kernel for CUDA tensors, else the reference (ENGINE_DISABLE_TRITON=1 forces the reference)."""
    if triton is not None and tokens.is_cuda and not triton_disabled():
        return verify_rows_triton(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table)
    return verify_rows_reference(tokens, start, tree_tokens, tree_depths, node_mask, embed_weight, rope_table)
