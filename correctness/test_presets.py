"""Synthetic presets: every published shape builds a valid config with its RoPE; small ones decode losslessly."""
from __future__ import annotations

import pytest
import torch

import engine
from engine.config import ModelConfig, rope_inv_freq
from engine.loading import _hf_config
from engine.presets import SYNTHETIC_PRESETS


@pytest.mark.parametrize("preset", sorted(SYNTHETIC_PRESETS))
def test_preset_config(preset):
    shape = SYNTHETIC_PRESETS[preset]
    cfg = ModelConfig.from_hf(_hf_config(shape, preset))
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == \
        (shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"])
    inv_freq, scale, rot_dim = rope_inv_freq(cfg.hf, cfg.head_dim, partial=cfg.model_type == "qwen3_5_text")
    rotary = int(cfg.head_dim * shape.get("rope_parameters", {}).get("partial_rotary_factor", 1.0))  # hybrids: 1/4
    assert rot_dim == rotary and inv_freq.numel() == rotary // 2 and torch.isfinite(inv_freq).all()
    assert cfg.hybrid == (shape["model_type"] == "qwen3_5_text")
    if "rope_scaling" in shape:  # llama3 scaling stretches the low frequencies
        plain = 1.0 / shape["rope_theta"] ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        assert inv_freq[-1] < plain[-1] and torch.allclose(inv_freq[0], plain[0])


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3.6-27b", "smollm2-135m"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_equals_the_formula(preset, dtype):
    """Positions gathered from the table (bound given) carry the same cos and sin, bit for bit, as computed ones, for
    scaled, partial and plain RoPE; a larger bound grows the table and keeps the earlier one alive (CUDA graphs of
    another decoder may read it)."""
    from engine.model import Rotary

    cfg = ModelConfig.from_hf(_hf_config(SYNTHETIC_PRESETS[preset], preset))
    rotary = Rotary(cfg, "cpu")
    positions = torch.tensor([[0, 1, 2, 300, 301], [7, 255, 256, 1000, 1023]])
    want = rotary.compute(positions, dtype)
    for bound in (1024, 3000):
        got = rotary(positions, dtype, bound=bound)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert [t.shape[1] for t in rotary.tables[dtype]] == [1024, 4096]


def test_small_synthetic_pair_is_lossless():
    target = engine.load_target("synthetic:smollm2-135m", "cpu", torch.float32)
    assert target.tokenizer is None and target.default_draft == "random:1"
    prompt = list(range(100, 120))
    ref = engine.Decoder(target.model).generate(prompt, 12, record_margins=True)
    for method in ("dflash", "ddtree"):
        drafter = engine.load_drafter("default", target)
        result = engine.Decoder(target.model, drafter, engine.DecodeSettings(method)).generate(prompt, 12)
        assert result.tokens == ref.tokens


def test_weights_are_allocated_once_in_the_model_dtype():
    """A model's weights are allocated in the dtype it runs in, never first in float32 (a 27B model in float32 is
    108 GB: loading it for bfloat16 ran out of an 80 GB GPU's memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.loading import _empty
    from engine.model import Transformer

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.device.type == "cpu":
                self.bytes[out.dtype] = self.bytes.get(out.dtype, 0) + out.numel() * out.element_size()
            return out

    cfg = ModelConfig.from_hf(_hf_config(SYNTHETIC_PRESETS["hybrid-tiny"], "hybrid-tiny"))
    with Allocations() as seen:
        model = _empty(lambda: Transformer(cfg), "cpu", torch.bfloat16, "hybrid-tiny")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert seen.bytes.get(torch.float32, 0) == 0, f"float32 allocations of {seen.bytes} for {weights} bytes of weights"
    assert seen.bytes[torch.bfloat16] >= weights
