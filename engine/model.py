"""The engine's own Llama/Qwen-family decoder: GQA attention over a preallocated cache, RoPE, SwiGLU MLP.

Parameter names follow the Hugging Face checkpoints (minus the leading "model."), so a safetensors state dict
loads directly. Attention takes an explicit boolean mask over [committed prefix, new tokens]: causal for
prefill and linear verification, ancestor-only for tree verification.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import AttentionLayerCache, ModelCache, attention_cache
from .config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary:
    """cos/sin tables for absolute positions, computed from transformers' RoPE parameters of the config."""

    def __init__(self, hf_config, head_dim: int, device):
        inv_freq, self.scale, self.dim = rope_inv_freq(hf_config, head_dim)
        self.inv_freq = inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, rot_dim]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def query(self, x, cos, sin) -> torch.Tensor:
        """[B, T, hidden] -> rotated queries [B, heads, T, head_dim]."""
        q = self.q_proj(x).view(*x.shape[:2], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rotary(q.transpose(1, 2), cos, sin)

    def key_value(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> rotated keys and values [B, kv_heads, T, head_dim]."""
        k = self.k_proj(x).view(*x.shape[:2], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(*x.shape[:2], self.num_kv_heads, self.head_dim)
        return apply_rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """Queries [B, H, T, D] over keys [B, KVH, S, D] with a boolean mask [.., T, S] -> [B, T, hidden]."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))

    def forward(self, x, cos, sin, layer_cache: AttentionLayerCache, start: int, mask) -> torch.Tensor:
        k, v = layer_cache.store(start, *self.key_value(x, cos, sin))
        return self.attend(self.query(x, cos, sin), k, v, mask)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer_cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """A decoder-only target model. `forward` runs new tokens against the cache; `logits` applies the LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: Rotary | None = None  # built by `ready`, once the model sits on its device

    def ready(self) -> "Transformer":
        self.rotary = Rotary(self.cfg.hf, self.cfg.head_dim, self.embed_tokens.weight.device)
        return self.eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, capacity: int, batch: int = 1) -> ModelCache:
        c = self.cfg
        return attention_cache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device, batch)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: ModelCache, mask: torch.Tensor | None,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions [B, T]; mask [T, length+T] (None: every query sees every key).

        Writes the T new key/value rows after the committed prefix (committing is the caller's `cache.keep`).
        Returns the final-normed hidden states [B, T, hidden] and the concatenated outputs of the `capture`
        layers [B, T, len(capture) * hidden] (None when nothing is captured).
        """
        cache.check_room(tokens.shape[1])
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        captured = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers)):
            x = layer(x, cos, sin, layer_cache, cache.length, mask)
            if i in capture:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return self.norm(x), features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
