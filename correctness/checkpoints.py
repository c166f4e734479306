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
    """Write a random checkpoint with save_pretrained, its RMSNorm gains spread over [0.5, 1.5] (they start at one,
    where a gain applied to the wrong axis, or not at all, would not show); return (path, the transformers model)."""
    import transformers

    cfg_cls, model_cls, kw = TINY[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                                         eos_token_id=2, **kw)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = root / name
    model.save_pretrained(path, max_shard_size="100KB" if "sharded" in name else "10GB")
    return path, model


# Small random hybrid (Qwen3.5) checkpoints: attention first, last or adjacent; value heads 1x, 2x and 3x the key
# heads; partial rotary 0.25 and 0.5; a conv kernel of 3 and of 4; tied and untied heads; the multimodal release
# layout (the text model under model.language_model, a vision tower beside it).
_Q35 = dict(linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
HYBRID = {
    "q35-attn-first": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _Q35, vocab_size=211, hidden_size=48, intermediate_size=72, num_hidden_layers=5, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, tie_word_embeddings=False,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"])),
    "q35-attn-last-tied": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _Q35, vocab_size=197, hidden_size=40, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=20, linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=10,
        linear_value_head_dim=6, tie_word_embeddings=True, linear_conv_kernel_dim=3,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])),
    "q35-adjacent-ratio3": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _Q35, vocab_size=223, hidden_size=56, intermediate_size=80, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
        linear_value_head_dim=8, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention"])),
    "q35-multimodal": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
        text_config=dict(_Q35, vocab_size=211, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                         max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2),
        image_token_id=200, video_token_id=201, vision_start_token_id=202, vision_end_token_id=203)),
}
# The multimodal model's LM head is tied by the top-level tie_word_embeddings, whatever text_config says: tied with
# text_config silent, and untied (lm_head saved) with text_config saying tied.
_MM = HYBRID["q35-multimodal"][2]
HYBRID["q35-multimodal-tied"] = ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
    _MM, tie_word_embeddings=True))
HYBRID["q35-multimodal-untied"] = ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
    _MM, text_config=dict(_MM["text_config"], tie_word_embeddings=True), tie_word_embeddings=False))

# Hybrids for tensor parallelism (test_hybrid_tp.py): 4 key heads with 2 value heads each (whole at widths 2 and 4);
# 2 KV heads, split at width 2 and each replicated over 2 ranks at width 4; a gated attention between linear layers.
HYBRID_TP = {
    "q35-tp": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _Q35, vocab_size=233, hidden_size=64, intermediate_size=88, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
        linear_value_head_dim=6, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])),
}


def make_hybrid_checkpoint(root, name: str, seed: int = 0):
    """Write a random hybrid checkpoint with save_pretrained, its RMSNorm offsets perturbed (they start at zero, where
    1 + w and w + 1 cannot be told apart); return (path, the transformers model)."""
    import transformers

    cfg_cls, model_cls, kw = {**HYBRID, **HYBRID_TP}[name]
    torch.manual_seed(seed)
    extra = {} if "text_config" in kw else dict(max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                                                eos_token_id=2)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw, **extra)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    path = root / name
    model.save_pretrained(path)
    return path, model


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos) -> tuple[list[int], list[float]]:
    """transformers' greedy generate: tokens and the top-1 minus top-2 margin of each step's raw logits."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = [float(t[0] - t[1]) for t in (logits[0].float().topk(2).values for logits in out.logits)]
    return tokens, margins


def random_draft_context(target, drafters, rows: int, prompt_len: int, seed: int = 4):
    """(features [1, rows, F], tokens [1, rows + 1]): random target features for the drafters' feature layers and
    random token ids, the drafters started for a prompt of prompt_len tokens."""
    gen = torch.Generator().manual_seed(seed)
    F = len(drafters[0].feature_layers) * target.model.cfg.hidden_size
    features = torch.randn(1, rows, F, generator=gen)
    tokens = torch.randint(0, target.model.cfg.vocab_size, (1, rows + 1), generator=gen)
    for d in drafters:
        d.start(prompt_len=prompt_len, capacity=64)
    return features, tokens
