"""`python -m engine train-draft` at toy scale on a CPU: data from the target's own greedy answers, a few training
steps, a checkpoint that resumes, a draft in the public DFlash format that the loader reads and that decodes
losslessly, and the held-out acceptance summary. (The committed default draft is trained on a GPU: docs/training.md.)"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
import shutil
import subprocess
import sys

import pytest
import torch

import engine
from engine.draft import DFlashDrafter, DraftInput
from engine.exactness import compare_tokens
from engine.loading import load_dflash_draft, save_dflash
from engine.measure import heldout_acceptance
from engine.model import Rotary
from engine.cli import main
from engine.train_draft import TrainSettings, draft_pass, features, loop, train
from engine.train_draft.corpus import OPENERS, training_prompts
from engine.train_draft.data import (check_positions, continue_prompts, draw_batch, pack, sample_top_p,
                                     self_written_prompts, training_prompt_ids, user_turn_prefix)
from engine.train_draft.draft_pass import draft_logits_train, new_draft
from engine.train_draft.features import Float8Rows, feature_bank, target_features
from engine.train_draft.loop import graphed_step
from engine.train_draft.loss import accepted_prefix, block_loss, target_block_logits
from engine.train_draft.schedule import steps_in_budget
from engine.workloads import heldout_prompts, prompt_ids

from .checkpoints import make_hybrid_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# a run of a few seconds on a tiny target (the toy recipe of the tests below)
TOY = dict(layers=1, block_size=4, prompts=6, new_tokens=8, gen_batch=6, steps=2, batch=2, anchors=2, warmup=1,
           save_every=2, validation=0, eval_tokens=8, compile=False)
HYBRID_NAME = "q35-attn-first"  # a hybrid target (Gated DeltaNet layers): its answers and features take other paths


@pytest.fixture(scope="module")
def targets(tiny_checkpoints, tmp_path_factory):
    """The tiny checkpoints and one hybrid, by name: path first."""
    return {**tiny_checkpoints, HYBRID_NAME: make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid"), HYBRID_NAME)}


def _hf_target(target):
    """transformers' model of the same checkpoint, float32 on the CPU: the reference for hidden states."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target.source, dtype=torch.float32).eval().requires_grad_(False)


def _features(model, tokens, layers):
    """Training's context features and final hidden states, from target_features as train() runs it."""
    final, feats = target_features(model, tokens.shape[1], tokens.shape[0], layers)(tokens)
    return feats, final


def test_training_prompts_are_distinct_and_never_held_out():
    prompts = training_prompts(3000, seed=1)
    assert len(prompts) == 3000 == len(set(prompts))
    assert not set(prompts) & set(heldout_prompts().values())
    kinds = ("Write a", "JSON", "step by step", "Explain")
    assert all(any(k in p for p in prompts) for k in kinds)
    assert training_prompts(50, seed=1) == prompts[:50]  # seeded


def _perturbed_draft(target, seed: int):
    """A 2-layer, block-5 draft moved past the init's near-zero outputs, so a wrong row or position shows."""
    draft = new_draft(target, TrainSettings(out="", layers=2, block_size=5, seed=seed), mask_token_id=7)
    for p in draft.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    return draft


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias", HYBRID_NAME])
def test_training_pass_equals_the_inference_pass(targets, name):
    """What training optimises is what decoding runs: draft_logits_train's block after an anchor p equals
    DFlashDrafter.propose given the target's features of positions < p and token p as the bonus (for a hybrid target
    too, whose partial RoPE is not its Qwen3-layer draft's)."""
    path, _ = targets[name]
    target = engine.load_target(str(path), "cpu", torch.float32)
    hf = _hf_target(target)
    draft = _perturbed_draft(target, seed=4)
    seq = torch.randint(10, target.model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = hf(seq, output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1] for i in draft.dcfg.target_layer_ids], dim=-1)
        anchors = torch.tensor([[9, 23, 34]])
        trained = draft_logits_train(draft, Rotary(draft.dcfg.layers, "cpu"),
                                     hf.get_input_embeddings().weight, hf.get_output_embeddings().weight, feats, seq,
                                     anchors)
        drafter = DFlashDrafter(draft, target.model)
        for a, p in enumerate(anchors[0].tolist()):
            drafter.start(p, 64)
            proposed = drafter.propose(DraftInput(seq.clone(), torch.tensor(p), feats[:, :p], torch.tensor(p)))
            torch.testing.assert_close(trained[0, a], proposed, rtol=1e-4, atol=1e-4)


def test_padding_to_the_packed_width_does_not_change_the_loss(tiny_checkpoints):
    """Training batches are padded to the width of the longest sequence in the data (one shape every step): the
    same sequences and anchors give the same loss whatever that width."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    draft = _perturbed_draft(target, seed=3)
    rotary = Rotary(draft.dcfg.layers, "cpu")
    rng = torch.Generator().manual_seed(5)
    vocab = target.model.cfg.vocab_size
    data = [dict(ids=torch.randint(10, vocab, (n,), generator=rng).tolist(), prompt_len=k)
            for n, k in ((30, 6), (22, 4), (41, 9))]
    longer = data + [dict(ids=[11] * 90, prompt_len=5)]  # widens the pack to 90
    losses = []
    for pool in (data, longer):
        packed = pack(pool, torch.device("cpu"))
        tokens, lengths, anchors = draw_batch(packed, torch.tensor([0, 1, 2]), 4, torch.Generator().manual_seed(9))
        with torch.no_grad():
            feats, final = _features(target.model, tokens, draft.dcfg.target_layer_ids)
            logits = draft_logits_train(draft, rotary, target.model.embed_tokens.weight, target.model.lm_head.weight,
                                        feats, tokens, anchors)
            teacher = target_block_logits(final, target.model.lm_head.weight, anchors, 5)
            losses.append(block_loss(logits, tokens, anchors, lengths, 7.0, teacher=teacher, distill=0.5)[0])
        assert tokens.shape[1] == max(len(d["ids"]) for d in pool)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias", HYBRID_NAME])
def test_training_features_are_the_targets_hidden_states(targets, name):
    """The target's forward over whole sequences (a batch of them, no node_mask: causal attention by SDPA) gives its
    hidden states after each chosen layer and its final-normed states, as transformers computes them and as the
    engine's prefill with a causal node_mask does."""
    path, _ = targets[name]
    target = engine.load_target(str(path), "cpu", torch.float32)
    hf = _hf_target(target)
    tokens = torch.randint(10, target.model.cfg.vocab_size, (3, 37), generator=torch.Generator().manual_seed(8))
    # not the last layer: transformers' last hidden state is after the final norm, the engine's (at inference too)
    # is the layer's output
    layers = tuple(range(target.model.cfg.num_layers - 1))
    feats, final = _features(target.model, tokens, layers)
    with torch.no_grad():
        ref = hf.base_model(tokens, output_hidden_states=True)
        prefill = target.model(tokens, torch.arange(37).expand(3, 37), target.model.new_cache(40, batch=3),
                               torch.ones(37, 37, dtype=torch.bool).tril(), capture=layers)
    torch.testing.assert_close(feats, torch.cat([ref.hidden_states[i + 1] for i in layers], -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, ref.last_hidden_state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((final, feats), prefill, rtol=1e-5, atol=1e-5)


def _float8_bound(want: torch.Tensor, layers: int) -> torch.Tensor:
    """How far Float8Rows may round each value: 1/16 of it (3 mantissa bits), or e4m3's subnormal step at the scale
    of its row and layer (largest magnitude / 448) for the smallest values."""
    per_layer = want.unflatten(-1, (layers, -1))
    scale = per_layer.abs().amax(-1, keepdim=True) / 448
    return (per_layer.abs() / 16 + scale * 2.0 ** -9).flatten(-2)


def test_float8_rows_round_trip_within_e4m3_rounding():
    """Rows written into Float8Rows (values of very different sizes per layer, outlier columns included) come back,
    gathered in any order, within e4m3's rounding of their scaled values; rows never written stay poison."""
    g = torch.Generator().manual_seed(1)
    layers, hidden = 3, 40
    x = torch.randn(50, layers, hidden, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    x[:, :, 7] *= 100  # one outlier column per layer, as real hidden states have
    x = x.flatten(-2)
    rows = Float8Rows(60, layers, hidden, torch.float32, torch.device("cpu"))
    rows.values.fill_(0x7F)  # poison: e4m3 NaN
    rows.scales.fill_(float("nan"))
    rows[0:30] = x[:30]
    rows[30:50] = x[30:]
    idx = torch.randperm(50, generator=g)[:24].view(4, 6)
    got = rows[idx]
    assert got.shape == (4, 6, layers * hidden) and got.dtype == torch.float32
    assert ((got - x[idx]).abs() <= _float8_bound(x[idx], layers)).all()
    assert ((got - x[idx]).abs() > 1e-3 * x[idx].abs()).any()  # it did round: not a float32 copy
    assert rows[torch.tensor([55])].isnan().all()


@pytest.mark.parametrize("storage", ["model dtype", "float8"])
def test_feature_bank_rows_are_the_targets_features_of_each_batch(tiny_checkpoints, monkeypatch, storage):
    """Features computed once for all sequences (feature_bank, in chunks, the last one padded) and gathered for a
    batch (bank_rows) equal the target's forward over that batch at every real position (within e4m3 rounding when
    only a float8 bank fits the free memory); padding repeats each sequence's last row."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    lengths = (5, 9, 7, 12, 6)
    data = [dict(ids=torch.randint(target.model.cfg.vocab_size, (n,), generator=g).tolist(), prompt_len=2)
            for n in lengths]
    packed = pack(data, torch.device("cpu"))
    layers = (0, 2)
    hidden = target.model.cfg.hidden_size
    if storage == "float8":
        monkeypatch.setattr(features, "free_memory", _room_for_a_float8_bank(lambda: sum(lengths), len(layers),
                                                                              hidden))
    bank = feature_bank(target.model, packed, layers, batch=2, log=lambda line: None)
    assert bank.rows.shape == (sum(lengths), len(layers) * hidden)
    assert bank.storage == ("float8 e4m3" if storage == "float8" else "float32")
    idx = torch.tensor([3, 0, 4, 3])
    tokens = packed[0][idx]
    want, _ = _features(target.model, tokens, layers)
    got = bank.rows[bank.row_index(packed, idx)]
    real = torch.arange(tokens.shape[1]) < packed[1][idx, None]
    if storage == "float8":
        assert ((got[real] - want[real]).abs() <= _float8_bound(want[real], len(layers))).all()
    else:
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1, 5:], got[1, 4:5].expand(7, -1))  # sequence 0: 5 positions, padded to 12


def test_feature_bank_that_fits_nowhere_leaves_the_target_to_every_step(tiny_checkpoints, monkeypatch):
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    packed = pack([dict(ids=list(range(10, 30)), prompt_len=4)], torch.device("cpu"))
    monkeypatch.setattr(features, "free_memory", lambda dev: 1000)
    assert feature_bank(target.model, packed, (0, 1), batch=1, log=lambda line: None) is None


def _room_for_a_float8_bank(positions, layers: int, hidden: int):
    """A free_memory stand-in: room (at FEATURE_BANK_SHARE) for 1.5x the float8 bank of positions() positions, not
    for one in the model's dtype (2x its bytes and more). positions() is asked when the bank is sized."""
    return lambda dev: int(1.5 * Float8Rows.nbytes(positions(), layers, hidden) / features.FEATURE_BANK_SHARE)


def _positions_in(data_path: Path):
    """positions() for _room_for_a_float8_bank: the sequence positions of a run's data, once it has written them."""
    return lambda: sum(len(d["ids"]) for d in loop.read_run_file(data_path)["data"])


def _train_on_one_dataset(target, tmp_path, device: str, variants: dict, **recipe) -> dict:
    """train() once per variant {name: (TrainSettings overrides, train() options, set-up to call first)}, each on
    the first variant's data.pt, so that all see the same data and (by the seed) the same batches. Returns {name:
    (the final checkpoint's draft weights, the TrainResult)}."""
    runs = {}
    for name, (overrides, options, setup) in variants.items():
        out = tmp_path / name
        if runs:
            out.mkdir()
            (out / "data.pt").write_bytes((tmp_path / next(iter(runs)) / "data.pt").read_bytes())
        setup()
        result = train(target, TrainSettings(out=str(out), **recipe, **overrides), torch.device(device),
                       log=lambda line: None, **options)
        runs[name] = (loop.read_run_file(out / "checkpoint.pt")["draft"], result)
    return runs


def test_training_from_the_feature_bank_follows_features_in_every_step(tiny_checkpoints, tmp_path, monkeypatch):
    """The same data and batches train to the same draft whether the features come from the bank or from the target
    in every step (the fallback when the bank does not fit), up to float32 rounding."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    share = features.FEATURE_BANK_SHARE
    recipe = dict(layers=1, block_size=4, prompts=12, new_tokens=12, gen_batch=6, steps=4, batch=3, anchors=3,
                  warmup=1, save_every=4, self_written=0.0)
    start = new_draft(target, TrainSettings(out="", **recipe), 0)  # seeded: the runs' starting weights
    init = start.state_dict()

    def float8_only():
        monkeypatch.setattr(features, "FEATURE_BANK_SHARE", share)
        monkeypatch.setattr(features, "free_memory", _room_for_a_float8_bank(
            _positions_in(tmp_path / "bank" / "data.pt"), len(start.dcfg.target_layer_ids),
            target.model.cfg.hidden_size))

    runs = _train_on_one_dataset(target, tmp_path, "cpu", {
        "bank": ({}, {}, lambda: monkeypatch.setattr(features, "FEATURE_BANK_SHARE", share)),
        "every step": ({}, {}, lambda: monkeypatch.setattr(features, "FEATURE_BANK_SHARE", 0.0)),
        "float8 bank": ({}, {}, float8_only)}, **recipe)
    (bank, bank_run), (every_step, every_step_run) = runs["bank"], runs["every step"]
    assert bank_run.features == "float32" and every_step_run.features == "target in every step"
    assert runs["float8 bank"][1].features == "float8 e4m3"
    moved = sum((w - init[name]).abs().sum() for name, w in bank.items())
    assert moved > 0
    for name, w in bank.items():
        torch.testing.assert_close(w, every_step[name], rtol=1e-4, atol=1e-5)
    # the float8 bank's rounding moves the training a little (1.2% of the distance moved, here), while features
    # shifted by one position moved it 17%
    apart = sum((w - every_step[name]).abs().sum() for name, w in runs["float8 bank"][0].items())
    assert apart < 0.05 * moved, (apart, moved)


def test_distillation_teacher_is_the_targets_next_token_distribution(tiny_checkpoints):
    """target_block_logits gives, for block position j after anchor p, the target's own logits for token p+j; the
    distilled loss is (1 - w) CE + w KL, so it equals the CE share alone when the draft's logits are the teacher's."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    hf = _hf_target(target)
    seq = torch.randint(10, target.model.cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(5))
    anchors = torch.tensor([[3, 17, 25], [0, 8, 26]])
    with torch.no_grad():
        out = hf(seq, output_hidden_states=True)
        final = hf.base_model(seq).last_hidden_state
    teacher = target_block_logits(final, hf.get_output_embeddings().weight, anchors, block_size=5)
    assert teacher.shape == (2, 3, 4, target.model.cfg.vocab_size)
    for n in range(2):
        for a, p in enumerate(anchors[n].tolist()):
            for j in range(1, 5):
                if p + j < 30:
                    torch.testing.assert_close(teacher[n, a, j - 1], out.logits[n, p + j - 1], rtol=1e-4, atol=1e-4)
    lengths = torch.tensor([30, 29])
    ce, _ = block_loss(teacher, seq, anchors, lengths, gamma=7.0)
    mixed, _ = block_loss(teacher, seq, anchors, lengths, gamma=7.0, teacher=teacher, distill=0.3)
    torch.testing.assert_close(mixed, 0.7 * ce)
    other = teacher + torch.randn_like(teacher)
    worse, _ = block_loss(other, seq, anchors, lengths, gamma=7.0, teacher=teacher, distill=1.0)
    assert worse > 0.01


def _answers_equal_ar(target, prompts, answers, new_tokens, tolerance):
    decoder = engine.Decoder(target.model)
    for prompt, answer in zip(prompts, answers):
        ref = decoder.generate(prompt, new_tokens, record_margins=True)
        verdict = compare_tokens(ref.tokens, ref.margins, answer, tolerance)
        assert verdict.ok, verdict.describe()


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias", HYBRID_NAME])
def test_batched_answers_are_what_decoding_each_prompt_alone_gives(targets, name):
    """The training data's answers: prompts of several lengths (several batches, one split by the batch limit, rows
    of a batch in another order than the prompts) continue as the engine's own AR decode of each prompt alone, past
    end-of-sequence (exactness rule: only near-ties may differ)."""
    path, _ = targets[name]
    target = engine.load_target(str(path), "cpu", torch.float32)
    rng = torch.Generator().manual_seed(5)
    lengths = [7, 3, 7, 12, 7, 3, 7, 1]
    prompts = [torch.randint(1, target.model.cfg.vocab_size, (n,), generator=rng).tolist() for n in lengths]
    answers = continue_prompts(target.model, prompts, 14, batch=3, desc="test")
    assert [len(a) for a in answers] == [14] * len(prompts)
    assert len({tuple(a) for a in answers}) > 1  # the rows are not all one row
    _answers_equal_ar(target, prompts, answers, 14, 1e-4)


def test_top_p_sampling_draws_from_the_nucleus_in_proportion():
    """sample_top_p keeps the fewest most likely tokens whose mass reaches top_p (the first always) and draws among
    them in proportion to their probabilities."""
    probs = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    logits = probs.log().expand(200_000, -1)
    torch.manual_seed(0)
    drawn = sample_top_p(logits, 0.8)  # 0.4 + 0.25 + 0.2 = 0.85 reaches 0.8: tokens 1, 2, 3
    assert drawn.shape == (200_000, 1)
    share = torch.bincount(drawn[:, 0], minlength=5).float() / len(drawn)
    torch.testing.assert_close(share, torch.tensor([0, 0.4, 0.25, 0.2, 0]) / 0.85, rtol=0, atol=0.005)
    assert (sample_top_p(logits[:10], 0.3) == 1).all()  # the most likely token alone
    torch.manual_seed(0)
    assert torch.equal(sample_top_p(logits, 0.8), drawn)  # seeded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_answers_from_cuda_graphs_equal_ar_on_the_gpu():
    """The GPU path replays the one-token step as a CUDA graph per batch: the default model's answers to template
    prompts of mixed lengths still equal each prompt's own AR decode under the bf16 rule."""
    from engine.exactness import tolerance_for

    target = engine.load_target("smollm2-135m", "cuda", torch.bfloat16)
    prompts = [target.encode(p) for p in training_prompts(24, seed=2)]
    answers = continue_prompts(target.model, prompts, 48, batch=4, desc="test")
    _answers_equal_ar(target, prompts, answers, 48, tolerance_for(torch.bfloat16))
    # sampled in the graph: a nucleus of one token is greedy; the global seed repeats a run, another seed differs
    assert continue_prompts(target.model, prompts, 48, batch=4, desc="test", top_p=1e-6) == answers
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(continue_prompts(target.model, prompts, 48, batch=4, desc="test", top_p=0.95))
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_answers_from_a_hybrid_on_the_gpu_equal_ar(targets):
    """A hybrid target answers eagerly on the GPU (its recurrent states' keep_prefix is not capturable), through the
    Triton kernels of its Gated DeltaNet layers: the answers still equal each prompt's own AR decode (bf16 rule)."""
    from engine.exactness import tolerance_for

    target = engine.load_target(str(targets[HYBRID_NAME][0]), "cuda", torch.bfloat16)
    rng = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, target.model.cfg.vocab_size, (n,), generator=rng).tolist() for n in (5, 9, 5, 2, 9)]
    answers = continue_prompts(target.model, prompts, 24, batch=2, desc="test")
    assert len({tuple(a) for a in answers}) > 1
    _answers_equal_ar(target, prompts, answers, 24, tolerance_for(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_step_replays_each_new_batch_on_the_current_weights():
    """graphed_step's replay computes what an eager step computes on the batch given and the weights as they are
    now (the optimizer updates them in place between replays), and leaves that step's gradients, not a sum with the
    warm-up's or the last step's. float32 and a plain MLP, so both agree to rounding: stale inputs, stale weights
    or accumulated gradients show."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
    params = list(model.parameters())

    def fn(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss.detach()

    batches = [(torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")) for _ in range(4)]
    step = graphed_step(fn, params, batches[0])
    for x, y in batches[1:]:
        loss = step(x, y).clone()
        graphed = [p.grad for p in params]  # the graph's own gradient tensors, which each replay overwrites
        for p in params:
            p.grad = None
        torch.testing.assert_close(loss, fn(x, y), rtol=1e-5, atol=1e-6)
        for mine, p in zip(graphed, params):
            torch.testing.assert_close(mine, p.grad, rtol=1e-4, atol=1e-6)
            p.grad = mine
        with torch.no_grad():  # an optimizer step, in place
            for p in params:
                p.add_(torch.randn_like(p) * 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled, bank", [(False, "bfloat16"), (True, "bfloat16"), (True, None), (True, "float8")],
                         ids=["eager-pass", "compiled-pass", "compiled-pass-target-every-step",
                              "compiled-pass-float8-bank"])
def test_training_with_the_cuda_graph_step_follows_eager_training(tiny_checkpoints, tmp_path, monkeypatch, compiled,
                                                                  bank):
    """train() captures its step without falling back to eager (with --compile too: torch.compile's code inside the
    graph; with the feature bank, a float8 one, or the target in every step; the validation checks run between
    replays), and on the same data and batches ends near the eager run's draft. Only near: in bfloat16 autocast, Adam
    turns rounding differences in small gradients into whole steps (on the H200, 6 steps at lr 1e-2 left the first
    norm weight 0.0013 apart for 0.0234 moved). graphed_step's own test checks the replay exactly."""
    if bank is None:
        monkeypatch.setattr(features, "FEATURE_BANK_SHARE", 0.0)
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cuda", torch.bfloat16)
    start = new_draft(target, TrainSettings(out="", layers=1, block_size=4), 0)
    init = start.state_dict()
    if bank == "float8":
        monkeypatch.setattr(features, "free_memory", _room_for_a_float8_bank(
            _positions_in(tmp_path / "graphed" / "data.pt"), len(start.dcfg.target_layer_ids),
            target.model.cfg.hidden_size))
    runs = _train_on_one_dataset(target, tmp_path, "cuda", {
        "graphed": (dict(compile=compiled), dict(cuda_graph=True), lambda: None),
        "eager": (dict(compile=False), dict(cuda_graph=False), lambda: None)},
        layers=1, block_size=4, prompts=30, new_tokens=12, gen_batch=6, steps=6, batch=3, anchors=3, warmup=1,
        lr=1e-2, save_every=3, validation=3)
    result = runs["graphed"][1]
    assert result.features == ({"bfloat16": "bfloat16", "float8": "float8 e4m3"}[bank] if bank
                               else "target in every step")
    assert result.graphed and not runs["eager"][1].graphed
    # checked between graph replays: one check per checkpoint, the draft written is the best one's
    assert result.validation["sequences"] == 3 and [c["step"] for c in result.validation["checks"]] == [3, 6]
    assert result.steps == 6 and result.best_step in (3, 6)
    graphed, eager = runs["graphed"][0], runs["eager"][0]
    moved = sum((eager[n].cpu() - start).abs().sum() for n, start in init.items())
    apart = sum((graphed[n] - eager[n]).abs().sum().cpu() for n in init)
    assert moved > 0 and apart < 0.25 * moved


@pytest.mark.slow
def test_self_written_prompts_are_requests_from_the_target(default_target):
    """The target writes user requests after its user-turn header: seeded, distinct, each beginning with an opener,
    never a held-out prompt."""
    prefix = user_turn_prefix(default_target)
    assert prefix and prefix.rstrip().endswith("user")  # SmolLM2's ChatML header
    settings = TrainSettings(out="", gen_batch=8, seed=3)
    prompts = self_written_prompts(default_target, 8, settings)
    assert 4 <= len(prompts) <= 8 and len(set(prompts)) == len(prompts)
    assert all(any(p.startswith(o) for o in OPENERS[:10]) for p in prompts)  # 10 requests drawn for 8
    assert all(len(p.split()) >= 3 and "<|im_start|>" not in p for p in prompts)
    assert not set(prompts) & set(heldout_prompts().values())
    assert self_written_prompts(default_target, 8, settings) == prompts  # seeded


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [{}, dict(distill=0.5, self_written=0.0)], ids=["default", "distill-templates"])
def test_train_resume_load_and_decode(tiny_checkpoints, tmp_path, recipe):
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    settings = TrainSettings(out=str(tmp_path / "run"), layers=1, block_size=4, prompts=12, new_tokens=12,
                             gen_batch=6, steps=4, batch=3, anchors=3, warmup=1, save_every=2, eval_tokens=12,
                             **recipe)
    first_run = train(target, settings, torch.device("cpu"), log=lambda line: None)
    assert first_run.first_step == 0 and not first_run.data_reused and first_run.steps == 4
    draft_dir = first_run.draft_dir
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] and config["num_target_layers"] == 3
    first = (draft_dir / "model.safetensors").read_bytes()

    with pytest.raises(engine.EngineError, match="pass --resume"):
        train(target, settings, torch.device("cpu"), log=lambda line: None)
    settings.steps = 6
    resumed = train(target, settings, torch.device("cpu"), resume=True, log=lambda line: None)
    assert resumed.first_step == 4 and resumed.data_reused and resumed.steps == 6
    assert (draft_dir / "model.safetensors").read_bytes() != first  # two more steps changed the weights

    drafter = engine.load_drafter(str(draft_dir), target)
    ids = [5, 9, 14, 3, 77, 120]
    ref = engine.Decoder(target.model).generate(ids, 20, record_margins=True)
    for method in ("dflash", "ddtree"):
        out = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, 6)).generate(ids, 20)
        assert compare_tokens(ref.tokens, ref.margins, out.tokens, 1e-4).ok
    # the same draft in shards (HF-style index) loads to the same proposals
    sharded = tmp_path / "sharded"
    save_dflash(load_dflash_draft(draft_dir, target), target, sharded, dtype=torch.float32, max_shard_bytes=20_000)
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    again = engine.load_drafter(str(sharded), target)
    out = engine.Decoder(target.model, again, engine.DecodeSettings("ddtree", 6)).generate(ids, 20)
    assert compare_tokens(ref.tokens, ref.margins, out.tokens, 1e-4).ok
    # the summary's held-out tau: committed tokens over rounds of every held-out prompt, as decoding them gives
    taus = heldout_acceptance(target, drafter, 12)
    assert set(taus) == {"dflash", "ddtree-15", "ddtree-32"}
    for method, budget in (("dflash", 0), ("ddtree", 15), ("ddtree", 32)):
        runs = [engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget)).generate(
            prompt_ids(target, w), 12) for w in heldout_prompts()]
        want = sum(sum(r.acceptance_lengths) for r in runs) / sum(r.rounds for r in runs)
        assert taus["dflash" if method == "dflash" else f"ddtree-{budget}"] == pytest.approx(want, rel=1e-12)


def test_init_starts_training_from_a_drafts_weights_and_shape(tiny_checkpoints, tmp_path):
    """--init: the run starts from the given draft (its weights, layers, block size, mask token and target layers,
    which replace --layers and --block-size), not from random weights; a draft whose layers the training pass does
    not model is refused."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    given = new_draft(target, TrainSettings(out="", layers=2, block_size=5, seed=3), mask_token_id=7)
    save_dflash(given, target, tmp_path / "given", dtype=torch.float32)
    settings = TrainSettings(out=str(tmp_path / "run"), init=str(tmp_path / "given"), prompts=12, new_tokens=12,
                             gen_batch=6, steps=1, batch=3, anchors=3, warmup=1, lr=1e-9, eval_tokens=12)
    result = train(target, settings, torch.device("cpu"), log=lambda line: None)
    assert (settings.layers, settings.block_size) == (2, 5)
    tuned = load_dflash_draft(result.draft_dir, target)
    assert (tuned.dcfg.block_size, tuned.dcfg.mask_token_id) == (5, 7)
    assert tuned.dcfg.target_layer_ids == given.dcfg.target_layer_ids
    start = given.state_dict()
    for name, w in tuned.state_dict().items():  # one step at lr 1e-9: the given weights, written in bfloat16
        torch.testing.assert_close(w, start[name], rtol=2 ** -8, atol=1e-6)
    fresh = new_draft(target, TrainSettings(out="", layers=2, block_size=5), mask_token_id=7).state_dict()
    assert any(not torch.allclose(fresh[n], w) for n, w in start.items())  # so the check above can fail

    config = json.loads((tmp_path / "given" / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    (tmp_path / "given" / "config.json").write_text(json.dumps(config))
    with pytest.raises(engine.EngineError, match="full-attention layers"):
        train(target, dataclasses.replace(settings, out=str(tmp_path / "run2")), torch.device("cpu"),
              log=lambda line: None)
    with pytest.raises(engine.EngineError, match="no trained default draft"):
        train(target, dataclasses.replace(settings, out=str(tmp_path / "run3"), init="default"),
              torch.device("cpu"), log=lambda line: None)


def test_train_draft_rejects_bad_settings(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engine", "train-draft", "--out", str(tmp_path / "x"), "--steps",
                           "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--steps must be >= 1" in proc.stderr
    assert not (tmp_path / "x").exists()
    proc = subprocess.run([sys.executable, "-m", "engine", "train-draft", "--out", str(tmp_path / "x"),
                           "--self-written", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--self-written is a share of the prompts" in proc.stderr
    assert not (tmp_path / "x").exists()
    proc = subprocess.run([sys.executable, "-m", "engine", "train-draft", "--out", str(tmp_path / "x"),
                           "--distill", "-0.5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--distill is the KL's share" in proc.stderr
    assert not (tmp_path / "x").exists()
    for bad, message in ((["--minutes", "-1"], "--minutes is a time budget"),
                         (["--minutes", "5", "--resume"], "--minutes sets the step count"),
                         (["--warmup", "-1"], "--warmup must be >= 0"),
                         (["--validation", "-1"], "--validation must be >= 0"),
                         (["--init", str(tmp_path / "no-draft")], "--init: draft path")):
        proc = subprocess.run([sys.executable, "-m", "engine", "train-draft", "--out", str(tmp_path / "x"), *bad],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "x").exists()


def test_steps_in_budget_fit_the_time_left():
    settings = TrainSettings(out="", steps=10_000, minutes=10)
    assert steps_in_budget(settings, 220, rate=20.0, elapsed_s=100.0) == 220 + int(0.95 * 20.0 * 500)
    assert steps_in_budget(settings, 220, rate=100.0, elapsed_s=100.0) == 10_000  # --steps caps it
    assert steps_in_budget(settings, 220, rate=20.0, elapsed_s=700.0) == 220  # over the budget: stop now


@pytest.mark.slow
def test_train_with_a_spent_time_budget_stops_after_measuring_its_rate(tiny_checkpoints, tmp_path, monkeypatch):
    """--minutes: the run measures its rate over RATE_WINDOW, logs the step count, and trains no further when the
    budget is spent (here by the data alone); the checkpoint and the draft are those of the last step."""
    monkeypatch.setattr(loop, "RATE_WINDOW", (2, 4))
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    settings = TrainSettings(out=str(tmp_path / "run"), layers=1, block_size=4, prompts=6, new_tokens=8,
                             gen_batch=6, steps=1000, minutes=0.0001, batch=2, anchors=2, warmup=1, save_every=500)
    result = train(target, settings, torch.device("cpu"), log=lambda line: None)
    assert result.steps == settings.steps == 4
    assert loop.read_run_file(tmp_path / "run" / "checkpoint.pt")["step"] == 4
    assert (tmp_path / "run" / "draft" / "config.json").exists()


def test_accepted_prefix_counts_drafted_tokens_up_to_the_first_miss():
    """Block after anchor p: its drafted tokens p+1.. count until the first that differs from the sequence's token,
    and a position past the sequence's end is a miss."""
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 0, 0]])
    lengths = torch.tensor([6])
    anchors = torch.tensor([[0, 1, 3]])
    drafted = torch.tensor([[[6, 7, 8], [0, 8, 9], [9, 10, 11]]])  # right x3; a miss first; right x2, then the end
    logits = torch.nn.functional.one_hot(drafted, 12).float()
    assert accepted_prefix(logits, tokens, anchors, lengths).tolist() == [[3, 0, 2]]


@pytest.mark.slow
def test_validation_keeps_its_sequences_out_and_writes_the_best_draft(tiny_checkpoints, tmp_path, monkeypatch):
    """--validation: a seeded set of whole batches is never drawn for a step; every checkpoint records the validation
    tau (validation.json, the checkpoint), and the draft written is the one of the best check, not the last."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    drawn, states = [], {}
    real_batch, real_save = loop.draw_batch, loop.atomic_torch_save
    monkeypatch.setattr(loop, "draw_batch", lambda packed, idx, *a: drawn.append(idx.tolist()) or real_batch(
        packed, idx, *a))

    def save(obj, where):
        states[obj["step"]] = {k: v.clone() for k, v in obj["draft"].items()}
        real_save(obj, where)
    monkeypatch.setattr(loop, "atomic_torch_save", lambda obj, where: save(obj, where) if "step" in obj
                        else real_save(obj, where))
    scripted = iter([0.5, 2.0, 1.0, 0.0])  # mean accepted prefix per check: the best is the second, step 4
    monkeypatch.setattr(loop, "accepted_prefix", lambda logits, tokens, anchors, lengths: torch.full(
        anchors.shape, next(scripted)))
    settings = TrainSettings(out=str(tmp_path / "run"), layers=1, block_size=4, prompts=20, new_tokens=8,
                             gen_batch=10, steps=8, batch=2, anchors=2, warmup=1, save_every=2, validation=5,
                             self_written=0.0, lr=1e-2)
    result = train(target, settings, torch.device("cpu"), log=lambda line: None)
    draft_dir = result.draft_dir
    held = torch.randperm(20, generator=torch.Generator().manual_seed(settings.seed))[:2].tolist()  # 5 -> 1 batch
    assert sorted(drawn[0]) == sorted(held) and not set(held) & {i for idx in drawn[1:] for i in idx}
    checks = json.loads((tmp_path / "run" / "validation.json").read_text())
    assert checks["sequences"] == 2 and [c["step"] for c in checks["checks"]] == [2, 4, 6, 8]
    assert [c["tau"] for c in checks["checks"]] == [1.5, 3.0, 2.0, 1.0]
    assert loop.read_run_file(tmp_path / "run" / "checkpoint.pt")["validation"] == checks["checks"]
    assert result.validation == checks and result.best_step == 4
    from safetensors.torch import load_file

    written = load_file(draft_dir / "model.safetensors")
    assert any(not torch.equal(states[4][k], states[8][k]) for k in written)
    for name, w in written.items():
        torch.testing.assert_close(w, states[4][name].to(w.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("option, value", [("--lr", "nan"), ("--lr", "inf"), ("--gamma", "nan"), ("--distill", "nan"),
                                           ("--self-written", "nan"), ("--minutes", "inf"), ("--minutes", "nan")])
def test_non_finite_settings_are_refused_before_any_work(tiny_checkpoints, tmp_path, capsys, option, value):
    """NaN fails every comparison, so range checks alone let `--lr nan` through (a traceback after the data; with
    inf, or --gamma nan, a draft of NaNs and exit code 0; --minutes inf overflowed mid-run, nan meant no budget):
    every float setting must be finite, one error line before the target loads. train() checks its settings too."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    out = tmp_path / "run"
    toy = [a for k, v in TOY.items() if k != "compile" for a in (f"--{k.replace('_', '-')}", str(v))]
    rc = main(["train-draft", "--target", str(path), "--out", str(out), "--device", "cpu", "--no-compile", *toy,
               option, value])
    assert rc == 2 and capsys.readouterr().err.splitlines() == [f"error: {option} must be a finite number, got {value}"]
    assert not out.exists()
    target = engine.load_target(str(path), "cpu", torch.float32)
    settings = TrainSettings(out=str(out), **{**TOY, option[2:].replace("-", "_"): float(value)})
    with pytest.raises(engine.EngineError, match=f"{option} must be a finite number"):
        train(target, settings, torch.device("cpu"), log=lambda line: None)
    assert not out.exists()


def test_a_bad_init_draft_is_refused_before_the_data(tiny_checkpoints, tmp_path, monkeypatch):
    """--init is loaded right after the target, before it answers any prompt (minutes to hours): a folder that is
    not a DFlash draft (a target's), one without config.json, or another target's draft stops the run with no
    data.pt; a good one is loaded once and trained from."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    other = engine.load_target(str(tiny_checkpoints["qwen2-bias"][0]), "cpu", torch.float32)
    save_dflash(new_draft(other, TrainSettings(out="", **TOY), 7), other, tmp_path / "foreign")
    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    for init, message in ((path, "not a DFlash draft"), (tmp_path / "empty", "no config.json"),
                          (tmp_path / "foreign", "does not fit target")):
        with pytest.raises(engine.EngineError, match=message):
            train(target, TrainSettings(out=str(run), init=str(init), **TOY), torch.device("cpu"),
                  log=lambda line: None)
        assert not run.exists()
    save_dflash(new_draft(target, TrainSettings(out="", **TOY), 7), target, tmp_path / "mine")
    loads, real = [], draft_pass.load_dflash_draft
    monkeypatch.setattr(draft_pass, "load_dflash_draft", lambda *a: loads.append(a) or real(*a))
    train(target, TrainSettings(out=str(run), init=str(tmp_path / "mine"), **TOY), torch.device("cpu"),
          log=lambda line: None)
    assert len(loads) == 1 and (run / "draft" / "config.json").exists()


def test_lengths_past_the_targets_position_limit_are_refused_before_the_data(tiny_checkpoints, tmp_path):
    """Every training sequence (its prompt plus --new-tokens) and every held-out check (its prompt plus
    --eval-tokens, after training) must fit the target's position limit (256 here): refused before the target
    answers anything, with the numbers, not after the whole run (or trained past the limit with exit code 0)."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    assert target.model.cfg.max_position == 256
    settings = TrainSettings(out=str(tmp_path / "run"), **TOY)
    longest = max(map(len, training_prompt_ids(target, settings, log=lambda line: None)))
    held_out = max(len(prompt_ids(target, w)) for w in heldout_prompts())
    for change, message in ((dict(new_tokens=300), "--new-tokens 300 plus the shortest possible prompt"),
                            (dict(new_tokens=257 - longest),
                             f"--new-tokens {257 - longest} plus the longest training prompt \\({longest} tokens\\) "
                             "is 257 positions, past the target's position limit of 256"),
                            (dict(eval_tokens=257 - held_out),
                             f"--eval-tokens {257 - held_out} plus the longest held-out prompt \\({held_out} tokens")):
        with pytest.raises(engine.EngineError, match=message):
            train(target, dataclasses.replace(settings, **change), torch.device("cpu"), log=lambda line: None)
        assert not (tmp_path / "run").exists()
    # the limit itself fits
    check_positions(target, dataclasses.replace(settings, new_tokens=256 - longest),
                    training_prompt_ids(target, settings, log=lambda line: None))
    check_positions(target, dataclasses.replace(settings, eval_tokens=256 - held_out))


def test_resume_writes_a_missing_draft_from_the_checkpoint(tiny_checkpoints, tmp_path):
    """A run killed between its last checkpoint and its draft (or inside save_dflash) has no draft/: resumed, with
    no step left to train, it writes the checkpoint's draft (it logged the draft's path and left none before)."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    from safetensors.torch import load_file

    settings = TrainSettings(out=str(tmp_path / "run"), **TOY)
    first = train(target, settings, torch.device("cpu"), log=lambda line: None)
    written = load_file(first.draft_dir / "model.safetensors")
    shutil.rmtree(first.draft_dir)
    again = train(target, settings, torch.device("cpu"), resume=True, log=lambda line: None)
    assert again.first_step == again.steps == 2 and again.draft_dir == first.draft_dir
    rewritten = load_file(again.draft_dir / "model.safetensors")
    assert rewritten.keys() == written.keys()
    assert all(torch.equal(rewritten[k], w) for k, w in written.items())


def test_data_of_another_target_or_other_data_settings_is_refused(tiny_checkpoints, tmp_path):
    """data.pt records the target (a fingerprint of its weights and tokenizer, not its path) and the data settings
    it was made for. A run reuses it, with or without --resume, only when both match: another target crashed in the
    embedding, other --prompts or --new-tokens trained silently on the old data. A data.pt that records neither
    (an older train-draft's) is refused too."""
    path, _ = tiny_checkpoints["llama-gqa-untied"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    run = tmp_path / "run"
    settings = TrainSettings(out=str(run), **TOY)
    train(target, settings, torch.device("cpu"), log=lambda line: None)
    for f in ("checkpoint.pt", "draft"):  # a run killed after its data, before its first checkpoint
        shutil.rmtree(run / f) if f == "draft" else (run / f).unlink()
    data = (run / "data.pt").read_bytes()
    other = engine.load_target(str(tiny_checkpoints["qwen2-bias"][0]), "cpu", torch.float32)
    with pytest.raises(engine.EngineError, match="data.pt was made for another target .*qwen2-bias.*remove"):
        train(other, settings, torch.device("cpu"), log=lambda line: None)
    for name, value in (("prompts", 7), ("new_tokens", 9), ("self_written", 0.5), ("gen_batch", 3), ("seed", 1)):
        for resume in (False, True):
            with pytest.raises(engine.EngineError, match=f"made for --{name.replace('_', '-')} "
                               f"{getattr(settings, name)} \\(this run's: {value}\\): pass another --out"):
                train(target, dataclasses.replace(settings, **{name: value}), torch.device("cpu"), resume=resume,
                      log=lambda line: None)
    assert (run / "data.pt").read_bytes() == data and sorted(p.name for p in run.iterdir()) == ["data.pt"]
    # the same target under another path is the same target; the same settings reuse the data
    shutil.copytree(path, tmp_path / "copy")
    copy = engine.load_target(str(tmp_path / "copy"), "cpu", torch.float32)
    assert loop.target_fingerprint(copy) == loop.target_fingerprint(target) != loop.target_fingerprint(other)
    assert train(copy, settings, torch.device("cpu"), log=lambda line: None).data_reused
    stored = loop.read_run_file(run / "data.pt")
    del stored["made_for"]
    torch.save(stored, run / "data.pt")
    with pytest.raises(engine.EngineError, match="does not record the target and the data settings"):
        train(target, settings, torch.device("cpu"), resume=True, log=lambda line: None)
