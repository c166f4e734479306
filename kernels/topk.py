"""The k most likely tokens of each row of a logits matrix, with their log-probabilities: the DDTree tree
builder's input (one row per draft depth, a 150k-token vocabulary on real models).

topk_logprobs(logits [R, V] (any float dtype), k) -> logp [R, k] float32, ids [R, k] int64
    ids[r] are the k largest logits of row r in descending order, equal logits in ascending token order;
    logp[r, j] = logits[r, ids[r, j]] - logsumexp(logits[r]) in float32.

- `topk_logprobs_reference`: torch.topk for the k-th largest value, then the candidates at or above it in
  (value descending, id ascending) order, and a log-sum-exp; plain PyTorch (torch.topk alone leaves ties open).
- `topk_logprobs_triton`: two launches, no host synchronisation (safe inside a CUDA graph). A generic top-k of a
  long row (torch.topk: one thread block per row, several radix passes) leaves most of the GPU idle when the rows
  are few; here the vocabulary is split into chunks so that every SM works:
    1. grid (rows, chunks): each program reads its chunk once and keeps its k best (k rounds of max-and-mask in
       registers), the chunk's max and its sum of exp(x - max);
    2. grid (rows,): merges the chunks' candidates (k rounds of max-and-mask over chunks x k values, taken in
       chunk order, so ties go to the lower token id) and their log-sum-exp terms.
- `topk_logprobs`: the kernel for CUDA tensors, else the reference (ENGINE_DISABLE_TRITON=1 forces it).
"""
from __future__ import annotations

import torch

from kernels import tl, triton, triton_disabled

__all__ = ["topk_logprobs", "topk_logprobs_reference", "topk_logprobs_triton"]

MAX_CHUNK = 4096


def _check(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"expected float logits [R, V], got {tuple(logits.shape)} {logits.dtype}")
    if int(k) != k or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must be an int in [1, {logits.shape[1]}], got {k}")


def topk_logprobs_reference(logits: torch.Tensor, k: int):
    _check(logits, k)
    x = logits.float()
    top = x.topk(min(k + 1, x.shape[1]), dim=-1)  # one more: does a tie straddle the k-th place?
    ids = top.indices[:, :k].sort(dim=-1).values  # id ascending, then a stable sort by value descending
    ids = ids.gather(1, x.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices)
    if k < x.shape[1]:
        for r in (top.values[:, k] == top.values[:, k - 1]).nonzero()[:, 0].tolist():  # the lowest ids win
            candidates = (x[r] >= top.values[r, k]).nonzero()[:, 0]
            ids[r] = candidates[x[r, candidates].sort(descending=True, stable=True).indices[:k]]
    return x.gather(1, ids) - torch.logsumexp(x, dim=-1, keepdim=True), ids


if triton is not None:

    @triton.jit
    def _chunk_topk_kernel(x_ptr, stride_row, V, val_ptr, idx_ptr, max_ptr, sum_ptr, n_chunks,
                           K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        local = tl.arange(0, CHUNK)
        offs = chunk * CHUNK + local
        x = tl.load(x_ptr + row * stride_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == -float("inf"), 0.0, m)  # a chunk of -inf logits adds exp(-inf) = 0, not NaN
        s = tl.sum(tl.exp(x - m_safe), axis=0)
        slot = row * n_chunks + chunk
        tl.store(max_ptr + slot, m)
        tl.store(sum_ptr + slot, s)
        ranks = tl.arange(0, KP)
        vals = tl.full([KP], -float("inf"), tl.float32)
        ids = tl.zeros([KP], tl.int64)
        for j in range(K):
            best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            vals = tl.where(ranks == j, best, vals)
            ids = tl.where(ranks == j, (chunk * CHUNK + at).to(tl.int64), ids)
            x = tl.where(local == at, -float("inf"), x)
        tl.store(val_ptr + slot * KP + ranks, vals)
        tl.store(idx_ptr + slot * KP + ranks, ids)

    @triton.jit
    def _merge_topk_kernel(val_ptr, idx_ptr, max_ptr, sum_ptr, n_chunks, logp_ptr, ids_ptr,
                           K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr):
        row = tl.program_id(0)
        chunks = tl.arange(0, CP)
        m = tl.load(max_ptr + row * n_chunks + chunks, mask=chunks < n_chunks, other=-float("inf"))
        s = tl.load(sum_ptr + row * n_chunks + chunks, mask=chunks < n_chunks, other=0.0)
        big = tl.max(m, axis=0)
        big_safe = tl.where(big == -float("inf"), 0.0, big)
        lse = big_safe + tl.log(tl.sum(s * tl.exp(m - big_safe), axis=0))
        cand = tl.arange(0, CP * KP)  # chunk-major: the first of equal values has the lowest token id
        valid = (cand // KP < n_chunks) & (cand % KP < K)
        vals = tl.load(val_ptr + row * n_chunks * KP + cand, mask=valid, other=-float("inf"))
        ids = tl.load(idx_ptr + row * n_chunks * KP + cand, mask=valid, other=0)
        for j in range(K):
            best, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(logp_ptr + row * K + j, best - lse)
            tl.store(ids_ptr + row * K + j, tl.sum(tl.where(cand == at, ids, 0), axis=0))
            vals = tl.where(cand == at, -float("inf"), vals)


def topk_logprobs_triton(logits: torch.Tensor, k: int, out=None, chunk: int | None = None):
    """The two-launch Triton top-k, into `out` = (logp, ids) if given; `chunk` (a power of two) overrides the
    vocabulary split (tests)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    _check(logits, k)
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunk = chunk or min(MAX_CHUNK, triton.next_power_of_2(V))
    n_chunks = triton.cdiv(V, chunk)
    kp = triton.next_power_of_2(k)
    dev = logits.device
    vals = torch.empty(R, n_chunks, kp, dtype=torch.float32, device=dev)
    idx = torch.empty(R, n_chunks, kp, dtype=torch.long, device=dev)
    maxes = torch.empty(R, n_chunks, dtype=torch.float32, device=dev)
    sums = torch.empty(R, n_chunks, dtype=torch.float32, device=dev)
    if out is None:
        out = (torch.empty(R, k, dtype=torch.float32, device=dev), torch.empty(R, k, dtype=torch.long, device=dev))
    logp, ids = out
    if logp.shape != (R, k) or ids.shape != (R, k) or logp.dtype != torch.float32 or ids.dtype != torch.long \
            or not (logp.is_contiguous() and ids.is_contiguous()):
        raise ValueError(f"out must be contiguous float32 and int64 tensors of shape {(R, k)}")
    if R == 0:
        return logp, ids
    _chunk_topk_kernel[(R, n_chunks)](logits, logits.stride(0), V, vals, idx, maxes, sums, n_chunks,
                                      K=k, KP=kp, CHUNK=chunk, num_warps=8 if chunk >= 2048 else 4)
    cp = triton.next_power_of_2(n_chunks)
    _merge_topk_kernel[(R,)](vals, idx, maxes, sums, n_chunks, logp, ids, K=k, KP=kp, CP=cp,
                             num_warps=4 if cp * kp >= 1024 else 1)
    return logp, ids


def topk_logprobs(logits: torch.Tensor, k: int):
    """Top-k token ids and log-probabilities per row: the kernel on CUDA, else the reference."""
    if triton is not None and logits.is_cuda and not triton_disabled():
        return topk_logprobs_triton(logits, k)
    return topk_logprobs_reference(logits, k)
