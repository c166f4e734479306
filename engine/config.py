"""Target-model configuration: the fields the engine's own model code needs, read from a transformers config."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .errors import EngineError

# Architectures whose decoder blocks the engine implements: Llama-style pre-norm GQA blocks, and the hybrid Qwen3.5
# family (Gated DeltaNet and gated attention layers; `qwen3_5` is the multimodal checkpoint, whose text part is used).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_5_text", "qwen3_5")
HYBRID_MODEL_TYPES = ("qwen3_5_text",)
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid targets (Qwen3.5): which layers are Gated DeltaNet ("linear_attention") and their shapes, the sigmoid
    # gate on the attention output, and RMSNorm weights stored as offsets from 1 in the checkpoint.
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    norm_offset: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    hf: object = field(default=None, compare=False, repr=False)  # the transformers config, for RoPE parameters

    @property
    def hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    @classmethod
    def from_hf(cls, hf, where: str = "checkpoint") -> "ModelConfig":
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise EngineError(f"{where}: unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise EngineError(f"{where}: unsupported hidden_act {hf.hidden_act!r} (only silu)")
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise EngineError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        try:  # RoPE problems now, naming the checkpoint, before its weights load
            rope_inv_freq(hf, head_dim, partial=model_type in HYBRID_MODEL_TYPES)
        except EngineError as e:
            raise EngineError(f"{where}: {e}") from None
        except (TypeError, ValueError, KeyError) as e:  # e.g. a rope_theta of null: transformers lets it through
            raise EngineError(f"{where}: invalid RoPE parameters {rope_parameters(hf)} ({type(e).__name__}: {e})"
                              ) from None
        eos = getattr(hf, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        hybrid = model_type in HYBRID_MODEL_TYPES
        layer_types = tuple(getattr(hf, "layer_types", None) or ()) if hybrid else ()
        if hybrid:
            unknown = [t for t in layer_types if t not in LAYER_TYPES]
            if unknown or len(layer_types) != hf.num_hidden_layers:
                raise EngineError(f"{where}: layer_types must list {hf.num_hidden_layers} of {', '.join(LAYER_TYPES)}, "
                                  f"got {list(layer_types)}")
            if hf.linear_num_value_heads % hf.linear_num_key_heads:
                raise EngineError(f"{where}: linear_num_value_heads {hf.linear_num_value_heads} is not a multiple of "
                                  f"linear_num_key_heads {hf.linear_num_key_heads}")
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=hf.rms_norm_eps,
            max_position=getattr(hf, "max_position_embeddings", None) or 2048,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_5_text"),
            # Qwen2 always has q/k/v biases and no o_proj bias; the others follow `attention_bias`.
            qkv_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=eos,
            layer_types=layer_types,
            attn_output_gate=hybrid,
            norm_offset=hybrid,
            linear_num_key_heads=getattr(hf, "linear_num_key_heads", 0) if hybrid else 0,
            linear_num_value_heads=getattr(hf, "linear_num_value_heads", 0) if hybrid else 0,
            linear_key_head_dim=getattr(hf, "linear_key_head_dim", 0) if hybrid else 0,
            linear_value_head_dim=getattr(hf, "linear_value_head_dim", 0) if hybrid else 0,
            linear_conv_kernel=getattr(hf, "linear_conv_kernel_dim", 0) if hybrid else 0,
            hf=hf,
        )


def check_full_attention(hf, where: str) -> None:
    """Targets must use full attention in every layer, or Gated DeltaNet where a hybrid model says so (sliding-window
    targets are not supported)."""
    if hf.model_type in HYBRID_MODEL_TYPES:
        return  # its layer_types are checked by ModelConfig.from_hf
    layer_types = getattr(hf, "layer_types", None) or []
    window = getattr(hf, "sliding_window", None)
    # Qwen configs carry a sliding_window that only applies with use_sliding_window; Mistral's always applies.
    windowed = window and (getattr(hf, "use_sliding_window", hf.model_type == "mistral"))
    if any(t != "full_attention" for t in layer_types) or (windowed and window < hf.max_position_embeddings):
        raise EngineError(f"{where}: sliding-window attention layers are not supported")


def rope_parameters(hf) -> dict:
    """The RoPE parameters of a transformers config, in either the 5.x (`rope_parameters`) or 4.x layout."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(hf, head_dim: int, partial: bool) -> tuple[torch.Tensor, float, int]:
    """Inverse frequencies, the cos/sin scale and the rotary width for a config, using transformers' RoPE init.
    partial: the model type rotates partial_rotary_factor of each head (the hybrid family); transformers' Llama,
    Mistral, Qwen2 and Qwen3 rotate the whole head whatever the field says, and so do these models and DFlash drafts."""
    params = rope_parameters(hf)
    rope_type = params["rope_type"]
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None)) or 1.0
    if not partial and factor != 1.0:
        hf, factor = _whole_head_rotary(hf), 1.0
    rot_dim = int(head_dim * factor)
    if rope_type == "default":
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
        return inv_freq, 1.0, rot_dim
    if rope_type in ("dynamic", "longrope"):
        raise EngineError(f"RoPE scaling {rope_type!r} depends on the sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise EngineError(f"unknown RoPE scaling type {rope_type!r}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(scale), 2 * inv_freq.numel()


def _whole_head_rotary(hf):
    """A copy of a config without partial_rotary_factor (in the 5.x and the 4.x layout), for transformers' RoPE
    init functions, which read it for any model type."""
    hf = copy.deepcopy(hf)
    if isinstance(getattr(hf, "rope_parameters", None), dict):
        hf.rope_parameters = {k: v for k, v in hf.rope_parameters.items() if k != "partial_rotary_factor"}
    if getattr(hf, "partial_rotary_factor", None) is not None:
        hf.partial_rotary_factor = 1.0
    return hf
