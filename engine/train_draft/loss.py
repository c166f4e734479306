"""The training objective, as in the DFlash paper: cross-entropy against the target's greedy tokens after each
anchor, weighted exp(-(j-1)/gamma) by block position j, optionally mixed with the KL divergence to the target's
whole next-token distribution; and the teacher-forced acceptance that validation reports."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cross_entropy import cross_entropy


def target_block_logits(final_hidden, head_w, anchors, block_size: int) -> torch.Tensor:
    """The target's logits for tokens p+1..p+block-1 of each block [N, A, block-1, V]: its final (normed) hidden
    states at positions p..p+block-2 through the LM head. Positions past the end are clamped (block_loss masks
    them)."""
    N, L, H = final_hidden.shape
    pos = (anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)).clamp(max=L - 1)
    rows = final_hidden.gather(1, pos.view(N, -1, 1).expand(-1, -1, H)).view(*pos.shape, H)
    return rows @ head_w.t()


def block_labels(tokens, anchors, lengths, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens p+1..p+n after each anchor p [N, A, n], and whether they lie inside their sequence."""
    N, A = anchors.shape
    pos = anchors[..., None] + torch.arange(1, n + 1, device=tokens.device)
    labels = tokens.gather(1, pos.clamp(max=tokens.shape[1] - 1).view(N, -1)).view(N, A, n)
    return labels, pos < lengths[:, None, None]


def accepted_prefix(logits, tokens, anchors, lengths) -> torch.Tensor:
    """Teacher-forced acceptance of each block [N, A]: how many of its drafted tokens p+1.. match the target's
    greedy tokens before the first miss (a position past the sequence's end is a miss)."""
    labels, valid = block_labels(tokens, anchors, lengths, logits.shape[2])
    return ((logits.argmax(-1) == labels) & valid).long().cumprod(-1).sum(-1)


def block_loss(logits, tokens, anchors, lengths, gamma: float, teacher=None, distill: float = 0.0):
    """Weighted cross-entropy against tokens p+1..p+block-1 (positions past a sequence's end do not count); with
    `teacher` logits (target_block_logits, given when distill > 0), a share `distill` of it is the KL(teacher ||
    draft) instead. Also the share of block positions whose argmax is right."""
    N, A, Bm1, V = logits.shape
    labels, valid = block_labels(tokens, anchors, lengths, Bm1)
    j = torch.arange(1, Bm1 + 1, device=tokens.device)
    weight = torch.exp(-(j - 1).float() / gamma) * valid
    if teacher is None:  # one kernel pass on a GPU, no float32 copies of the logits (kernels.cross_entropy)
        per_position, argmax = cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
        per_position, argmax = per_position.view(N, A, Bm1), argmax.view(N, A, Bm1)
    else:
        logp = F.log_softmax(logits.float(), dim=-1)
        kl = F.kl_div(logp, F.log_softmax(teacher.float(), dim=-1), log_target=True, reduction="none").sum(-1)
        per_position = (1 - distill) * -logp.gather(-1, labels[..., None])[..., 0] + distill * kl
        argmax = logits.detach().argmax(-1)
    loss = (per_position * weight).sum() / weight.sum().clamp(min=1e-6)
    right = ((argmax == labels) & valid).sum() / valid.sum().clamp(min=1)
    return loss, right
