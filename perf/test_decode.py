"""Acceptance-length and tokens/s floors per tensor-parallel width, model pair, workload and method, and the
acceptance floor on the held-out set that draft training never sees.

`pytest perf -m tp1` on a GPU runner asserts both floors; on a CPU the acceptance floors are asserted (greedy
decoding is deterministic) and tok/s floors skip with a reason. Floors live in perf/floors.json; record them
from a run with `python -m perf.floors record perf-results*.json`. Pairs whose name ends in "-synthetic" use
synthetic acceptance (the draft runs, an oracle built from the AR output replaces its proposals).
"""
from __future__ import annotations

import pytest

from engine.bench import device_bandwidth, weight_bytes
from engine.launch import visible_gpus
from engine.workloads import (CONCURRENCY, CONCURRENCY_METHODS, HELDOUT_METHODS, HELDOUT_TOKENS, METHODS,
                              WORKLOADS)
from perf.floors import floor_key
from perf.harness import suite_pairs

BENCHMARK_INFO = ("tok_s_median", "tok_s_min", "tok_s_max", "tau", "stage_ms", "ttft_ms", "new_tokens", "lossless",
                  "acceptance", "device", "telemetry")
WIDTHS = [pytest.param(w, marks=getattr(pytest.mark, f"tp{w}"), id=f"tp{w}") for w in (1, 2, 4, 8)]
# Tensor parallelism halves each rank's weight reads and adds two all-reduces a layer, each a cross-GPU round trip of
# 5 us or more (docs/performance.md, "Two GPUs"). A pair whose width-1 AR step runs below this share of its bandwidth
# roofline is launch-bound (SmolLM2-135M streams its weights in 0.07 ms of a 0.8 ms step on an H200): wider cannot
# be faster, and test_wider_is_faster_than_width1 says so instead of asserting it.
LAUNCH_BOUND_SHARE = 0.5


def pytest_generate_tests(metafunc):
    if "pair" in metafunc.fixturenames:
        metafunc.parametrize("pair", list(suite_pairs(metafunc.config, bool(visible_gpus()))))


def _skip_unrunnable_width(harness, tp: int) -> None:
    """Widths above 1 run as torchrun subprocesses, one GPU per rank: skip where the GPUs are missing."""
    if tp == 1:
        return
    if not harness.on_gpu:
        pytest.skip(f"tp{tp}: tensor-parallel perf runs need {tp} GPUs (NCCL); the CPU (gloo) path is checked by "
                    f"correctness/test_tensor_parallel.py")
    gpus = len(visible_gpus())
    if gpus < tp:
        pytest.skip(f"tp{tp} needs {tp} GPUs; this process sees {gpus} (under xdist each worker gets one: run tp>1 "
                    f"without -n)")


def _measure(harness, pair, tp, workload, length, method) -> dict:
    """The harness's record; tp > 1: one `torchrun -m engine bench --tp` per pair and width, then reused."""
    if tp == 1:
        return harness.measure(pair, workload, length, method)
    return harness.measure_tp(pair, tp, workload, length, method, METHODS, WORKLOADS)


def _floor(floors, pytestconfig, key, field):
    entry = floors.get(key)
    if entry is None or entry.get(field) is None:
        msg = (f"no {field} floor for {key} in {pytestconfig.getoption('floors')}: record one with "
               f"`python -m perf.floors record perf-results*.json`")
        if pytestconfig.getoption("require_floors"):
            pytest.fail(msg)
        pytest.skip(msg)
    return entry[field]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("tp", WIDTHS)
def test_acceptance_floor(harness, floors, pytestconfig, pair, tp, workload, method):
    _skip_unrunnable_width(harness, tp)
    for length in harness.lengths:
        r = _measure(harness, pair, tp, workload, length, method)
        assert r["lossless"], f"{pair}/{workload}/{method} diverged from AR: {r['exactness']}"
        key = floor_key(harness.device_name, tp, pair, workload, length, method)
        floor = _floor(floors, pytestconfig, key, "tau")
        assert r["tau"] >= floor, (f"tau {r['tau']:.3f} below floor {floor} for {key}; "
                                   f"acceptance lengths {r['acceptance_lengths']}; telemetry {r['telemetry']}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("tp", WIDTHS)
def test_throughput_floor(harness, floors, pytestconfig, benchmark, pair, tp, workload, method):
    _skip_unrunnable_width(harness, tp)
    if not harness.on_gpu:
        pytest.skip("tok/s floors are asserted on GPUs only (CPU timings are recorded, not gated)")
    for i, length in enumerate(harness.lengths):
        r = _measure(harness, pair, tp, workload, length, method)
        if i == 0 and tp == 1:  # pytest-benchmark: a generation on its clock, the harness's numbers as extra_info
            benchmark.extra_info.update({k: r[k] for k in BENCHMARK_INFO}, length=length)
            benchmark.pedantic(harness.generation(pair, workload, length, method), rounds=1)  # medians: extra_info
        key = floor_key(harness.device_name, tp, pair, workload, length, method)
        floor = _floor(floors, pytestconfig, key, "tok_s")
        assert r["tok_s_median"] >= floor, (
            f"{r['tok_s_median']:.1f} tok/s (min {r['tok_s_min']:.1f}, max {r['tok_s_max']:.1f}) below floor {floor} "
            f"for {key}; stage ms {r['stage_ms']}; telemetry {r['telemetry']}")


@pytest.mark.parametrize("tp", WIDTHS[1:])
def test_wider_is_faster_than_width1(harness, pair, tp):
    """AR at width tp beats width 1 on the first workload, for every pair that is bandwidth-bound at width 1; a
    launch-bound pair skips, with its measured share of the roofline as the reason."""
    _skip_unrunnable_width(harness, tp)
    if not harness.on_gpu:
        pytest.skip("tensor-parallel speed is measured on GPUs only")
    workload, length = WORKLOADS[0], next(iter(harness.lengths))
    one = harness.measure(pair, workload, length, "ar")
    roofline = device_bandwidth(harness.device) / weight_bytes(harness.bench(pair).target.model)
    share = one["tok_s_median"] / roofline
    if share < LAUNCH_BOUND_SHARE:
        pytest.skip(f"{pair}: width 1's AR runs at {share:.0%} of its bandwidth roofline ({one['tok_s_median']:.0f} "
                    f"of {roofline:.0f} tok/s): launch-bound, so width {tp}'s smaller weight reads cannot repay its "
                    f"two all-reduces a layer (docs/performance.md)")
    wide = _measure(harness, pair, tp, workload, length, "ar")
    assert wide["lossless"], f"{pair}/{workload}/ar at width {tp}: {wide['exactness']}"
    assert wide["tok_s_median"] > one["tok_s_median"], (
        f"{pair}: width {tp} AR {wide['tok_s_median']:.1f} tok/s is not faster than width 1's "
        f"{one['tok_s_median']:.1f} ({share:.0%} of the roofline at width 1); stage ms {wide['stage_ms']}")


@pytest.mark.parametrize("method", HELDOUT_METHODS)
@pytest.mark.parametrize("tp", WIDTHS[:1])
def test_heldout_acceptance_floor(harness, floors, pytestconfig, pair, tp, method):
    """tau over all rounds of the held-out set (engine.workloads.heldout_prompts(), HELDOUT_TOKENS new tokens each,
    every output checked against AR): the measure of a trained draft that `train-draft` reports in summary.json."""
    if harness.pairs[pair].miss_rate is not None:
        pytest.skip("synthetic acceptance: an oracle's tau says nothing about the draft on held-out prompts")
    r = harness.measure_heldout(pair, method)
    assert r["lossless"], f"{pair}/heldout/{method} diverged from AR: {r['exactness']}"
    key = floor_key(harness.device_name, tp, pair, "heldout", str(HELDOUT_TOKENS), method)
    floor = _floor(floors, pytestconfig, key, "tau")
    assert r["tau"] >= floor, (f"held-out tau {r['tau']:.3f} below floor {floor} for {key}; per prompt "
                               f"{ {w: round(p['tau'], 2) for w, p in r['per_prompt'].items()} }")


@pytest.mark.parametrize("method", CONCURRENCY_METHODS)
@pytest.mark.parametrize("concurrency", CONCURRENCY, ids=[f"c{c}" for c in CONCURRENCY])
@pytest.mark.parametrize("tp", WIDTHS[:1])
def test_concurrency_floor(harness, floors, pytestconfig, pair, tp, concurrency, method):
    """`concurrency` requests at once (engine/batch.py; the workloads' prompts in turn): every request equal to its
    batch-1 AR output; tau floors everywhere, aggregate tok/s floors on GPUs."""
    for length in harness.lengths:
        r = harness.measure_concurrency(pair, concurrency, length, method)
        assert r["lossless"], f"{pair}/c{concurrency}/{method}: a request diverged from AR: {r['exactness']}"
        key = floor_key(harness.device_name, tp, pair, "mix", length, method, concurrency)
        assert r["tau"] >= _floor(floors, pytestconfig, key, "tau"), f"tau {r['tau']:.3f} below floor for {key}"
        if harness.on_gpu:
            floor = _floor(floors, pytestconfig, key, "tok_s")
            assert r["tok_s_median"] >= floor, (f"{r['tok_s_median']:.1f} aggregate tok/s below floor {floor} for "
                                                f"{key}; per request {r['request_tok_s']:.1f}; telemetry "
                                                f"{r['telemetry']}")
