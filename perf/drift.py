"""Does a pair's speed drift inside one process, and does the GPU's clock explain it? (issue 29, item 4)

    python -m perf.drift                                  # default pair, fib, 5 allocations x 3 runs
    python -m perf.drift --target synthetic:qwen3-8b --draft random:5 --allocations 3

For each of N allocations (fresh decoders: new KV caches, new CUDA graphs, the heap shifted by a random pad) it times
each method a few times on one prompt and prints tok/s, the verify stage (CUDA events), and the SM clock, power and
throttle reasons read through NVML right after each run. If tok/s moves between runs of one allocation while the
clock stays put, the drift is neither placement nor clock; that is what docs/performance.md reports for the H200.
"""
from __future__ import annotations

import statistics

import torch

import engine
from engine.errors import EngineError, Parser
from engine.launch import visible_gpus
from engine.measure import AUTO, Method
from engine.results import gpu_telemetry
from engine.workloads import WORKLOADS, prompt_ids


def main(argv=None) -> int:
    ap = Parser(prog="python -m perf.drift", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=engine.DEFAULT_TARGET)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--workload", default="fib", choices=sorted(WORKLOADS))
    ap.add_argument("--methods", default="ddtree-15,ar", help="comma-separated: ar, dflash, ddtree-<budget>")
    ap.add_argument("--allocations", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per allocation and method")
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args(argv)
    names = [m for m in a.methods.split(",") if m]
    if not names or AUTO in names:
        ap.error("--methods: name one or more of ar, dflash, ddtree-<budget> (a fixed budget: this times one method)")
    try:
        methods = [Method.parse(m) for m in names]
    except EngineError as e:
        ap.error(str(e))
    if a.allocations < 1 or a.runs < 1 or a.tokens < 2:
        ap.error("--allocations, --runs >= 1 and --tokens >= 2")

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = engine.load_target(a.target, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    drafter = engine.load_drafter(a.draft, target) if any(m.drafts for m in methods) else None
    gpus = visible_gpus()  # NVML's index of the GPU this process uses
    ids = prompt_ids(target, a.workload)

    rows = []
    for alloc in range(a.allocations):
        # shift where this allocation's buffers land
        pad = torch.empty(int(torch.randint(1, 64, ()).item()) << 20, dtype=torch.uint8, device=dev)
        for method in methods:
            decoder = engine.Decoder(target.model, drafter if method.drafts else None, method.settings)
            decoder.generate(ids, a.tokens)  # warm-up: captures the graphs
            for run in range(a.runs):
                r = decoder.generate(ids, a.tokens)
                t = (gpu_telemetry(gpus[0]) if dev == "cuda" and gpus else None) or {}
                rows.append((alloc, method.name, r.tok_s))
                print(f"allocation {alloc} {method.name:9} run {run}: {r.tok_s:8.1f} tok/s  verify "
                      f"{r.stage_ms.get('verify', 0):.3f} ms  SM {t.get('sm_clock_mhz', '-')} MHz  "
                      f"power {t.get('power_w', 0):.0f} W  throttle {t.get('throttle_reasons', '-')}", flush=True)
            del decoder
        del pad
    for method in (m.name for m in methods):
        per_alloc = [statistics.median(x for al, m, x in rows if al == i and m == method) for i in range(a.allocations)]
        runs = [x for _, m, x in rows if m == method]
        print(f"{method}: median per allocation {' '.join(f'{x:.0f}' for x in per_alloc)}; "
              f"all runs {min(runs):.0f}-{max(runs):.0f} tok/s ({max(runs) / min(runs):.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
