"""Published model shapes for `synthetic:<preset>` targets (random weights; timing and tests only)."""

SYNTHETIC_PRESETS = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
                         rope_theta=100000.0, eos_token_id=2),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
                       rope_theta=1000000.0, eos_token_id=151645),
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                     rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
                     rope_theta=1000000.0, eos_token_id=151645),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
                     rope_theta=1000000.0, eos_token_id=151645),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                         rope_theta=500000.0, eos_token_id=128009,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # Hybrid (Gated DeltaNet + gated attention, every fourth layer attention): Qwen3.6-27B's published shape, a small
    # one of the same family for quick GPU runs, and a tiny one the CPU perf suite measures (neither is published).
    "qwen3.6-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                        max_position_embeddings=262144, tie_word_embeddings=False,
                        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
    "hybrid-small": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=3072,
                         linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, tie_word_embeddings=False,
                         rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
    # Small enough that the CPU perf run of every method over the four workloads takes seconds (the Gated DeltaNet
    # layers run their PyTorch references row by row there); no tokenizer, so the vocabulary can be small too. Its
    # heads split over every width the perf suite runs (1, 2, 4, 8).
    "hybrid-tiny": dict(model_type="qwen3_5_text", vocab_size=4096, hidden_size=128, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=384,
                        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                        max_position_embeddings=4096, tie_word_embeddings=False,
                        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)),
}

# Draft layers of the public DFlash drafts for each shape (a random draft of that depth costs what they cost).
SYNTHETIC_DRAFT_LAYERS = {"smollm2-135m": 1, "qwen3-0.6b": 1, "qwen3-4b": 5, "qwen3-8b": 5, "llama-3.1-8b": 5,
                          "qwen3.6-27b": 5, "hybrid-small": 1, "hybrid-tiny": 1}
