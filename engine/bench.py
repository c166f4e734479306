"""`python -m engine bench`'s report: the summary table over the measured matrix (engine.measure), the bandwidth
roofline, and transformers' generate as the baseline users would otherwise run."""
from __future__ import annotations

import statistics

import torch

from .decode import STAGES
from .errors import EngineError
from .loading import Target
from .measure import pooled_tau
from .workloads import heldout_prompts


def summarize(records: list[dict], methods: list[str], roofline_tok_s: float | None = None) -> list[dict]:
    """Per method: median tok/s over the matrix, tau over all its rounds, speed-up over AR, percent of the AR
    bandwidth roofline (GPU), lossless everywhere."""
    rows = []
    for name in methods:
        mine = [r for r in records if r["method"] == name]
        rows.append(dict(method=name, tok_s=statistics.median(r["tok_s_median"] for r in mine),
                         tau=pooled_tau(mine),
                         lossless=all(r["lossless"] for r in mine),
                         stage_ms={k: statistics.median(r["stage_ms"].get(k, 0.0) for r in mine)
                                   for k in STAGES if any(k in r["stage_ms"] for r in mine)}))
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
        stages = " ".join(f"{r['stage_ms'].get(k, 0.0):.2f}" for k in STAGES)
        lines.append(f"{r['method']:<11} {r['tok_s']:>8.1f} {r['tau']:>6.2f} {speedup:>7} {pct:>8}  "
                     f"{'yes' if r['lossless'] else 'NO':<8}  {stages}")
    return "\n".join(lines)


def parse_workloads(text: str) -> list[str]:
    """Comma-separated workload names: the registry's PROMPTS and HELDOUT names, or `heldout` for the whole
    held-out set."""
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
