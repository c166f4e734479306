"""DFlash and DDTree output equals greedy AR output, for random DFlash drafts and for the oracle drafter.

The oracle drafter proposes the AR continuation with seeded mistakes, so rounds accept several tokens and
DDTree accepts side branches (non-contiguous cache rows that compaction must move); a random draft is
almost always rejected. Both paths must reproduce AR exactly.
"""
from __future__ import annotations

import pytest
import torch

import engine
import engine.cache
from engine.workloads import PROMPTS
from engine.exactness import compare_tokens, tolerance_for

BLOCK_SIZES = (2, 4, 8, 16)
BUDGETS = (1, 2, 4, 8, 15, 16, 32, 64)
TOPK_CAPS = (1, 3, 8)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, target.model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 19)]
    refs = [engine.Decoder(target.model).generate(p, NEW_TOKENS, record_margins=True) for p in prompts]
    return target, prompts, refs


@pytest.fixture
def compactions(monkeypatch):
    """Counts cache compactions that really moved rows (accepted nodes that were not a contiguous prefix)."""
    moved = []
    compact = engine.cache.compact_kv

    def counting_compact(k, v, start, path, accepted):
        offsets = path[:int(accepted)].tolist()
        if offsets != list(range(len(offsets))):
            moved.append(offsets)
        return compact(k, v, start, path, accepted)

    monkeypatch.setattr(engine.cache, "compact_kv", counting_compact)
    return moved


def assert_lossless(ref, result, what):
    verdict = compare_tokens(ref.tokens, ref.margins, result.tokens, tolerance_for(torch.float32))
    assert verdict.ok, f"{what}: {verdict.describe()}\nAR:   {ref.tokens}\nspec: {result.tokens}"
    assert sum(result.acceptance_lengths) >= len(result.tokens) - 1


def oracle(target, prompt, ref, block_size, seed=0, miss_rate=0.25):
    return engine.OracleDrafter(prompt + ref.tokens, target.model.cfg.vocab_size, block_size, miss_rate=miss_rate,
                                seed=seed)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_dflash_equals_ar(tiny, block_size):
    target, prompts, refs = tiny
    random_draft = engine.load_drafter("random:2", target, block_size)
    taus = []
    for prompt, ref in zip(prompts, refs):
        for drafter in (random_draft, oracle(target, prompt, ref, block_size)):
            result = engine.Decoder(target.model, drafter, engine.DecodeSettings("dflash")).generate(prompt, NEW_TOKENS)
            assert_lossless(ref, result, f"dflash block {block_size} {type(drafter).__name__}")
            taus.append(result.tau)
    assert max(taus) > 1.5, "the oracle drafter should drive multi-token acceptance"


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_ddtree_equals_ar(tiny, compactions, block_size, budget):
    target, prompts, refs = tiny
    random_draft = engine.load_drafter("random:1", target, block_size, seed=budget)
    for topk_cap in TOPK_CAPS:
        settings = engine.DecodeSettings("ddtree", budget, topk_cap)
        for seed, (prompt, ref) in enumerate(zip(prompts, refs)):
            for drafter in (random_draft, oracle(target, prompt, ref, block_size, seed=seed)):
                result = engine.Decoder(target.model, drafter, settings).generate(prompt, NEW_TOKENS)
                assert_lossless(ref, result, f"ddtree B={block_size} budget={budget} cap={topk_cap} "
                                             f"{type(drafter).__name__}")
    if budget >= 32 and block_size >= 4:
        assert compactions, "the oracle should make DDTree accept side branches that compaction moves"


def test_ddtree_beats_dflash_with_side_branches(tiny):
    """With mistakes that demote the right token, DDTree's siblings recover acceptance that a chain loses."""
    target, prompts, refs = tiny
    taus = {}
    for method, budget in (("dflash", 0), ("ddtree", 32)):
        results = [engine.Decoder(target.model, oracle(target, p, r, 8, miss_rate=0.4),
                                  engine.DecodeSettings(method, budget)).generate(p, NEW_TOKENS)
                   for p, r in zip(prompts, refs)]
        taus[method] = sum(sum(r.acceptance_lengths) for r in results) / sum(r.rounds for r in results)
    assert taus["ddtree"] > taus["dflash"] + 0.3, taus


@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 15), ("ddtree", 0)])
def test_stop_tokens(tiny, method, budget):
    """A stop token inside an accepted block ends generation right after it, exactly where AR stops."""
    target, prompts, refs = tiny
    prompt, ref = prompts[0], refs[0]
    stop = ref.tokens[17]
    expected = ref.tokens[:ref.tokens.index(stop) + 1]
    ar = engine.Decoder(target.model).generate(prompt, NEW_TOKENS, (stop,))
    assert ar.tokens == expected
    for drafter in (oracle(target, prompt, ref, 8, miss_rate=0.0), engine.load_drafter("random:1", target, 8)):
        result = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget)).generate(
            prompt, NEW_TOKENS, (stop,))
        assert result.tokens == expected


@pytest.mark.parametrize("block_size", (2, 4, 16))
@pytest.mark.parametrize("method", ("dflash", "ddtree"))
def test_lengths_at_block_boundaries(tiny, method, block_size):
    """max_new_tokens of 1, and lengths ending exactly at (and one past, one before) a round boundary."""
    target, prompts, refs = tiny
    prompt, ref = prompts[1], refs[1]
    drafter = oracle(target, prompt, ref, block_size, miss_rate=0.0)  # every round commits block_size tokens
    settings = engine.DecodeSettings(method, budget=2 * block_size)
    for n in (1, 2, 1 + block_size, 1 + 2 * block_size, 2 * block_size, 2 + 2 * block_size):
        if n > NEW_TOKENS:
            continue
        result = engine.Decoder(target.model, drafter, settings).generate(prompt, n)
        assert result.tokens == ref.tokens[:n], f"max_new_tokens={n}"
        if n == 1 + 2 * block_size:
            assert result.acceptance_lengths == [block_size, block_size]


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 15), ("ddtree", 32)])
def test_default_pair_equals_ar(default_target, method, budget):
    target = default_target
    draft = engine.load_drafter("default", target)
    for text in ("Implement quicksort in Python.", "What is 17 times 23?"):
        prompt = target.encode(text)
        ref = engine.Decoder(target.model).generate(prompt, 24, target.stop_ids, record_margins=True)
        for drafter in (draft, oracle(target, prompt, ref, 16)):
            result = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget)).generate(
                prompt, 24, target.stop_ids)
            assert_lossless(ref, result, f"default pair {method} {budget} {type(drafter).__name__}")


def test_default_draft_is_the_committed_trained_draft(default_target):
    """`--draft default` for the default target loads engine/drafts/smollm2-135m-dflash, and the target accepts
    what it drafts (a random draft gives tau 1; this one 5.17 on the fib prompt on CPUs)."""
    from engine.loading import DEFAULT_DRAFT_DIR

    assert default_target.default_draft == str(DEFAULT_DRAFT_DIR)
    drafter = engine.load_drafter("default", default_target)
    prompt = default_target.encode(PROMPTS["fib"])
    result = engine.Decoder(default_target.model, drafter, engine.DecodeSettings("dflash", 0)).generate(prompt, 32)
    assert result.tau > 2.0, f"the default draft is barely accepted: tau {result.tau:.2f}"


@pytest.mark.parametrize("method,budget,miss_rate", [("ar", 0, None), ("dflash", 0, 0.3), ("ddtree", 15, 0.3),
                                                     ("dflash", 0, 0.0), ("ddtree", 15, 0.0)])
def test_run_ahead_reads_the_same_rounds(tiny, method, budget, miss_rate):
    """The GPU's run-ahead loop (one round in flight while the host reads the previous one), forced on a CPU:
    the same tokens and rounds as the synchronous loop, at the length limit, at a stop token and at max 1-3.
    A perfect oracle sized to exactly the reference (miss rate 0) makes the round run ahead at the length limit
    draft past the end of the reference."""
    target, prompts, refs = tiny
    prompt, ref = prompts[0], refs[0]
    drafter = None if method == "ar" else oracle(target, prompt, ref, 8, miss_rate=miss_rate)
    settings = engine.DecodeSettings(method, budget)
    for stop, n in (((), NEW_TOKENS), ((ref.tokens[17],), NEW_TOKENS), ((), 1), ((), 2), ((), 3), ((), 11)):
        sync_run = engine.Decoder(target.model, drafter, settings, run_ahead=False).generate(prompt, n, stop)
        ahead = engine.Decoder(target.model, drafter, settings, run_ahead=True).generate(prompt, n, stop)
        assert ahead.tokens == sync_run.tokens and ahead.acceptance_lengths == sync_run.acceptance_lengths
        assert len(ahead.tokens) == min(n, len(ref.tokens[:ref.tokens.index(stop[0]) + 1]) if stop else n)


class AddressStableReplay:
    """A CUDA graph stood in for on a CPU, with what matters here: the capture runs the stage's Python (the Round's
    fields then point at the capture's tensors) and the round that captured replays it once (here the capture did
    that round's work); a later replay reads and writes those same tensors and re-points no Python attribute."""

    def __init__(self, stage):
        self.stage, self.first = stage, True
        stage()
        self.captured = dict(vars(stage.__self__.round))

    def replay(self):
        if self.first:  # the capturing round: its work was done by the capture above
            self.first = False
            return
        decoder = self.stage.__self__
        before = dict(vars(decoder.round))
        vars(decoder.round).update(self.captured)  # a graph reads the tensors it was captured over
        self.stage()
        for name, produced in vars(decoder.round).items():
            if produced is not self.captured[name]:  # the stage assigned this field: a graph writes the captured ones
                _copy_into(self.captured[name], produced)
        vars(decoder.round).update(before)


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    else:  # a RoundTree
        for name, tensor in vars(dst).items():
            tensor.copy_(getattr(src, name))


@pytest.mark.cpu
@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 6)])
def test_graph_replays_report_what_the_graphs_wrote(tiny, monkeypatch, method, budget):
    """A decoder whose graphs were captured in an earlier call replays them from each call's first round on, whose
    draft alone runs eagerly (it reads the prompt's features; its result re-points the Round's field at a new
    tensor): the margins it records, and the stages' inputs, must come from the tensors the graphs write. Stand-in
    graphs that only write their captured tensors (as CUDA graphs do) catch a decoder that reads an eager stage's
    tensors or leaves a graph reading stale ones: tokens, margins and acceptance must equal eager decoding's."""
    import engine.decode

    monkeypatch.setattr(engine.decode, "capture_stages",
                        lambda stages: {name: AddressStableReplay(stage) for name, stage in stages.items()})
    target, prompts, refs = tiny
    drafter = engine.OracleDrafter([0], target.model.cfg.vocab_size, 4, device="cpu",
                                   cost=engine.load_drafter("random:1", target, 4), max_length=64)
    decoder = engine.Decoder(target.model, drafter if method != "ar" else None, engine.DecodeSettings(method, budget))
    decoder.cuda_graphs, decoder.run_ahead = True, False  # (no pinned buffers and events on a CPU)
    eager = engine.Decoder(target.model, decoder.drafter, engine.DecodeSettings(method, budget), cuda_graphs=False)
    for _ in range(2):  # the first call captures; the second replays graphs captured in the first
        for prompt, ref in zip(prompts, refs):
            drafter.set_reference(prompt + ref.tokens, miss_rate=0.3)
            got = decoder.generate(prompt, NEW_TOKENS, record_margins=True)
            assert got.tokens == ref.tokens
            assert got.acceptance_lengths == eager.generate(prompt, NEW_TOKENS).acceptance_lengths
            assert method == "ar" or max(got.acceptance_lengths) > 1  # the draft's proposals reach the verify
            assert got.margins == pytest.approx(ref.margins, abs=1e-4)  # float32: verify rows round otherwise
    assert decoder.graphs is not None
