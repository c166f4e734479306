"""Small random Hugging Face checkpoints at odd shapes, written with save_pretrained: the tests' own targets."""
from __future__ import annotations

import torch

# Small random checkpoints at odd shapes. initializer_range is raised so that logits are spread out and greedy
# near-ties (which the exactness rule tolerates) stay rare in float32.
TINY = {
    "llama-gqa-untied": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=301, tie_word_embeddings=False)),
    "llama-tied-mha-rope3": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
        vocab_size=263, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "qwen3-mqa-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, head_dim=24, intermediate_size=90, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=257, tie_word_embeddings=True)),
    "qwen3-gqa-untied-sharded": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=80, head_dim=20, intermediate_size=120, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=389, tie_word_embeddings=False)),
    "mistral-gqa": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=8, vocab_size=199, tie_word_embeddings=False, sliding_window=None)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=56, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=211, tie_word_embeddings=False)),
}


def make_tiny_checkpoint(root, name: str, seed: int = 0):
    """Write a random checkpoint with save_pretrained; return (path, the transformers model)."""
    import transformers

    cfg_cls, model_cls, kw = TINY[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                                         eos_token_id=2, **kw)
    model = getattr(transformers, model_cls)(cfg).eval()
    path = root / name
    model.save_pretrained(path, max_shard_size="100KB" if "sharded" in name else "10GB")
    return path, model
