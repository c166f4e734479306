"""`python -m engine bench`: the workload matrix on one target/draft pair, checked lossless against AR.

Each (workload, length) runs AR first with logit margins, then every speculative method; each method's tokens
are compared with AR's under the exactness rule, so a speed-up is only reported for output that is right.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

import torch

from .decode import DecodeSettings, Decoder
from .errors import EngineError
from .exactness import compare_tokens, tolerance_for
from .loading import Target
from .workloads import CPU_LENGTHS, LENGTHS, PROMPTS, prompt_ids

DEFAULT_METHODS = ("ar", "dflash", "ddtree-15", "ddtree-16", "ddtree-32", "ddtree-64")


@dataclass(frozen=True)
class Method:
    name: str
    settings: DecodeSettings

    @classmethod
    def parse(cls, name: str, topk_cap: int) -> "Method":
        kind, _, budget = name.partition("-")
        if kind == "ddtree":
            if not budget.isdigit():
                raise EngineError(f"bad method {name!r}: write ddtree-<budget>, e.g. ddtree-15")
            return cls(name, DecodeSettings("ddtree", int(budget), topk_cap))
        if kind in ("ar", "dflash") and not budget:
            return cls(name, DecodeSettings(kind))
        raise EngineError(f"bad method {name!r} (ar, dflash or ddtree-<budget>)")


def run_matrix(target: Target, drafter, methods: list[Method], workloads: list[str], lengths: dict[str, int],
               repeats: int = 1, warmup: int = 1, stop_at_eos: bool = False, progress: bool = True) -> list[dict]:
    """Measure every method on every (workload, length); return one record per combination."""
    from tqdm import tqdm

    decoders = {m.name: Decoder(target.model, drafter if m.settings.method != "ar" else None, m.settings)
                for m in methods}
    tolerance = tolerance_for(target.model.dtype)
    stop = target.stop_ids if stop_at_eos else ()
    bar = tqdm(total=len(workloads) * len(lengths) * len(methods) * (repeats + warmup), disable=not progress,
               desc="bench", unit="run", file=sys.stderr)
    records = []
    for workload in workloads:
        ids = prompt_ids(target, workload)
        for length_name, new_tokens in lengths.items():
            reference = None
            for m in sorted(methods, key=lambda m: m.name != "ar"):   # AR first: it is the reference
                bar.set_postfix_str(f"{workload}/{length_name}/{m.name}")
                runs = []
                for i in range(warmup + repeats):
                    runs.append(decoders[m.name].generate(ids, new_tokens, stop, record_margins=m.name == "ar"))
                    bar.update()
                runs = runs[warmup:]
                first = runs[0]
                if m.name == "ar":
                    reference = first
                verdict = compare_tokens(reference.tokens, reference.margins, first.tokens, tolerance) \
                    if reference is not None else None
                tok_s = [r.tok_s for r in runs]
                records.append(dict(
                    workload=workload, length=length_name, method=m.name, prompt_tokens=len(ids),
                    new_tokens=len(first.tokens), tok_s_median=statistics.median(tok_s), tok_s_min=min(tok_s),
                    tok_s_max=max(tok_s), tau=first.tau, rounds=first.rounds,
                    acceptance_lengths=first.acceptance_lengths, stage_ms=first.stage_ms,
                    ttft_ms=statistics.median(r.prefill_s for r in runs) * 1e3,
                    lossless=None if verdict is None else verdict.ok,
                    exactness=None if verdict is None else verdict.describe(),
                ))
    bar.close()
    return records


def summarize(records: list[dict], methods: list[Method]) -> list[dict]:
    """Per method: median tok/s over the matrix, token-weighted tau, speed-up over AR, lossless everywhere."""
    rows = []
    for m in methods:
        mine = [r for r in records if r["method"] == m.name]
        rows.append(dict(method=m.name, tok_s=statistics.median(r["tok_s_median"] for r in mine),
                         tau=sum(sum(r["acceptance_lengths"]) for r in mine) / max(1, sum(r["rounds"] for r in mine)),
                         lossless=all(r["lossless"] is not False for r in mine),
                         stage_ms={k: statistics.median(r["stage_ms"].get(k, 0.0) for r in mine)
                                   for k in ("draft", "tree", "verify", "commit") if any(k in r["stage_ms"] for r in mine)}))
    ar = next((r["tok_s"] for r in rows if r["method"] == "ar"), None)
    for r in rows:
        r["speedup_vs_ar"] = r["tok_s"] / ar if ar else None
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'method':<11} {'tok/s':>8} {'tau':>6} {'vs AR':>7}  {'lossless':<8}  ms/round (draft tree verify commit)"]
    for r in rows:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        stages = " ".join(f"{r['stage_ms'].get(k, 0.0):.2f}" for k in ("draft", "tree", "verify", "commit"))
        lines.append(f"{r['method']:<11} {r['tok_s']:>8.1f} {r['tau']:>6.2f} {speedup:>7}  "
                     f"{'yes' if r['lossless'] else 'NO':<8}  {stages}")
    return "\n".join(lines)


def default_lengths(device: torch.device) -> dict[str, int]:
    return dict(LENGTHS if device.type == "cuda" else CPU_LENGTHS)


def parse_workloads(text: str) -> list[str]:
    names = [w for w in text.split(",") if w]
    unknown = [w for w in names if w not in PROMPTS]
    if unknown or not names:
        raise EngineError(f"unknown workload {unknown[0] if unknown else text!r} (choose from {', '.join(PROMPTS)})")
    return names
