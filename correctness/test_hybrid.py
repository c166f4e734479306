"""Hybrid targets (Qwen3.5: Gated DeltaNet and gated attention layers) on a CPU: the engine's AR equals
transformers' greedy generate on small random checkpoints of every layout, DFlash and DDTree equal AR with random
drafts and with the oracle drafter (side branches accepted, so recurrent states are kept along non-contiguous
paths), stop tokens end inside blocks, and a verify pass that carries the recurrent state from sibling to sibling
gives other tokens: the leak that tree-safe verification prevents, which this suite would catch."""
from __future__ import annotations

import pytest
import torch

import engine
import engine.gated_delta
from engine.exactness import compare_tokens, tolerance_for

from .checkpoints import HYBRID, hf_greedy, make_hybrid_checkpoint

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {name: make_hybrid_checkpoint(root, name, seed=i) for i, name in enumerate(HYBRID)}


@pytest.fixture(scope="module")
def lossless_case(hybrids):
    """One target with two prompts and their AR references (margins recorded)."""
    target = engine.load_target(str(hybrids["q35-attn-first"][0]), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, target.model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (6, 17)]
    refs = [engine.Decoder(target.model).generate(p, NEW_TOKENS, record_margins=True) for p in prompts]
    return target, prompts, refs


def assert_lossless(ref, result, what):
    verdict = compare_tokens(ref.tokens, ref.margins, result.tokens, tolerance_for(torch.float32))
    assert verdict.ok, f"{what}: {verdict.describe()}\nAR:   {ref.tokens}\nspec: {result.tokens}"


def oracle(target, prompt, ref, block_size, seed=0, miss_rate=0.3):
    return engine.OracleDrafter(prompt + ref.tokens, target.model.cfg.vocab_size, block_size, miss_rate=miss_rate,
                                seed=seed)


@pytest.mark.parametrize("name", list(HYBRID))
def test_ar_equals_transformers(hybrids, name):
    path, hf_model = hybrids[name]
    target = engine.load_target(str(path), "cpu", torch.float32)
    assert target.model.cfg.hybrid
    gen = torch.Generator().manual_seed(len(name))
    vocab = target.model.cfg.vocab_size
    for prompt in [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 5, 19)] + [[1, 2, 2, 5, 2]]:
        ours = engine.Decoder(target.model).generate(prompt, NEW_TOKENS)
        ref, margins = hf_greedy(hf_model, prompt, NEW_TOKENS, None)
        verdict = compare_tokens(ref, margins, ours.tokens, tolerance_for(torch.float32))
        assert verdict.ok, f"{name}: engine AR vs HF generate: {verdict.describe()}\nHF:  {ref}\nour: {ours.tokens}"


@pytest.mark.parametrize("block_size", (2, 4, 8))
def test_dflash_equals_ar(lossless_case, block_size):
    target, prompts, refs = lossless_case
    random_draft = engine.load_drafter("random:1", target, block_size)
    taus = []
    for prompt, ref in zip(prompts, refs):
        for drafter in (random_draft, oracle(target, prompt, ref, block_size)):
            result = engine.Decoder(target.model, drafter, engine.DecodeSettings("dflash")).generate(prompt, NEW_TOKENS)
            assert_lossless(ref, result, f"dflash block {block_size} {type(drafter).__name__}")
            taus.append(result.tau)
    assert max(taus) > 1.5, "the oracle drafter should drive multi-token acceptance"


@pytest.mark.parametrize("budget", (1, 2, 4, 8, 15, 16, 32, 64))
def test_ddtree_equals_ar(lossless_case, budget):
    target, prompts, refs = lossless_case
    random_draft = engine.load_drafter("random:1", target, 8, seed=budget)
    for topk_cap in (1, 3, 8):
        settings = engine.DecodeSettings("ddtree", budget, topk_cap)
        for seed, (prompt, ref) in enumerate(zip(prompts, refs)):
            for drafter in (random_draft, oracle(target, prompt, ref, 8, seed=seed)):
                result = engine.Decoder(target.model, drafter, settings).generate(prompt, NEW_TOKENS)
                assert_lossless(ref, result, f"ddtree budget={budget} cap={topk_cap} {type(drafter).__name__}")


def test_side_branches_are_accepted(lossless_case, monkeypatch):
    """The oracle's demoted tokens make DDTree accept nodes that are not the first child: committed recurrent states
    then come from non-contiguous rows (the walk's path), which the tests above must have exercised."""
    target, prompts, refs = lossless_case
    paths = []
    keep = engine.cache.ModelCache.keep

    def recording(self, path, accepted):
        paths.append(path[:int(accepted)].tolist())
        return keep(self, path, accepted)
    monkeypatch.setattr(engine.cache.ModelCache, "keep", recording)
    for prompt, ref in zip(prompts, refs):
        engine.Decoder(target.model, oracle(target, prompt, ref, 8, miss_rate=0.4),
                       engine.DecodeSettings("ddtree", 32)).generate(prompt, NEW_TOKENS)
    assert any(p != list(range(len(p))) for p in paths), paths


@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 15)])
def test_stop_tokens(lossless_case, method, budget):
    """A stop token inside an accepted block ends generation right after it, exactly where AR stops."""
    target, prompts, refs = lossless_case
    prompt, ref = prompts[0], refs[0]
    stop = ref.tokens[13]
    expected = ref.tokens[:ref.tokens.index(stop) + 1]
    assert engine.Decoder(target.model).generate(prompt, NEW_TOKENS, (stop,)).tokens == expected
    for drafter in (oracle(target, prompt, ref, 8, miss_rate=0.0), engine.load_drafter("random:1", target, 8)):
        result = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget)).generate(
            prompt, NEW_TOKENS, (stop,))
        assert result.tokens == expected


def test_state_carried_across_siblings_gives_other_tokens(lossless_case, monkeypatch):
    """The leak: verify the same trees with each row's state taken from the row before it (siblings included) instead
    of from its parent. DDTree then diverges from AR, so a regression to it fails the tests above."""
    target, prompts, refs = lossless_case
    import kernels.gated_delta

    tree_safe = kernels.gated_delta.tree_gated_delta_reference

    def leaky(q, k, v, g, beta, parents, state):
        return tree_safe(q, k, v, g, beta, None, state)  # a chain in row order
    monkeypatch.setattr(kernels.gated_delta, "tree_gated_delta_reference", leaky)
    verdicts = []
    for prompt, ref in zip(prompts, refs):
        result = engine.Decoder(target.model, oracle(target, prompt, ref, 8, miss_rate=0.4),
                                engine.DecodeSettings("ddtree", 32)).generate(prompt, NEW_TOKENS)
        verdicts.append(compare_tokens(ref.tokens, ref.margins, result.tokens, tolerance_for(torch.float32)))
    assert not all(v.ok for v in verdicts), [v.describe() for v in verdicts]


def test_hybrid_targets_refuse_what_they_cannot_run(hybrids, tmp_path):
    """Tensor-parallel widths the Gated DeltaNet key heads or the attention's KV heads cannot be split into,
    mixture-of-experts variants and unknown layer kinds: one clear error each (test_hybrid_tp.py shards the rest)."""
    import json
    import shutil

    from engine.parallel import TensorParallel, shard_target

    odd_keys = engine.load_target(str(hybrids["q35-attn-last-tied"][0]), "cpu", torch.float32)  # 3 key heads
    with pytest.raises(engine.EngineError, match="width 2 does not fit the model's Gated DeltaNet layers"):
        shard_target(odd_keys.model, TensorParallel(rank=0, world=2))
    path = hybrids["q35-attn-first"][0]
    target = engine.load_target(str(path), "cpu", torch.float32)
    with pytest.raises(engine.EngineError, match="width 2 does not fit the model: 1 KV heads with 3 query heads"):
        shard_target(target.model, TensorParallel(rank=0, world=2))
    moe = tmp_path / "moe"
    shutil.copytree(path, moe)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_moe_text", "num_experts": 4}))
    with pytest.raises(engine.EngineError, match="mixture-of-experts models"):
        engine.load_target(str(moe), "cpu", torch.float32)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    (bad / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention", "mamba"] + [
        "linear_attention"] * (config["num_hidden_layers"] - 2)}))
    with pytest.raises(engine.EngineError, match="layer_types must list"):
        engine.load_target(str(bad), "cpu", torch.float32)


def test_batched_answers_and_training_features(hybrids):
    """Draft training on a hybrid target: the batched greedy answers (continue_prompts: prompts of one length together,
    the recurrent states committed after every step) equal each prompt's own AR decode, and the context features of
    whole sequences (a fresh state per sequence) equal transformers' hidden states."""
    from engine.train_draft.data import continue_prompts
    from engine.train_draft.features import target_features

    path, hf_model = hybrids["q35-adjacent-ratio3"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, target.model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 5, 5)]
    answers = continue_prompts(target.model, prompts, 12, batch=2, desc="test")
    for prompt, answer in zip(prompts, answers):
        ref = engine.Decoder(target.model).generate(prompt, 12, record_margins=True)
        assert compare_tokens(ref.tokens, ref.margins, answer, tolerance_for(torch.float32)).ok
    tokens = torch.randint(3, target.model.cfg.vocab_size, (3, 21), generator=gen)
    layers = (0, 1, 3)
    final, feats = target_features(target.model, 21, 3, layers)(tokens)
    with torch.no_grad():
        ref = hf_model.base_model(tokens, output_hidden_states=True)
    torch.testing.assert_close(feats, torch.cat([ref.hidden_states[i + 1] for i in layers], -1), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(final, ref.last_hidden_state, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_train_a_draft_for_a_hybrid_target(hybrids, tmp_path):
    """train-draft at toy scale: a DFlash draft (dense, as the public drafts are) trained on a hybrid target's answers
    and features loads and decodes losslessly with DFlash and DDTree."""
    from engine.train_draft import TrainSettings, train

    path, _ = hybrids["q35-attn-first"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    settings = TrainSettings(out=str(tmp_path / "run"), layers=1, block_size=4, prompts=12, new_tokens=12, gen_batch=6,
                             steps=4, batch=3, anchors=3, warmup=1, save_every=4, validation=0, self_written=0.0)
    result = train(target, settings, torch.device("cpu"), log=lambda line: None)
    drafter = engine.load_drafter(str(result.draft_dir), target)
    prompt = [5, 9, 14, 3, 77, 120]
    ref = engine.Decoder(target.model).generate(prompt, 20, record_margins=True)
    for method, budget in (("dflash", 0), ("ddtree", 8)):
        out = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget)).generate(prompt, 20)
        assert compare_tokens(ref.tokens, ref.margins, out.tokens, tolerance_for(torch.float32)).ok
