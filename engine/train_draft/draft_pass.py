"""The draft being trained: its initial weights, the mask token it drafts with, and its differentiable training
pass, which computes for a batch of anchors what DFlashDrafter.propose computes at inference (docs/design.md,
"DFlash draft"), in plain PyTorch ops."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.fused import rmsnorm_reference, rope_reference

from ..draft import DFlashDraftModel, draft_config
from ..errors import EngineError
from ..loading import Target, load_dflash_draft
from ..model import Rotary
from .settings import TrainSettings


def new_draft(target: Target, settings: TrainSettings, mask_token_id: int) -> DFlashDraftModel:
    dcfg = draft_config(target.model.cfg, settings.layers, settings.block_size, mask_token_id)
    torch.manual_seed(settings.seed)
    draft = DFlashDraftModel(dcfg)
    for name, p in draft.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.ones_(p)  # norms
    return draft


def initial_draft(target: Target, settings: TrainSettings, log=print) -> DFlashDraftModel:
    """The draft a run starts from, in float32: settings.init's weights (fine-tuning), or new_draft's. An init
    draft's shape is the run's: settings.layers and settings.block_size are set from it."""
    if not settings.init:
        return new_draft(target, settings, pick_mask_token(target))
    path = target.default_draft if settings.init == "default" else settings.init
    if path is None or path.startswith("random"):
        raise EngineError(f"--init default: target {target.name} has no trained default draft; pass a draft "
                          "directory")
    draft = load_dflash_draft(Path(path).expanduser(), target).float()
    dcfg = draft.dcfg
    # draft_logits_train is the pass of train-draft's own drafts: full-attention layers with q/k norms
    unfit = ("sliding-window layers" if any(w is not None for w in dcfg.sliding_window)
             else "no q/k norms" if not dcfg.layers.qk_norm else None)
    if unfit:
        raise EngineError(f"--init {settings.init}: train-draft trains drafts of full-attention layers with q/k "
                          f"norms; this draft has {unfit}")
    settings.layers, settings.block_size = dcfg.layers.num_layers, dcfg.block_size
    log(f"starting from the draft {path}: {settings.layers} layers, block {settings.block_size}, "
        f"mask token {dcfg.mask_token_id}, target layers {list(dcfg.target_layer_ids)}")
    return draft


def pick_mask_token(target: Target) -> int:
    """A special token that ordinary text never contains (the draft learns its embedding's meaning), else the last
    id of the vocabulary."""
    tok = target.tokenizer
    if tok is not None:
        common = set(target.stop_ids) | {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
        for token_id in sorted(getattr(tok, "all_special_ids", []), reverse=True):
            if token_id not in common and 0 <= token_id < target.model.cfg.vocab_size:
                return int(token_id)
    return target.model.cfg.vocab_size - 1


def _norm(x, weight, eps):
    return rmsnorm_reference(x, weight, eps)[0]  # plain PyTorch: differentiable


def draft_logits_train(draft: DFlashDraftModel, rotary: Rotary, embed_w, head_w, feats, tokens, anchors):
    """Differentiable draft pass for anchors [N, A]: logits [N, A, block-1, V] of block positions 1..block-1.

    Block a of sequence n: [tokens[n, p], mask...] at positions p..p+block-1 (p = anchors[n, a]); it sees the
    context features of positions < p and its own rows, as DFlashDrafter.propose does at inference."""
    dcfg, cfg = draft.dcfg, draft.dcfg.layers
    N, L = tokens.shape
    A, block = anchors.shape[1], dcfg.block_size
    H, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dev = tokens.device
    ctx = _norm(draft.fc(feats), draft.hidden_norm.weight, cfg.rms_norm_eps)             # [N, L, H]
    offs = torch.arange(block, device=dev)
    blk_pos = (anchors[..., None] + offs).reshape(N, A * block)                            # [N, A*block]
    blk_ids = torch.full((N, A, block), dcfg.mask_token_id, dtype=torch.long, device=dev)
    blk_ids[..., 0] = tokens.gather(1, anchors)
    x = F.embedding(blk_ids.view(N, A * block), embed_w)
    ctx_pos = torch.arange(L, device=dev)
    # visibility [N, A*block, L + A*block]: context keys before the anchor, then the block's own rows
    see_ctx = ctx_pos[None, None, :] < anchors.repeat_interleave(block, dim=1)[..., None]
    blk = torch.arange(A, device=dev).repeat_interleave(block)
    see_blk = (blk[:, None] == blk[None, :]).expand(N, -1, -1)
    mask = torch.cat((see_ctx, see_blk), dim=-1)[:, None]
    cos_c, sin_c = rotary(ctx_pos[None].expand(N, L), x.dtype)
    cos_b, sin_b = rotary(blk_pos, x.dtype)
    cos_k, sin_k = torch.cat((cos_c, cos_b), 1), torch.cat((sin_c, sin_b), 1)
    for layer in draft.layers:
        a = layer.self_attn
        h = _norm(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = _norm(a.q_proj(h).view(N, A * block, nh, d), a.q_norm.weight, cfg.rms_norm_eps).transpose(1, 2)
        kv_in = torch.cat((ctx, h), dim=1)
        k = _norm(a.k_proj(kv_in).view(N, -1, nkv, d), a.k_norm.weight, cfg.rms_norm_eps).transpose(1, 2)
        v = a.v_proj(kv_in).view(N, -1, nkv, d).transpose(1, 2)
        q = rope_reference(q, cos_b, sin_b)
        k = rope_reference(k, cos_k, sin_k)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nh != nkv)
        x = x + a.o_proj(o.transpose(1, 2).reshape(N, A * block, nh * d))
        m = layer.mlp
        h = _norm(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    # rows 1..block-1 of every block as one contiguous [rows, H] matrix: a single GEMM against the LM head (a
    # strided 4-d operand made matmul run a batched GEMM per sequence: 12.3 ms of a 53.8 ms step on the H200, 43.9
    # after)
    out = _norm(x.view(N, A, block, H)[:, :, 1:].reshape(-1, H), draft.norm.weight, cfg.rms_norm_eps)
    return (out @ head_w.t()).view(N, A, block - 1, -1)
