"""engine.model's folded norms (Transformer.fold_norms): each block's two RMSNorm gains multiplied into the input
columns of the qkv and gate/up weights, each row's 1/rms applied by the kernel after the GEMM, o_proj's and
down_proj's outputs added into the residual stream by their GEMMs.

The same model before and after folding gives the same hidden states, features and logits up to float32 rounding,
at prefill, at a tree verify against a cache, and over whole sequences (draft training's features); where folding
does not apply, nothing changes. Greedy decoding against transformers with the norms folded is
test_ar_vs_hf.py's (the tiny checkpoints' norm gains are not one, so a gain on the wrong axis would show there); a
verify row equal to its decode step on the GPU is test_gpu_lossless.py's.
"""
from __future__ import annotations

import pytest
import torch

import engine
from engine.errors import EngineError

from .checkpoints import make_tiny_checkpoint

FOLDABLE = ["llama-gqa-untied", "qwen3-mqa-tied", "llama-tied-mha-rope3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("folded")
    return {name: make_tiny_checkpoint(root, name, seed=i)[0] for i, name in enumerate(FOLDABLE + ["qwen2-bias"])}


def passes(model, capture=(0, 1)):
    """Logits and features of a 9-row prefill, then of a 4-row tree verify after it (rows 1 and 2 both children of
    row 0), then of whole sequences from an empty cache (no mask: draft training's features)."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(64)
    out = []
    ids = torch.randint(3, vocab, (1, 9), generator=gen)
    h, f = model.forward(ids, torch.arange(9)[None], cache, torch.ones(9, 9, dtype=torch.bool).tril(), capture)
    out += [model.logits(h), f]
    cache.start.fill_(9)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    h, f = model.forward(torch.randint(3, vocab, (1, 4), generator=gen), torch.tensor([[9, 10, 10, 11]]), cache,
                         tree, capture)
    out += [model.logits(h), f]
    h, f = model.forward(torch.randint(3, vocab, (2, 6), generator=gen), torch.arange(6).expand(2, 6),
                         model.new_cache(8, batch=2), None, capture)
    return out + [model.logits(h), f]


@pytest.mark.parametrize("name", FOLDABLE)
def test_folded_passes_equal_the_unfolded(checkpoints, name):
    model = engine.load_target(str(checkpoints[name]), "cpu", torch.float32).model
    before = passes(model)
    plain = [(b.self_attn.qkv_weight.clone(), b.mlp.gate_up_weight.clone()) for b in model.layers]
    assert model.fold_norms() and model.norms_folded
    for block, (qkv, gate_up) in zip(model.layers, plain):  # every block, the gains on the input columns
        assert torch.equal(block.self_attn.qkv_weight, qkv * block.input_layernorm.weight)
        assert torch.equal(block.mlp.gate_up_weight, gate_up * block.post_attention_layernorm.weight)
    for i, (want, got) in enumerate(zip(before, passes(model))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"output {i}: {m}")


def test_fold_happens_once(checkpoints):
    model = engine.load_target(str(checkpoints["qwen3-mqa-tied"]), "cpu", torch.float32).model
    assert model.fold_norms()
    folded = model.layers[1].mlp.gate_up_weight.clone()
    assert model.fold_norms()
    assert torch.equal(model.layers[1].mlp.gate_up_weight, folded), "a second call folded the gains again"


def test_fold_declines_where_it_does_not_apply(checkpoints, monkeypatch):
    bias = engine.load_target(str(checkpoints["qwen2-bias"]), "cpu", torch.float32).model
    assert not bias.fold_norms(), "a qkv bias would be scaled by the norm with the GEMM's output"
    hybrid = engine.load_target("synthetic:hybrid-tiny", "cpu", torch.float32).model
    assert not hybrid.fold_norms()
    monkeypatch.setenv("ENGINE_FOLD_NORMS", "0")
    plain = engine.load_target(str(checkpoints["llama-gqa-untied"]), "cpu", torch.float32)
    qkv = plain.model.layers[0].self_attn.qkv_weight.clone()
    engine.Decoder(plain.model)
    assert not plain.model.norms_folded and torch.equal(plain.model.layers[0].self_attn.qkv_weight, qkv)
    monkeypatch.setenv("ENGINE_FOLD_NORMS", "maybe")
    with pytest.raises(EngineError, match="ENGINE_FOLD_NORMS"):
        plain.model.fold_norms()


def test_sharding_before_decoding_keeps_norms_and_after_is_refused(checkpoints):
    from engine.parallel import TensorParallel, shard_target

    sharded = engine.load_target(str(checkpoints["llama-gqa-untied"]), "cpu", torch.float32).model
    shard_target(sharded, TensorParallel(rank=0, world=2))
    assert not sharded.fold_norms(), "a sharded target adds its partial sums in the all-reduce"
    decoded = engine.load_target(str(checkpoints["llama-gqa-untied"]), "cpu", torch.float32).model
    engine.Decoder(decoded)
    assert decoded.norms_folded
    with pytest.raises(EngineError, match="shard the target before decoding"):
        shard_target(decoded, TensorParallel(rank=0, world=2))
