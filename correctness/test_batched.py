"""Batched decoding's foundation (issue 31): one target forward over sequences that each have their own committed
length and their own draft tree equals, sequence by sequence, the same work run alone; the cache keeps each
sequence's own accepted path. CPU, float32 (the kernels' batched forms are checked against their references in
test_kernel_*.py, under the Triton interpreter)."""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch

import engine


def random_tree_mask(T: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """A random tree over T rows (row 0 the root): its ancestor-or-self mask and its parents."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        mask[i] |= mask[parents[i]]
    return mask, parents


def depths(mask: torch.Tensor) -> torch.Tensor:
    return mask.long().sum(-1) - 1


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.cpu
def test_sequences_with_their_own_lengths_and_trees_equal_each_run_alone(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    model = engine.load_target(str(path), "cpu", torch.float32).model
    gen = torch.Generator().manual_seed(31)
    lengths, T, cap = [5, 11, 8], 6, 64
    B, L = len(lengths), max(lengths)
    prompts = torch.randint(3, model.cfg.vocab_size, (B, L), generator=gen)
    trees = [random_tree_mask(T, gen) for _ in range(B)]
    tree_ids = torch.randint(3, model.cfg.vocab_size, (B, T), generator=gen)
    # each sequence's accepted path, root first: to node 1, to its deepest node, the root alone
    kept = [path_to(trees[0][1], 1), path_to(trees[1][1], int(depths(trees[1][0]).argmax())), [0]]
    nxt = torch.randint(3, model.cfg.vocab_size, (B, 1), generator=gen)
    causal = torch.ones(L, L, dtype=torch.bool).tril()

    def run(cache, tokens, positions, mask):
        hidden, _ = model(tokens, positions, cache, mask)
        return model.logits(hidden)

    # alone: each sequence in its own batch-1 cache
    alone = []
    for b, n in enumerate(lengths):
        cache = model.new_cache(cap)
        pre = run(cache, prompts[b:b + 1, :n], torch.arange(n)[None], causal[:n, :n])
        cache.start.fill_(n)
        mask = trees[b][0]
        tree = run(cache, tree_ids[b:b + 1], (n + depths(mask))[None], mask)
        p = torch.tensor(kept[b] + [0] * (T - len(kept[b])))
        cache.keep(p, torch.tensor(len(kept[b])))
        cache.start.add_(len(kept[b]))
        step = run(cache, nxt[b:b + 1], cache.start.view(1, 1), torch.ones(1, 1, dtype=torch.bool))
        alone.append((pre[0], tree[0], step[0]))

    # batched: one cache, each row its own committed length; prompts padded to the longest (padding rows sit past a
    # sequence's length and are never committed)
    cache = model.new_cache(cap, batch=B, own_lengths=True)
    assert tuple(cache.start.shape) == (B,)
    pre = run(cache, prompts, torch.arange(L).expand(B, L), causal)
    cache.start.copy_(torch.tensor(lengths))
    masks = torch.stack([t[0] for t in trees])
    tree = run(cache, tree_ids, cache.start[:, None] + depths(masks), masks)
    paths = torch.tensor([k + [0] * (T - len(k)) for k in kept])
    accepted = torch.tensor([len(k) for k in kept])
    cache.keep(paths, accepted)
    cache.start.add_(accepted)
    step = run(cache, nxt, cache.start[:, None], torch.ones(1, 1, dtype=torch.bool))

    for b, n in enumerate(lengths):
        want_pre, want_tree, want_step = alone[b]
        torch.testing.assert_close(pre[b, :n], want_pre, rtol=1e-5, atol=1e-5, msg=f"sequence {b}: prompt")
        torch.testing.assert_close(tree[b], want_tree, rtol=1e-5, atol=1e-5, msg=f"sequence {b}: tree")
        torch.testing.assert_close(step[b], want_step, rtol=1e-5, atol=1e-5, msg=f"sequence {b}: after its path")


@pytest.mark.cpu
def test_hybrid_sequences_with_their_own_lengths_and_trees_equal_each_run_alone():
    """A hybrid target (Gated DeltaNet and gated attention layers) over sequences with their own lengths: each
    prompt prefilled into its own row (a row view of the cache), then one pass over a different tree per sequence
    (its own Gated DeltaNet schedule), each sequence's own accepted path kept (its own replay), and one more step:
    every row equals that sequence run alone."""
    from kernels.gated_delta import tree_schedule

    model = engine.load_target("synthetic:hybrid-tiny", "cpu", torch.float32).model
    kernel = model.cfg.linear_conv_kernel
    gen = torch.Generator().manual_seed(32)
    lengths, T, cap = [5, 11, 8], 6, 64
    B = len(lengths)
    prompts = [torch.randint(3, model.cfg.vocab_size, (n,), generator=gen) for n in lengths]
    trees = [random_tree_mask(T, gen) for _ in range(B)]
    tree_ids = torch.randint(3, model.cfg.vocab_size, (B, T), generator=gen)
    kept = [path_to(trees[0][1], int(depths(trees[0][0]).argmax())), path_to(trees[1][1], T - 1), [0]]
    nxt = torch.randint(3, model.cfg.vocab_size, (B, 1), generator=gen)

    def schedule(b):
        mask, parents = trees[b]
        return tree_schedule(torch.tensor(parents), mask, T, kernel, "cpu", max_depth=T)

    def run(cache, tokens, positions, mask, sched=None):
        hidden, _ = model(tokens, positions, cache, mask, (), sched)
        return model.logits(hidden)

    def prefill(cache, b):
        n = lengths[b]
        out = run(cache, prompts[b][None], torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril())
        cache.keep_prefix(n)
        cache.start.fill_(n)
        return out[0]

    alone = []
    for b in range(B):
        cache = model.new_cache(cap)
        pre = prefill(cache, b)
        mask = trees[b][0]
        tree = run(cache, tree_ids[b:b + 1], (lengths[b] + depths(mask))[None], mask, schedule(b))
        cache.keep(torch.tensor(kept[b] + [0] * (T - len(kept[b]))), torch.tensor(len(kept[b])))
        cache.start.add_(len(kept[b]))
        step = run(cache, nxt[b:b + 1], cache.start.view(1, 1), torch.ones(1, 1, dtype=torch.bool))
        alone.append((pre, tree[0], step[0]))

    cache = model.new_cache(cap, batch=B, own_lengths=True)
    pre = [prefill(cache.rows(b, 1), b) for b in range(B)]
    masks = torch.stack([t[0] for t in trees])
    tree = run(cache, tree_ids, cache.start[:, None] + depths(masks), masks, [schedule(b) for b in range(B)])
    accepted = torch.tensor([len(k) for k in kept])
    cache.keep(torch.tensor([k + [0] * (T - len(k)) for k in kept]), accepted)
    cache.start.add_(accepted)
    step = run(cache, nxt, cache.start[:, None], torch.ones(1, 1, dtype=torch.bool))
    for b in range(B):  # batched float32 GEMMs round differently on a CPU (1e-5 here; a wrong state: 1e-1)
        want_pre, want_tree, want_step = alone[b]
        torch.testing.assert_close(pre[b], want_pre, rtol=1e-4, atol=1e-4, msg=f"sequence {b}: prompt")
        torch.testing.assert_close(tree[b], want_tree, rtol=1e-4, atol=1e-4, msg=f"sequence {b}: tree")
        torch.testing.assert_close(step[b], want_step, rtol=1e-4, atol=1e-4, msg=f"sequence {b}: after its path")


@pytest.mark.cpu
def test_draft_over_sequences_with_their_own_context_equals_each_alone(tiny_checkpoints):
    """The DFlash drafter over B sequences, each with its own context length, bonus token and number of new context
    rows per call (padding past it differing by sequence), proposes for each what it proposes for that sequence
    alone; also through a sliding-window layer."""
    from engine.draft import DraftInput

    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    drafter = engine.load_drafter("random:2", target, 4, seed=5)
    drafter.windows = (5, None)  # the first layer a sliding window narrower than the context
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in drafter.draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    F = len(drafter.feature_layers) * target.model.cfg.hidden_size
    new = [[9, 2, 1], [4, 3, 3], [12, 1, 4]]  # per sequence: context rows committed before each call
    B, cap = len(new), 64
    features = torch.randn(B, 30, F, generator=gen)
    tokens = torch.randint(0, target.model.cfg.vocab_size, (B, 40), generator=gen)

    alone = []
    for b in range(B):
        drafter.start(new[b][0], cap)
        seen, out = 0, []
        for n in new[b]:
            padded = torch.cat((features[b:b + 1, seen:seen + n], torch.randn(1, 2, F, generator=gen)), dim=1)
            out.append(drafter.propose(DraftInput(tokens[b:b + 1], torch.tensor(seen + n), padded, torch.tensor(n))))
            seen += n
        alone.append(out)

    drafter.start(0, cap, sequences=B)
    seen = [0] * B
    for call in range(3):
        counts = [new[b][call] for b in range(B)]
        width = max(counts) + 1
        padded = torch.randn(B, width, F, generator=gen)
        for b, n in enumerate(counts):
            padded[b, :n] = features[b, seen[b]:seen[b] + n]
        got = drafter.propose(DraftInput(tokens, torch.tensor([s + n for s, n in zip(seen, counts)]), padded,
                                         torch.tensor(counts)))
        assert got.shape == (B, drafter.block_size - 1, target.model.cfg.vocab_size)
        for b in range(B):
            torch.testing.assert_close(got[b], alone[b][call], rtol=1e-5, atol=1e-5)
        seen = [s + n for s, n in zip(seen, counts)]


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 4), ("ddtree", 15)])
def test_batched_decoding_gives_every_request_its_batch1_ar_output(tiny_checkpoints, kind, method, budget):
    """BatchDecoder: 7 prompts of different lengths in 3 rows (rows refilled from the queue, then moved together as
    the queue empties), a stop token that ends some requests early, and an oracle drafter whose miss rate differs
    by request (0 to 0.9, so rows accept very differently): every request's tokens equal its batch-1 AR output
    (the float32 exactness rule), in the order given; on a dense target and on a hybrid one (Gated DeltaNet layers:
    each row's own tree and its own replayed path)."""
    from engine.batch import BatchDecoder
    from engine.exactness import compare_tokens, tolerance_for

    if kind == "dense":
        target = engine.load_target(str(tiny_checkpoints["qwen3-gqa-untied-sharded"][0]), "cpu", torch.float32)
    else:
        target = engine.load_target("synthetic:hybrid-tiny", "cpu", torch.float32)
    vocab = target.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 17, 8, 30, 11, 1, 22)]
    new_tokens = 24
    refs = [engine.Decoder(target.model).generate(p, new_tokens, record_margins=True) for p in prompts]
    stop = {refs[1].tokens[6], refs[4].tokens[3]}  # requests 1 and 4 (at least) stop early
    cut = [next((i + 1 for i, t in enumerate(r.tokens) if t in stop), new_tokens) for r in refs]
    drafter = None
    if method != "ar":
        draft = engine.load_drafter("random:1", target, 5, seed=2)
        drafter = engine.OracleDrafter([0], vocab, draft.block_size, device="cpu", cost=draft,
                                       max_length=64)
        for i, (p, r) in enumerate(zip(prompts, refs)):
            drafter.add_reference(p, r.tokens, miss_rate=[0.0, 0.3, 0.9][i % 3])
    decoder = BatchDecoder(target.model, drafter, engine.DecodeSettings(method, budget), rows=3)
    results = decoder.generate(prompts, new_tokens, stop)
    for i, (res, ref) in enumerate(zip(results, refs)):
        want = ref.tokens[:cut[i]]
        verdict = compare_tokens(want, ref.margins, res.tokens, tolerance_for(torch.float32))
        assert verdict.ok and len(res.tokens) == len(want), f"request {i}: {verdict.describe()}"
    assert min(cut) < new_tokens
    if method != "ar":
        taus = [r.tau for r in results]
        assert max(taus) > 2 * min(taus), taus  # rows accepted very differently


@pytest.mark.cpu
@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 4)])
def test_batched_decoding_with_a_drafter_that_reads_no_features(tiny_checkpoints, method, budget):
    """A drafter without feature layers (the Drafter default; here an oracle with no real draft behind it) decodes
    batched as it does alone: every request equals its batch-1 AR output."""
    from engine.batch import BatchDecoder
    from engine.exactness import compare_tokens, tolerance_for

    target = engine.load_target(str(tiny_checkpoints["qwen3-gqa-untied-sharded"][0]), "cpu", torch.float32)
    vocab = target.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (4, 13, 9)]
    refs = [engine.Decoder(target.model).generate(p, 16, record_margins=True) for p in prompts]
    drafter = engine.OracleDrafter([0], vocab, 5, device="cpu", max_length=64)
    assert tuple(drafter.feature_layers) == ()
    for p, r in zip(prompts, refs):
        drafter.add_reference(p, r.tokens, miss_rate=0.3)
    results = BatchDecoder(target.model, drafter, engine.DecodeSettings(method, budget), rows=2).generate(prompts, 16)
    for i, (res, ref) in enumerate(zip(results, refs)):
        verdict = compare_tokens(ref.tokens, ref.margins, res.tokens, tolerance_for(torch.float32))
        assert verdict.ok, f"request {i}: {verdict.describe()}"
    assert max(r.tau for r in results) > 1.5  # the oracle was read


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_first_prompts_are_prefilled_together_where_padding_pays(tiny_checkpoints, monkeypatch, kind):
    """The first rows' prompts share one prefill pass where padding them to the longest at most doubles the work
    (lengths 3, 5, 4 together; 40 alone); a hybrid target prefills one prompt at a time (a pad would enter its
    recurrent state); every request equals its batch-1 AR output."""
    from engine.batch import BatchDecoder
    from engine.exactness import compare_tokens, tolerance_for

    target = engine.load_target("synthetic:hybrid-tiny" if kind == "hybrid" else
                                str(tiny_checkpoints["qwen3-gqa-untied-sharded"][0]), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, target.model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 5, 4, 40)]
    refs = [engine.Decoder(target.model).generate(p, 10, record_margins=True) for p in prompts]
    prefills, forward = [], type(target.model).forward

    def spy(model, tokens, positions, *args, **kwargs):
        if int(positions[:, 0].max()) == 0:  # every row from position 0: a prefill
            prefills.append(tuple(tokens.shape))
        return forward(model, tokens, positions, *args, **kwargs)

    monkeypatch.setattr(type(target.model), "forward", spy)
    results = BatchDecoder(target.model, None, engine.DecodeSettings("ar"), rows=4).generate(prompts, 10)
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert compare_tokens(ref.tokens, ref.margins, res.tokens, tolerance_for(torch.float32)).ok, f"request {i}"
    assert prefills == ([(3, 5), (1, 40)] if kind == "dense" else [(1, 3), (1, 5), (1, 4), (1, 40)])


@pytest.mark.cpu
def test_budget_policy_picks_smaller_trees_as_concurrency_grows(monkeypatch):
    """engine.budget.choose_budgets: tok/s = c * tau(b) / (draft + verify(c, 1 + b)). With a verify pass that costs
    a fixed 5 ms plus 0.1 ms per row of the batch (weights first, arithmetic later) and tau rising with the budget,
    the biggest tree wins at concurrency 1 and the smallest at 32; every budget's tau comes from lossless runs."""
    from engine import budget

    taus = {2: 2.0, 8: 3.0, 32: 4.5}

    class FakeBench:
        target = type("T", (), {"model": None})()

        def measure(self, workload, new_tokens, method):
            b = int(method.split("-")[1])
            return dict(lossless=True, rounds=10, acceptance_lengths=[taus[b]] * 10, exactness="identical")

        def reference(self, workload, new_tokens):
            return type("R", (), {"tokens": [0] * new_tokens})()

        def _drafter_for(self, length):
            return None

    monkeypatch.setattr(budget, "verify_ms", lambda target, c, rows, context: 5.0 + 0.1 * c * rows)
    monkeypatch.setattr(budget, "draft_ms", lambda drafter, target, c, context, depth=None: 1.0)
    choices = budget.choose_budgets(FakeBench(), ["fib"], 16, [1, 32], budgets=tuple(taus))
    assert choices[1].budget == 32 and choices[32].budget == 2
    assert choices[32].table[8]["tok_s"] == pytest.approx(1e3 * 32 * 3.0 / (1.0 + 5.0 + 0.1 * 32 * 9))


@pytest.mark.cpu
def test_budget_policy_measures_real_passes(tiny_checkpoints):
    """The cost model's passes run on a real target and draft (any concurrency, any rows) and the choice is one of
    the candidates, with a positive modelled tok/s for each."""
    from engine import budget
    from engine.measure import Bench

    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    target = engine.load_target(str(path), "cpu", torch.float32)
    bench = Bench(target, engine.load_drafter("random:1", target, 4, seed=1), warmup=0, repeats=1, miss_rate=0.2)
    choices = budget.choose_budgets(bench, ["fib"], 8, [1, 3], budgets=(2, 6))
    assert set(choices) == {1, 3} and all(c.budget in (2, 6) for c in choices.values())
    assert all(v["tok_s"] > 0 and v["round_ms"] > 0 for c in choices.values() for v in c.table.values())


@contextlib.contextmanager
def capture_rules():
    """What the engine's code may not do in a stage that CUDA captures, enforced on a CPU: build a tensor from host
    data (torch.tensor: a host-to-device copy, refused in capture) or read a tensor on the host (a synchronisation).
    Calls from kernels/ pass: on a CPU their PyTorch references run, on a GPU the Triton kernels, which do neither."""
    def refuse(name, original):
        def f(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("engine"):
                raise AssertionError(f"{name} inside a captured stage")
            return original(*args, **kwargs)
        return f
    saved = {(torch, "tensor"): torch.tensor}
    saved.update({(torch.Tensor, n): getattr(torch.Tensor, n)
                  for n in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")})
    try:
        for (owner, name) in saved:
            setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}", saved[owner, name]))
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


class Replay:
    """A captured stage stood in for on a CPU: a replay runs the stage again under capture_rules()."""
    def __init__(self, stage, replays=None):
        self.stage, self.replays = stage, replays

    def replay(self):
        if self.replays is not None:
            self.replays.append(self.stage.__name__)
        with capture_rules():
            self.stage()


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 6)])
def test_batched_rounds_through_the_graph_path_stay_lossless(tiny_checkpoints, monkeypatch, method, budget, kind):
    """The CUDA-graph bookkeeping of BatchDecoder on a CPU: with capture stood in for by a replay that runs the stage
    again under capture_rules() (the engine builds no tensor from host data and reads none on the host), rounds after
    an admission and each batch size's first round run eagerly, later rounds replay the stages captured for their
    batch size (the batch shrinks as requests finish), and every request still equals its batch-1 AR output; on a
    dense and a hybrid target. (On a GPU, correctness/test_gpu_lossless.py checks real graphs.)"""
    from engine.batch import BatchDecoder
    from engine.exactness import compare_tokens, tolerance_for

    captured, replays = [], []
    monkeypatch.setattr(BatchDecoder, "_capture", staticmethod(
        lambda stages: {name: captured.append(stage) or Replay(stage, replays) for name, stage in stages.items()}))
    target = engine.load_target("synthetic:hybrid-tiny" if kind == "hybrid" else
                                str(tiny_checkpoints["qwen3-gqa-untied-sharded"][0]), "cpu", torch.float32)
    vocab = target.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (4, 19, 9, 13, 2)]
    refs = [engine.Decoder(target.model).generate(p, 20, record_margins=True) for p in prompts]
    drafter = None
    if method != "ar":
        drafter = engine.OracleDrafter([0], vocab, 5, device="cpu", cost=engine.load_drafter("random:1", target, 5),
                                       max_length=64)
        for i, (p, r) in enumerate(zip(prompts, refs)):
            drafter.add_reference(p, r.tokens, miss_rate=[0.0, 0.5, 0.9][i % 3])
    decoder = BatchDecoder(target.model, drafter, engine.DecodeSettings(method, budget), rows=3)
    decoder.cuda_graphs = True
    results = decoder.generate(prompts, 20)
    for i, (res, ref) in enumerate(zip(results, refs)):
        verdict = compare_tokens(ref.tokens, ref.margins, res.tokens, tolerance_for(torch.float32))
        assert verdict.ok and len(res.tokens) == 20, f"request {i}: {verdict.describe()}"
    stages = 2 if method == "ar" else 4
    assert len(captured) >= 2 * stages and len(captured) % stages == 0  # graphs for at least two batch sizes
    assert len(replays) > len(captured)  # most rounds replay


@pytest.mark.cpu
def test_a_batch_decoder_keeps_its_buffers_and_graphs_between_calls(tiny_checkpoints, monkeypatch):
    """A second generate() of the same size reuses the first one's buffers and captured stages (no capture in a
    timed run); another decoder re-allocating the shared drafter's buffers drops them; both stay lossless."""
    from engine.batch import BatchDecoder
    from engine.exactness import compare_tokens, tolerance_for

    captured = []
    monkeypatch.setattr(BatchDecoder, "_capture", staticmethod(
        lambda stages: {name: captured.append(stage) or Replay(stage) for name, stage in stages.items()}))
    target = engine.load_target(str(tiny_checkpoints["qwen3-gqa-untied-sharded"][0]), "cpu", torch.float32)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    refs = [engine.Decoder(target.model).generate(p, 12, record_margins=True) for p in prompts]
    drafter = engine.load_drafter("random:1", target, 4)
    first = BatchDecoder(target.model, drafter, engine.DecodeSettings("ddtree", 4), rows=3)
    first.cuda_graphs = True

    def check(results):
        for res, ref in zip(results, refs):
            assert compare_tokens(ref.tokens, ref.margins, res.tokens, tolerance_for(torch.float32)).ok

    check(first.generate(prompts, 12))
    n, batch = len(captured), first.batch
    assert n > 0
    check(first.generate(prompts, 12))
    assert first.batch is batch and len(captured) == n  # the same buffers, nothing captured again
    other = BatchDecoder(target.model, drafter, engine.DecodeSettings("ddtree", 4), rows=2)
    check(other.generate(prompts[:2], 12))  # re-allocates the drafter's batch buffers
    check(first.generate(prompts, 12))
    assert len(captured) > n and first.batch is batch
