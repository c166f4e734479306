"""asv history of decode speed (ms per token) and acceptance length (tau) per model pair, workload and method.

All measuring happens once per asv run in `setup_cache`, through the engine's one measuring loop
(engine.measure.Bench, the one behind `python -m engine bench` and `pytest perf`), with every method checked
lossless against an AR reference; the track benchmarks only read the results, so they neither load models nor
touch CUDA. Pairs, workloads, methods, lengths and runs are the registry's (engine/workloads.py): on a CPU float32,
32 new tokens, one run; on a GPU bfloat16, 256 new tokens, the median of 3 after a warm-up, as the perf suite.

Environment (ASV_ENGINE_TARGET/DRAFT at import, since they add a parameter value; the rest in setup_cache):
  ASV_ENGINE_TARGET / ASV_ENGINE_DRAFT  add your own pair (target spec, draft spec; draft default `default`)
  ASV_ENGINE_PAIRS                      measure only these pairs (comma list of names); the others are skipped
  ASV_ENGINE_WORKLOADS                  measure only these workloads (comma list); the others are skipped
  ASV_ENGINE_NEW_TOKENS                 new tokens per generation instead of the registry's "short" length
  ASV_ENGINE_SOURCE                     the engine checkout to measure (default: the commit asv checked out
                                        under asv.continuous.conf.json, else the one holding this file), e.g.
                                        an older commit's tree when recording history
"""
from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source() -> Path:
    if os.environ.get("ASV_ENGINE_SOURCE"):
        return Path(os.environ["ASV_ENGINE_SOURCE"]).resolve()
    # An environment asv builds (asv.continuous.conf.json: `asv continuous BASE HEAD`) checks each commit out into
    # ENV_DIR/project before measuring it; the "existing" environment has no checkout of its own.
    if os.environ.get("ASV_ENV_TYPE", "existing") != "existing" and os.environ.get("ASV_ENV_DIR"):
        return (Path(os.environ["ASV_ENV_DIR"]) / "project").resolve()
    return ROOT


def _registry():
    """engine/workloads.py of the checkout under test, read without importing the engine (and torch): asv imports
    this module in every process it starts."""
    spec = importlib.util.spec_from_file_location("_asv_engine_registry", _source() / "engine" / "workloads.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


REGISTRY = _registry()
PAIRS = {p.name: p for p in REGISTRY.PAIRS}
if os.environ.get("ASV_ENGINE_TARGET"):
    _user = REGISTRY.user_pair(os.environ["ASV_ENGINE_TARGET"], os.environ.get("ASV_ENGINE_DRAFT") or "default")
    PAIRS[_user.name] = _user
WORKLOADS, METHODS = REGISTRY.WORKLOADS, REGISTRY.METHODS
# Batched decoding's history: c8 (older commits, without batched decoding, skip these benchmarks)
CONCURRENCY_METHODS = getattr(REGISTRY, "CONCURRENCY_METHODS", ("ar",))
TRACKED_CONCURRENCY = 8


def _selected(variable: str, known) -> list[str]:
    names = [n for n in os.environ.get(variable, "").split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{variable}: unknown name {unknown[0]!r} (choose from {', '.join(known)})")
    return names or list(known)


def _import_engine():
    # asv's "existing" environment runs whatever `engine` is importable; pin it to the checkout under test so a
    # result filed under a commit is that commit's code.
    source = _source()
    sys.path.insert(0, str(source))
    import engine

    if Path(engine.__file__).resolve().parent != source / "engine":
        raise ImportError(f"imported engine from {engine.__file__}, not from {source}")
    return engine


def measure_all() -> dict:
    """(pair, workload, method) -> the measured record's tok/s median, tau and losslessness, or a skip reason."""
    engine = _import_engine()
    import torch
    from engine.measure import Bench

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    new_tokens = int(os.environ.get("ASV_ENGINE_NEW_TOKENS") or REGISTRY.lengths_for(device.type)["short"])
    pairs, workloads = _selected("ASV_ENGINE_PAIRS", PAIRS), _selected("ASV_ENGINE_WORKLOADS", WORKLOADS)
    results = {}
    for pair in PAIRS.values():
        skip = "not in ASV_ENGINE_PAIRS" if pair.name not in pairs else "GPU only" if pair.gpu_only and not on_gpu \
            else None
        if skip:
            results.update({(pair.name, w, m): f"{pair.name}: {skip}" for w in WORKLOADS for m in METHODS})
            continue
        target = engine.load_target(pair.target, device, dtype)
        drafter = engine.load_drafter(pair.draft, target, weights=pair.draft_weights)
        bench = Bench(target, drafter, miss_rate=pair.miss_rate,
                      **REGISTRY.runs_for(device.type))
        for w in WORKLOADS:
            for m in METHODS:
                if w not in workloads:
                    results[(pair.name, w, m)] = "not in ASV_ENGINE_WORKLOADS"
                    continue
                r = bench.measure(w, new_tokens, m)
                results[(pair.name, w, m)] = {k: r[k] for k in ("tok_s_median", "tau", "lossless", "exactness")}
        del target, bench
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()  # the next pair gets the whole GPU
    return results


class Decode:
    params = (list(PAIRS), list(WORKLOADS), list(METHODS))
    param_names = ("pair", "workload", "method")

    def setup_cache(self):
        return measure_all()

    # Loading plus 5 pairs x 4 workloads x 6 methods x 4 runs of 256 tokens, CUDA graph capture included (the 27B
    # hybrid pair: about 1-4 s per run at its 70-200 tok/s on an H200).
    setup_cache.timeout = 1800

    def setup(self, results, pair, workload, method):
        if isinstance(results[(pair, workload, method)], str):
            raise NotImplementedError(results[(pair, workload, method)])  # asv reports it as skipped

    @staticmethod
    def _checked(results, pair, workload, method) -> dict:
        r = results[(pair, workload, method)]
        if not r["lossless"]:
            # A number for output that is wrong would be a meaningless point in the history.
            raise AssertionError(f"{pair}/{workload}/{method} is not lossless against AR: {r['exactness']}")
        return r

    def track_ms_per_token(self, results, pair, workload, method):
        return 1e3 / self._checked(results, pair, workload, method)["tok_s_median"]

    track_ms_per_token.unit = "ms/token"

    def track_tau(self, results, pair, workload, method):
        return self._checked(results, pair, workload, method)["tau"]

    track_tau.unit = "tokens/round"


def measure_concurrency() -> dict:
    """(pair, method) -> the c8 sweep record's aggregate tok/s, tau and losslessness (engine.measure.sweep: 8
    requests at once, the workloads' prompts in turn), or a skip reason."""
    engine = _import_engine()
    import torch

    try:
        from engine.measure import sweep
    except ImportError:
        return {(p, m): "this commit has no batched decoding" for p in PAIRS for m in CONCURRENCY_METHODS}
    from engine.measure import Bench

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    new_tokens = int(os.environ.get("ASV_ENGINE_NEW_TOKENS") or REGISTRY.lengths_for(device.type)["short"])
    pairs = _selected("ASV_ENGINE_PAIRS", PAIRS)
    results = {}
    for pair in PAIRS.values():
        skip = "not in ASV_ENGINE_PAIRS" if pair.name not in pairs else "GPU only" if pair.gpu_only and not on_gpu \
            else None
        if skip:
            results.update({(pair.name, m): f"{pair.name}: {skip}" for m in CONCURRENCY_METHODS})
            continue
        target = engine.load_target(pair.target, device, dtype)
        drafter = engine.load_drafter(pair.draft, target, weights=pair.draft_weights)
        bench = Bench(target, drafter, miss_rate=pair.miss_rate,
                      **REGISTRY.runs_for(device.type))
        for r in sweep(bench, list(CONCURRENCY_METHODS), list(WORKLOADS), new_tokens, [TRACKED_CONCURRENCY],
                       progress=False):
            results[(pair.name, r["method"])] = {k: r[k] for k in ("aggregate_tok_s", "tau", "lossless", "exactness")}
        del target, bench
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    return results


class Concurrency:
    """8 requests at once: aggregate ms per token (every request's tokens over the call's wall time) and tau."""
    params = (list(PAIRS), list(CONCURRENCY_METHODS))
    param_names = ("pair", "method")

    def setup_cache(self):
        return measure_concurrency()

    setup_cache.timeout = 1800

    def setup(self, results, pair, method):
        if isinstance(results[(pair, method)], str):
            raise NotImplementedError(results[(pair, method)])

    @staticmethod
    def _checked(results, pair, method) -> dict:
        r = results[(pair, method)]
        if not r["lossless"]:
            raise AssertionError(f"{pair}/c{TRACKED_CONCURRENCY}/{method}: a request diverged from AR: "
                                 f"{r['exactness']}")
        return r

    def track_c8_ms_per_token(self, results, pair, method):
        return 1e3 / self._checked(results, pair, method)["aggregate_tok_s"]

    track_c8_ms_per_token.unit = "ms/token"

    def track_c8_tau(self, results, pair, method):
        return self._checked(results, pair, method)["tau"]

    track_c8_tau.unit = "tokens/round"
