"""Tensor parallelism of hybrid (Qwen3.5) targets: Gated DeltaNet layers sharded by key heads and gated attention by
heads. Each sharded mixer's partial outputs add up to the whole mixer's, over a prefill and a tree pass; under
torchrun with gloo at widths 2 and 4, the prefill logits match width 1, the recurrent cache holds the rank's heads
only, and AR, DFlash and DDTree (budgets 15 and 32, random and oracle drafts) give width 1's AR tokens; widths the
heads cannot be split into are refused with one error."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

import engine
from engine.cache import AttentionLayerCache, RecurrentLayerCache
from engine.exactness import compare_tokens, tolerance_for
from engine.launch import run_torchrun
from engine.parallel import TensorParallel, check_fits, shard_attention, shard_gated_delta

from .checkpoints import make_hybrid_checkpoint
from .hybrid_tp_worker import decode_all, prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid-tp"), "q35-tp", seed=4)[0]


@pytest.fixture(scope="module")
def width1(checkpoint):
    return decode_all(engine.load_target(str(checkpoint), "cpu", torch.float32))


def _record_calls(model, ids):
    """Each mixer's first two calls in a DDTree decode: the prompt's chain, then the first verify tree (x and its
    rows, copied: the decoder reuses its buffers)."""
    calls = [[] for _ in model.layers]

    def recorder(i):
        def hook(module, args):
            if len(calls[i]) < 2:
                calls[i].append(copy.deepcopy(args[:2]))
        return hook

    handles = [block.mixer.register_forward_pre_hook(recorder(i)) for i, block in enumerate(model.layers)]
    try:
        ar = engine.Decoder(model).generate(ids, 8)
        drafter = engine.OracleDrafter(ids + ar.tokens, model.cfg.vocab_size, 8, miss_rate=0.5, seed=1)
        for c in calls:
            c.clear()
        engine.Decoder(model, drafter, engine.DecodeSettings("ddtree", 15)).generate(ids, 4)
    finally:
        for h in handles:
            h.remove()
    return calls


def _replay(mixer, calls):
    """The mixer's outputs for the recorded calls, from a fresh layer cache of its own (the rank's) shape."""
    (x1, rows1), (x2, rows2) = copy.deepcopy(calls)
    if hasattr(mixer, "state_shape"):
        cache = RecurrentLayerCache(mixer.state_shape(), 1, x1.dtype, x1.device)
    else:
        shape = (1, mixer.num_kv_heads, 64, mixer.head_dim)
        cache = AttentionLayerCache(torch.zeros(shape), torch.zeros(shape))
    first = mixer(x1, rows1, cache)
    if hasattr(cache, "keep_prefix"):
        cache.keep_prefix(x1.shape[1])  # the prompt's state and window, as the decoder commits them
    return torch.cat((first, mixer(x2, rows2, cache)), dim=1)


@pytest.mark.parametrize("world", (2, 4))
def test_sharded_mixers_add_up_to_the_whole(checkpoint, world):
    """Rank by rank, without processes: the all-reduce replaced by a sum over the ranks' partial outputs, for a
    prompt and then a verify tree with siblings (each Gated DeltaNet row's state from its own parent)."""
    target = engine.load_target(str(checkpoint), "cpu", torch.float32)
    model = target.model
    calls = _record_calls(model, prompt(target))
    tree = calls[0][1][1].node_mask
    assert (tree.sum(1) < torch.arange(1, len(tree) + 1)).any(), "the verify pass should hold a branching tree"
    kinds = set()
    for block, mixer_calls in zip(model.layers, calls):
        whole = block.mixer
        total = 0
        for rank in range(world):
            part = copy.deepcopy(whole)
            tp = TensorParallel(rank, world)
            if hasattr(block, "linear_attn"):
                shard_gated_delta(part, tp)
                shape = part.state_shape()
                assert (shape.heads, shape.channels) == (whole.value_heads // world, sum(whole.split) // world)
            else:
                shard_attention(part, model.cfg, tp)
            part.fuse()
            part.tp = None  # the partial sum, added up below
            total = total + _replay(part, mixer_calls)
        expected = _replay(whole, mixer_calls)
        assert torch.allclose(total, expected, atol=1e-5, rtol=1e-4), (type(whole).__name__, world)
        kinds.add(type(whole).__name__)
    assert kinds == {"Attention", "GatedDeltaNet"}


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 4))
def test_sharded_decoding_equals_width1(checkpoint, width1, world, tmp_path):
    out = tmp_path / f"tp{world}.json"
    run_torchrun(world, ["-m", "correctness.hybrid_tp_worker", str(out), str(checkpoint)], timeout=600, cpu=True)
    sharded = json.loads(out.read_text())
    full_logits, logits = torch.tensor(width1["logits"]), torch.tensor(sharded["logits"])
    assert (logits - full_logits).abs().max() <= 1e-4 * max(1.0, full_logits.abs().max().item())
    # the recurrent state and conv window hold this rank's value heads and channels only
    heads, channels = width1["state"][1], width1["window"][1]
    assert sharded["state"] == [1, heads // world, *width1["state"][2:]]
    assert sharded["window"] == [1, channels // world, width1["window"][2]]
    tol = tolerance_for(torch.float32)
    runs = {"ar": sharded["ar"], **{name: m["tokens"] for name, m in sharded["methods"].items()}}
    runs.update({f"{name} at width 1": m["tokens"] for name, m in width1["methods"].items()})
    for name, tokens in runs.items():
        verdict = compare_tokens(width1["ar"], width1["margins"], tokens, tol)
        assert verdict.ok, f"{name} at width {world} vs AR at width 1: {verdict.describe()}"
    for name, m in sharded["methods"].items():
        if "oracle" in name:
            assert m["tau"] > 1.5, f"{name}: the oracle should be accepted several tokens a round"


@pytest.mark.parametrize("world,ok", [(2, True), (4, True), (3, False), (8, False)])
def test_widths_must_divide_the_key_heads(world, ok):
    """4 key heads: widths 2 and 4 fit, 3 and 8 do not (the attention's 8 KV heads would fit all four)."""
    cfg = SimpleNamespace(num_heads=16, num_kv_heads=8, intermediate_size=96, linear_num_key_heads=4)
    if ok:
        check_fits(cfg, world)
    else:
        with pytest.raises(engine.EngineError, match="Gated DeltaNet layers: their 4 key heads"):
            check_fits(cfg, world)
