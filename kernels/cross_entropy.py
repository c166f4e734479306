"""Cross-entropy of many rows over a large vocabulary, with each row's argmax: the loss of draft training
(engine.train_draft.block_loss: 32 x 32 blocks x 15 positions = 15,360 rows of 49,152 logits a step by default).

cross_entropy(logits [M, V] float (bfloat16 in training), labels [M] int64) -> loss [M] float32, argmax [M] int64
    loss[m] = logsumexp(logits[m].float()) - logits[m, labels[m]].float(), differentiable in logits:
    d loss[m] / d logits[m] = softmax(logits[m].float()) - onehot(labels[m]), scaled by the incoming gradient
    and rounded once to the logits' dtype. argmax[m] is the first index of the row's largest logit (torch.argmax).

- `cross_entropy_reference`: log_softmax of a float32 copy and a gather, torch.argmax; autograd differentiates it.
  At the default training shape it moves about 27 GB a step: the float32 copy, log_softmax's output, the gather's
  dense gradient and log_softmax's backward are each a float32 tensor as large as 15,360 x 49,152.
- `cross_entropy_triton`: two kernels, no host synchronisation (safe inside the training step's CUDA graph):
    forward, one program per row: the row in blocks, an online maximum and sum of exp(x - max) in float32, the
    first index of the maximum, and the label's logit; it keeps each row's logsumexp for the backward;
    backward, grid (rows, blocks): (exp(x - lse) - [index == label]) * grad, rounded to the logits' dtype.
  The bfloat16 logits are read twice and the gradient written once: about 4.5 GB a step.
- `cross_entropy`: the kernels for CUDA tensors, else the reference (ENGINE_DISABLE_TRITON=1 forces it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import tl, triton, triton_disabled

__all__ = ["cross_entropy", "cross_entropy_reference", "cross_entropy_triton"]

BLOCK = 4096


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"expected float logits [M, V], got {tuple(logits.shape)} {logits.dtype}")
    if labels.shape != logits.shape[:1] or labels.dtype != torch.long:
        raise ValueError(f"expected int64 labels [{logits.shape[0]}], got {tuple(labels.shape)} {labels.dtype}")


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor):
    _check(logits, labels)
    loss = -F.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None])[:, 0]
    return loss, logits.detach().argmax(-1)


if triton is not None:
    from kernels.fused import _round

    @triton.jit
    def _ce_forward_kernel(x_ptr, stride, V, labels_ptr, loss_ptr, lse_ptr, argmax_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        m = -float("inf")
        s = 0.0
        best = -float("inf")
        best_at = 0
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=-float("inf")).to(tl.float32)
            top, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            best_at = tl.where(top > best, start + at, best_at)  # strictly larger: ties keep the first index
            best = tl.maximum(best, top)
            new_m = tl.maximum(m, top)
            safe = tl.where(new_m == -float("inf"), 0.0, new_m)  # blocks of -inf add exp(-inf) = 0, not NaN
            s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
            m = new_m
        lse = m + tl.log(s)
        label = tl.load(labels_ptr + row)
        tl.store(loss_ptr + row, lse - tl.load(base + label).to(tl.float32))
        tl.store(lse_ptr + row, lse)
        tl.store(argmax_ptr + row, best_at.to(tl.int64))

    @triton.jit
    def _ce_backward_kernel(x_ptr, stride, V, labels_ptr, lse_ptr, grad_ptr, dx_ptr, dx_stride,
                            BLOCK: tl.constexpr, SOFT_RNE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        dt: tl.constexpr = dx_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.load(lse_ptr + row))
        p = tl.where(cols == tl.load(labels_ptr + row), p - 1.0, p)
        dx = _round(p * tl.load(grad_ptr + row), dt, SOFT_RNE)
        tl.store(dx_ptr + row * dx_stride + cols, dx.to(dt), mask=mask)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels):
        M, V = logits.shape
        loss = torch.empty(M, dtype=torch.float32, device=logits.device)
        lse = torch.empty(M, dtype=torch.float32, device=logits.device)
        argmax = torch.empty(M, dtype=torch.long, device=logits.device)
        if M:
            _ce_forward_kernel[(M,)](logits, logits.stride(0), V, labels, loss, lse, argmax, BLOCK=BLOCK,
                                     num_warps=8)
        ctx.save_for_backward(logits, labels, lse)
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        logits, labels, lse = ctx.saved_tensors
        M, V = logits.shape
        dx = torch.empty_like(logits)
        if M:
            soft_rne = logits.device.type == "cpu" and logits.dtype == torch.bfloat16  # the interpreter's casts
            _ce_backward_kernel[(M, triton.cdiv(V, BLOCK))](logits, logits.stride(0), V, labels, lse,
                                                            grad_loss.float().contiguous(), dx, dx.stride(0),
                                                            BLOCK=BLOCK, SOFT_RNE=soft_rne, num_warps=8)
        return dx, None


def cross_entropy_triton(logits: torch.Tensor, labels: torch.Tensor):
    if triton is None:
        raise RuntimeError("Triton is not installed")
    _check(logits, labels)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _CrossEntropy.apply(logits, labels.contiguous())


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor):
    """Per-row cross-entropy and argmax: the kernels on CUDA, else the reference."""
    if triton is not None and logits.is_cuda and not triton_disabled():
        return cross_entropy_triton(logits, labels)
    return cross_entropy_reference(logits, labels)
