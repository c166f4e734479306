"""asv history of decode speed (ms per token) and acceptance length (tau) per model pair, workload and method.

All measuring happens once per asv run in `setup_cache`, through the shared harness `engine.bench.measure`,
with every method checked lossless against an AR reference; the track benchmarks only read the results, so
they neither load models nor touch CUDA. CPU: float32, 16 new tokens; GPU: bfloat16, 256 new tokens.

Environment (ASV_ENGINE_TARGET/DRAFT at import, since they add a parameter value; the rest in setup_cache):
  ASV_ENGINE_TARGET / ASV_ENGINE_DRAFT  add your own pair (target spec, draft spec; draft default `default`)
  ASV_ENGINE_PAIRS                      measure only these pairs (comma list of names); the others are skipped
  ASV_ENGINE_WORKLOADS                  measure only these workloads (comma list); the others are skipped
  ASV_ENGINE_NEW_TOKENS                 new tokens per generation instead of 16 (CPU) / 256 (GPU)
  ASV_ENGINE_SOURCE                     the engine checkout to measure (default: the one holding this file),
                                        e.g. an older commit's tree when recording history
"""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKLOADS = ("fib", "qsort", "arith", "json")
METHODS = ("ar", "dflash", "ddtree-15", "ddtree-32")
SYNTHETIC_MISS_RATE = 0.25  # the perf suite's value (perf/harness.py), so both report comparable tau

# name -> (target, draft, synthetic miss rate or None for real acceptance, GPU only)
PAIRS = {
    "default": ("smollm2-135m", "default", None, False),
    "default-synthetic": ("smollm2-135m", "default", SYNTHETIC_MISS_RATE, False),
    "qwen3-8b-synthetic": ("synthetic:qwen3-8b", "random:5", SYNTHETIC_MISS_RATE, True),
}
if os.environ.get("ASV_ENGINE_TARGET"):
    _target, _draft = os.environ["ASV_ENGINE_TARGET"], os.environ.get("ASV_ENGINE_DRAFT") or "default"
    # The label names the pair, so two user pairs never share one asv series.
    PAIRS[f"user:{Path(_target).name}|{Path(_draft).name}"] = (_target, _draft, None, False)


def _selected(variable: str, known) -> list[str]:
    names = [n for n in os.environ.get(variable, "").split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{variable}: unknown name {unknown[0]!r} (choose from {', '.join(known)})")
    return names or list(known)


def _import_engine():
    # asv's "existing" environment runs whatever `engine` is importable; pin it to the checkout under test so a
    # result filed under a commit is that commit's code.
    source = Path(os.environ.get("ASV_ENGINE_SOURCE") or ROOT).resolve()
    sys.path.insert(0, str(source))
    import engine

    if Path(engine.__file__).resolve().parent != source / "engine":
        raise ImportError(f"imported engine from {engine.__file__}, not from {source}")
    return engine


def measure_all() -> dict:
    """(pair, workload, method) -> the harness's record (tok/s median, tau, losslessness), or a skip reason."""
    engine = _import_engine()
    import torch
    from engine.bench import Method, measure, synthetic_drafter
    from engine.exactness import tolerance_for
    from engine.workloads import prompt_ids

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    new_tokens = int(os.environ.get("ASV_ENGINE_NEW_TOKENS") or (256 if on_gpu else 16))
    repeats, warmup = (3, 1) if on_gpu else (1, 0)  # as the perf suite: CPU runs are deterministic and slow
    pairs, workloads = _selected("ASV_ENGINE_PAIRS", PAIRS), _selected("ASV_ENGINE_WORKLOADS", WORKLOADS)
    methods = [Method.parse(m, topk_cap=8) for m in METHODS]
    results = {}
    for pair, (target_spec, draft_spec, miss_rate, gpu_only) in PAIRS.items():
        skip = "not in ASV_ENGINE_PAIRS" if pair not in pairs else "GPU only" if gpu_only and not on_gpu else None
        if skip:
            results.update({(pair, w, m): f"{pair}: {skip}" for w in WORKLOADS for m in METHODS})
            continue
        target = engine.load_target(target_spec, device, dtype)
        drafter = engine.load_drafter(draft_spec, target)
        if miss_rate is not None:
            longest = max(len(prompt_ids(target, w)) for w in workloads)
            drafter = synthetic_drafter(target, drafter, miss_rate, longest + new_tokens)
        decoders = {m.name: engine.Decoder(target.model, drafter if m.settings.method != "ar" else None, m.settings)
                    for m in methods}
        for w in WORKLOADS:
            if w not in workloads:
                results.update({(pair, w, m): "not in ASV_ENGINE_WORKLOADS" for m in METHODS})
                continue
            ids = prompt_ids(target, w)
            reference = engine.Decoder(target.model).generate(ids, new_tokens, record_margins=True)
            if miss_rate is not None:
                drafter.set_reference(ids + reference.tokens)
            for m in methods:
                r = measure(decoders[m.name], ids, new_tokens, (), reference, repeats, warmup, tolerance_for(dtype))
                results[(pair, w, m.name)] = dict(tok_s_median=r["tok_s_median"], tau=r["tau"], lossless=r["lossless"],
                                                  exactness=r["exactness"], new_tokens=r["new_tokens"],
                                                  device=device.type)
        del target, drafter, decoders
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()  # the next pair gets the whole GPU
    return results


class Decode:
    params = (list(PAIRS), list(WORKLOADS), list(METHODS))
    param_names = ("pair", "workload", "method")

    def setup_cache(self):
        return measure_all()

    # Loading plus 3 pairs x 4 workloads x 4 methods x 4 runs of 256 tokens, CUDA graph capture included.
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
