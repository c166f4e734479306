"""The DFlash drafter's incremental pass (draft KV cache of earlier context, padding rows past `n_features`, block
entries dropped after each call) equals a from-scratch reference of the DFlash draft (docs/design.md) written with
plain tensor ops."""
from __future__ import annotations

import math

import pytest
import torch

import engine
from engine.draft import DraftInput

from .checkpoints import random_draft_context


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, inv_freq):
    ang = pos[:, None].float() * inv_freq[None]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference_block_logits(drafter, target, features, bonus, lm_head=None):
    """Draft logits for the block after all `features` context tokens, recomputed from nothing (with the LM head
    `lm_head`, default the target's)."""
    draft, cfg = drafter.draft, drafter.draft.dcfg.layers
    n, B = features.shape[1], drafter.block_size
    eps, H, KV, D = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv_freq = drafter.rotary.inv_freq
    ctx = rms(features[0] @ draft.fc.weight.T, draft.hidden_norm.weight, eps)          # [n, hidden]
    block = torch.full((B,), drafter.mask_token_id)
    block[0] = bonus
    x = target.embed_tokens.weight[block]                                             # [B, hidden]
    pos_all, pos_q = torch.arange(n + B), torch.arange(n, n + B)
    for layer in draft.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, eps)
        kv_in = torch.cat((ctx, h))
        q = rms((h @ a.q_proj.weight.T).view(B, H, D), a.q_norm.weight, eps).transpose(0, 1)
        k = rms((kv_in @ a.k_proj.weight.T).view(n + B, KV, D), a.k_norm.weight, eps).transpose(0, 1)
        v = (kv_in @ a.v_proj.weight.T).view(n + B, KV, D).transpose(0, 1)
        q, k = rope(q, pos_q, inv_freq), rope(k, pos_all, inv_freq)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D), -1) @ v            # non-causal
        x = x + att.transpose(0, 1).reshape(B, H * D) @ a.o_proj.weight.T
        m = rms(x, layer.post_attention_layernorm.weight, eps)
        x = x + (torch.nn.functional.silu(m @ layer.mlp.gate_proj.weight.T) * (m @ layer.mlp.up_proj.weight.T)) \
            @ layer.mlp.down_proj.weight.T
    return rms(x, draft.norm.weight, eps)[1:] @ (target.lm_head.weight if lm_head is None else lm_head).T


@pytest.mark.parametrize("layers,block_size", [(1, 4), (3, 8)])
def test_incremental_draft_equals_full_recompute(tiny_checkpoints, layers, block_size):
    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    drafter = engine.load_drafter(f"random:{layers}", target, block_size, seed=3)
    with torch.no_grad():
        for p in drafter.draft.parameters():   # non-trivial norm weights, so that every norm is exercised
            p.add_(torch.randn_like(p) * 0.3)
    gen = torch.Generator().manual_seed(1)
    F = len(drafter.feature_layers) * target.model.cfg.hidden_size
    features = torch.randn(1, 30, F, generator=gen)
    tokens = torch.randint(0, target.model.cfg.vocab_size, (1, 31), generator=gen)
    drafter.start(prompt_len=9, capacity=64)
    seen = 0
    for new in (9, 1, 4, 7, 1, 8):  # context features committed between calls (prompt, then accepted tokens)
        padded = torch.cat((features[:, seen:seen + new], torch.randn(1, 3, F, generator=gen)), dim=1)
        got = drafter.propose(DraftInput(tokens, torch.tensor(seen + new), padded, torch.tensor(new)))
        seen += new
        want = reference_block_logits(drafter, target.model, features[:, :seen], int(tokens[0, seen]))
        assert got.shape == (block_size - 1, target.model.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["model", "w8a8"])
def test_a_prefilled_prompt_drafts_as_if_the_first_call_read_it(tiny_checkpoints, weights):
    """Drafter.prefill (the draft's prefill, with the target's): the prompt's context stored, then a first call with
    no context rows of its own (n_features 0, padding only) proposes what a first call reading the prompt's features
    proposes, and so do the calls after it; also into one row of a batched drafter, beside a row in use."""
    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    read, prefilled, batched = (engine.load_drafter("random:2", target, 6, seed=3, weights=weights) for _ in range(3))
    features, tokens = random_draft_context(target, [read, prefilled], 20, prompt_len=9)
    batched.start(prompt_len=9, capacity=64, sequences=2)
    padding = torch.randn(1, 6, features.shape[-1], generator=torch.Generator().manual_seed(5))
    assert prefilled.prefill(features[0, :9]) and batched.prefill(features[0, :9], row=1)
    assert int(prefilled.cache.start) == 9 and batched.cache.start.tolist() == [0, 9]
    seen = 9
    for step, new in enumerate((0, 3, 5)):
        first = step == 0
        want = read.propose(DraftInput(tokens, torch.tensor(seen + new), features[:, :9] if first else
                                       features[:, seen:seen + new], torch.tensor(9 if first else new)))
        context = padding if first else torch.cat((features[:, seen:seen + new], padding[:, new:]), dim=1)
        got = prefilled.propose(DraftInput(tokens, torch.tensor(seen + new), context, torch.tensor(new)))
        rows = batched.propose(DraftInput(tokens.expand(2, -1), torch.tensor([seen + new] * 2),
                                          context.expand(2, -1, -1), torch.tensor([1, new])))
        seen += new
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rows[1], want, rtol=1e-4, atol=1e-4)
    assert int(prefilled.cache.start) == seen and batched.cache.start.tolist() == [3, seen]


def test_the_decoder_prefills_the_draft_where_the_drafter_can(tiny_checkpoints, monkeypatch):
    """The decode loop hands the prompt's context to Drafter.prefill, and round 0 then drafts from the static
    buffers (no context rows); a drafter without a prefill gets the prompt's features in round 0. Same tokens."""
    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    prompt = [5, 9, 2, 7, 11, 3]
    ar = engine.Decoder(target.model).generate(prompt, 12).tokens
    for can_prefill in (True, False):
        drafter = engine.load_drafter("random:2", target, 4, seed=3)
        if not can_prefill:
            monkeypatch.setattr(drafter, "prefill", lambda features, row=None: False)
        first_calls = []
        propose = drafter.propose
        monkeypatch.setattr(drafter, "propose", lambda inp: first_calls.append(
            (inp.features.shape[1], int(inp.n_features))) or propose(inp))
        out = engine.Decoder(target.model, drafter, engine.DecodeSettings("ddtree", 4)).generate(prompt, 12).tokens
        assert out == ar
        assert first_calls[0] == ((4, 0) if can_prefill else (len(prompt), len(prompt)))


def test_a_draft_asked_for_fewer_positions_returns_those(tiny_checkpoints):
    """DraftInput.depth (a DDTree budget below the block): the first `depth` positions' logits, as the whole block
    gives them, and the context it keeps is the same for the next call."""
    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(2)
    drafters = [engine.load_drafter("random:2", target, 8, seed=3) for _ in range(2)]
    F = len(drafters[0].feature_layers) * target.model.cfg.hidden_size
    features = torch.randn(1, 20, F, generator=gen)
    tokens = torch.randint(0, target.model.cfg.vocab_size, (1, 21), generator=gen)
    for d in drafters:
        d.start(prompt_len=9, capacity=64)
    seen = 0
    for new in (9, 3, 5):
        inputs = [DraftInput(tokens, torch.tensor(seen + new), features[:, seen:seen + new], torch.tensor(new), depth)
                  for depth in (None, 3)]
        full, part = (d.propose(inp) for d, inp in zip(drafters, inputs))
        seen += new
        assert full.shape[0] == 7 and part.shape[0] == 3
        torch.testing.assert_close(part, full[:3], rtol=1e-5, atol=1e-5)


def test_default_target_layers_stay_inside_shallow_targets(tiny_checkpoints):
    """A draft that names no target layers reads the public rule's layers (1 .. L - 3, evenly spaced); a target of
    fewer than 5 layers gets them clamped into the model instead of layer -1, and a random 3-layer draft of a 2-layer
    target decodes losslessly."""
    from engine.draft import default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33] and default_target_layer_ids(30, 1) == [15]
    for layers in range(1, 7):
        for draft_layers in range(1, 6):
            ids = default_target_layer_ids(layers, draft_layers)
            assert len(ids) == draft_layers and all(0 <= i < layers for i in ids), (layers, draft_layers, ids)
    path, _ = tiny_checkpoints["qwen2-bias"]  # 2 layers
    target = engine.load_target(str(path), "cpu", torch.float32)
    prompt = [5, 9, 2, 7]
    ar = engine.Decoder(target.model).generate(prompt, 8).tokens
    drafter = engine.load_drafter("random:3", target, 4)
    assert engine.Decoder(target.model, drafter, engine.DecodeSettings("ddtree", 4)).generate(prompt, 8).tokens == ar


def dequantized(w):
    from kernels.int8_linear import quantize_int8

    qw = quantize_int8(w)
    return qw.q.float() * qw.scale[:, None]


def twelve_token_input(target, *drafters):
    """A DraftInput of 12 context rows (random features) and 13 tokens, the drafters started for it."""
    features, tokens = random_draft_context(target, drafters, 12, prompt_len=12)
    return DraftInput(tokens, torch.tensor(12), features, torch.tensor(12)), features, tokens


def test_int8_weights_compute_the_draft_of_the_dequantized_weights(tiny_checkpoints):
    """--draft-weights int8: every projection and the LM head run from int8 weights with a scale per row. The
    proposal is the from-scratch draft of those weights dequantized, and not the draft's own (the int8 path ran)."""
    from torch import nn

    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    exact = engine.load_drafter("random:2", target, 8, seed=3)
    int8 = engine.load_drafter("random:2", target, 8, seed=3, weights="int8")
    released = int8.draft.layers[0].mlp.down_proj.weight
    assert released.numel() == 0 and int8.draft.fc.weight.numel() == 0  # the 16-bit copies are gone
    inp, features, tokens = twelve_token_input(target, exact, int8)
    own, got = exact.propose(inp), int8.propose(inp)
    with torch.no_grad():
        for m in exact.draft.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(dequantized(m.weight))
    want = reference_block_logits(exact, target.model, features, int(tokens[0, 12]),
                                  lm_head=dequantized(target.model.lm_head.weight))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - own).abs().max() > 1e-3  # quantization moved the logits: the int8 path ran


@pytest.mark.parametrize("weights", ["int8", "w8a8"])
def test_int8_draft_decodes_losslessly(tiny_checkpoints, weights):
    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    prompt = [5, 9, 2, 7, 11, 3]
    ar = engine.Decoder(target.model).generate(prompt, 24).tokens
    drafter = engine.load_drafter("random:2", target, 6, weights=weights)
    for method, budget in (("dflash", 0), ("ddtree", 6)):
        decoder = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget))
        assert decoder.generate(prompt, 24).tokens == ar, method


def test_w8a8_draft_quantizes_the_rows_its_norms_hand_on(tiny_checkpoints, monkeypatch):
    """--draft-weights w8a8: the int8 draft, but the qkv, gate/up and LM-head GEMMs read int8 rows made by the norms
    (kernels.int8_linear.Int8Rows). Its proposal is close to the int8 draft's, not equal (the rows were rounded), and
    every one of those GEMMs got int8 rows."""
    from engine import model as model_module
    from kernels.int8_linear import Int8Rows

    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    int8 = engine.load_drafter("random:2", target, 8, seed=3, weights="int8")
    w8a8 = engine.load_drafter("random:2", target, 8, seed=3, weights="w8a8")
    inp = twelve_token_input(target, int8, w8a8)[0]
    calls = []
    real = model_module.int8_linear
    monkeypatch.setattr(model_module, "int8_linear",
                        lambda x, *a, **k: calls.append(isinstance(x, Int8Rows)) or real(x, *a, **k))
    want, got = int8.propose(inp), w8a8.propose(inp)
    n = len(calls) // 2
    assert sum(calls[:n]) == 0 and sum(calls[n:]) == 2 * 2 + 1  # qkv and gate/up of 2 layers, the LM head
    assert 0 < (got - want).abs().max() < 0.1 * want.abs().max()


def test_int8_draft_weights_bad_requests_get_one_error(tiny_checkpoints):
    from engine.draft import DFlashDrafter
    from engine.errors import EngineError
    from engine.loading import random_draft

    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    with pytest.raises(EngineError, match="draft weights must be one of model, int8, w8a8, got 'fp4'"):
        engine.load_drafter("random:1", target, 4, weights="fp4")
    draft = random_draft(target, 1)
    draft.layers[0].self_attn.tp = object()  # as engine.parallel.shard_draft leaves a sharded draft
    with pytest.raises(EngineError, match="int8 draft weights need a replicated draft"):
        DFlashDrafter(draft, target.model, 4, weights="int8")
