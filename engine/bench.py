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
from .oracle import OracleDrafter
from .workloads import CPU_LENGTHS, LENGTHS, heldout_prompts, prompt_ids

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


def measure(decoder: Decoder, ids: list[int], new_tokens: int, stop, reference, repeats: int, warmup: int,
            tolerance: float, on_run=None) -> dict:
    """The measurement harness: `warmup` untimed then `repeats` timed generations of one decoder; median, min and
    max decode tok/s, tau, acceptance lengths, median ms per round per stage, TTFT, and the exactness verdict
    against the AR `reference` (a GenerationResult with margins)."""
    runs = []
    for _ in range(warmup + repeats):
        runs.append(decoder.generate(ids, new_tokens, stop))
        if on_run is not None:
            on_run()
    runs = runs[warmup:]
    first = runs[0]
    verdict = compare_tokens(reference.tokens, reference.margins, first.tokens, tolerance)
    tok_s = [r.tok_s for r in runs]
    return dict(prompt_tokens=len(ids), new_tokens=len(first.tokens), tok_s_median=statistics.median(tok_s),
                tok_s_min=min(tok_s), tok_s_max=max(tok_s), tau=first.tau, rounds=first.rounds,
                acceptance_lengths=first.acceptance_lengths,
                stage_ms={k: statistics.median(r.stage_ms.get(k, 0.0) for r in runs) for k in first.stage_ms},
                ttft_ms=statistics.median(r.prefill_s for r in runs) * 1e3,
                lossless=verdict.ok, exactness=verdict.describe())


def synthetic_drafter(target: Target, drafter, miss_rate: float, max_length: int) -> OracleDrafter:
    """Synthetic acceptance: `drafter` still runs every round (real cost), an oracle replaces its proposals."""
    return OracleDrafter([], target.model.cfg.vocab_size, drafter.block_size, miss_rate=miss_rate,
                         device=target.model.device, cost=drafter, max_length=max_length)


def run_matrix(target: Target, drafter, methods: list[Method], workloads: list[str], lengths: dict[str, int],
               repeats: int = 1, warmup: int = 1, stop_at_eos: bool = False, progress: bool = True,
               synthetic_miss_rate: float | None = None) -> list[dict]:
    """Measure every method on every (workload, length); return one record per combination.

    An untimed AR run with logit margins is the reference of each combination: every method's output is
    checked against it. With `synthetic_miss_rate`, the drafter still runs (real cost) but an oracle built from
    that reference replaces its proposals (synthetic acceptance, DESIGN.md section 6).
    """
    from tqdm import tqdm

    oracle = None
    if synthetic_miss_rate is not None and drafter is not None:
        longest = max(len(prompt_ids(target, w)) for w in workloads) + max(lengths.values())
        oracle = synthetic_drafter(target, drafter, synthetic_miss_rate, longest)
        drafter = oracle
    decoders = {m.name: Decoder(target.model, drafter if m.settings.method != "ar" else None, m.settings)
                for m in methods}
    reference_decoder = Decoder(target.model)
    tolerance = tolerance_for(target.model.dtype)
    stop = target.stop_ids if stop_at_eos else ()
    bar = tqdm(total=len(workloads) * len(lengths) * (len(methods) * (repeats + warmup) + 1), disable=not progress,
               desc="bench", unit="run", file=sys.stderr)
    records = []
    for workload in workloads:
        ids = prompt_ids(target, workload)
        for length_name, new_tokens in lengths.items():
            bar.set_postfix_str(f"{workload}/{length_name}/reference")
            reference = reference_decoder.generate(ids, new_tokens, stop, record_margins=True)
            bar.update()
            if oracle is not None:
                oracle.set_reference(ids + reference.tokens)
            for m in methods:
                bar.set_postfix_str(f"{workload}/{length_name}/{m.name}")
                record = measure(decoders[m.name], ids, new_tokens, stop, reference, repeats, warmup, tolerance,
                                 on_run=bar.update)
                record.update(workload=workload, length=length_name, method=m.name,
                              acceptance="synthetic" if oracle is not None and m.settings.method != "ar" else "real")
                records.append(record)
    bar.close()
    return records


def pooled_tau(records: list[dict]) -> float:
    """Accepted tokens over rounds across the records: tau weighted by tokens, not a mean of the records' taus."""
    return sum(sum(r["acceptance_lengths"]) for r in records) / max(1, sum(r["rounds"] for r in records))


def summarize(records: list[dict], methods: list[Method], roofline_tok_s: float | None = None) -> list[dict]:
    """Per method: median tok/s over the matrix, token-weighted tau, speed-up over AR, percent of the AR
    bandwidth roofline (GPU), lossless everywhere."""
    rows = []
    for m in methods:
        mine = [r for r in records if r["method"] == m.name]
        rows.append(dict(method=m.name, tok_s=statistics.median(r["tok_s_median"] for r in mine),
                         tau=pooled_tau(mine),
                         lossless=all(r["lossless"] is not False for r in mine),
                         stage_ms={k: statistics.median(r["stage_ms"].get(k, 0.0) for r in mine)
                                   for k in ("draft", "tree", "verify", "commit") if any(k in r["stage_ms"] for r in mine)}))
    ar = next((r["tok_s"] for r in rows if r["method"] == "ar"), None)
    for r in rows:
        r["speedup_vs_ar"] = r["tok_s"] / ar if ar else None
        r["pct_roofline"] = 100 * r["tok_s"] / roofline_tok_s if roofline_tok_s else None
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'method':<11} {'tok/s':>8} {'tau':>6} {'vs AR':>7} {'roofline':>8}  {'lossless':<8}  "
             f"ms/round (draft tree verify commit)"]
    for r in rows:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        pct = f"{r['pct_roofline']:.0f}%" if r.get("pct_roofline") else "-"
        stages = " ".join(f"{r['stage_ms'].get(k, 0.0):.2f}" for k in ("draft", "tree", "verify", "commit"))
        lines.append(f"{r['method']:<11} {r['tok_s']:>8.1f} {r['tau']:>6.2f} {speedup:>7} {pct:>8}  "
                     f"{'yes' if r['lossless'] else 'NO':<8}  {stages}")
    return "\n".join(lines)


def default_lengths(device: torch.device) -> dict[str, int]:
    return dict(LENGTHS if device.type == "cuda" else CPU_LENGTHS)


def parse_workloads(text: str) -> list[str]:
    """Comma-separated workload names: section 7's, the held-out prompts' (workloads.HELDOUT), or `heldout` for
    the whole held-out set."""
    known = heldout_prompts()
    names = []
    for w in filter(None, text.split(",")):
        for name in (known if w == "heldout" else [w]):
            if name not in names:
                names.append(name)
    unknown = [w for w in names if w not in known]
    if unknown or not names:
        raise EngineError(f"unknown workload {unknown[0] if unknown else text!r} (choose from {', '.join(known)}, "
                          f"or heldout for all of them)")
    return names


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step streams (tied weights once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def device_bandwidth(device: torch.device) -> float | None:
    """Device-memory bandwidth in bytes/s from a large device-to-device copy (read + write), median of 10."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 29, dtype=torch.uint8, device=device)  # 512 MiB, well past the L2
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def hf_generate_tok_s(target: Target, prompt: list[int], new_tokens: int) -> float:
    """transformers' greedy `generate` on the same weights' architecture: new tokens per second (prefill
    included), the baseline users would otherwise run."""
    import time

    from transformers import AutoModelForCausalLM

    dev, dtype = target.model.device, target.model.dtype
    if target.source is not None:
        model = AutoModelForCausalLM.from_pretrained(target.source, dtype=dtype).to(dev)
    else:  # synthetic: random weights of the same shape (speed does not depend on values)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(target.model.cfg.hf, dtype=dtype)
    model.eval()
    ids = torch.tensor([prompt], device=dev)

    def run(n):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)

    with torch.no_grad():
        run(4)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(new_tokens)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    return new_tokens / elapsed
