"""Profile decode rounds on a GPU: the CUDA kernels of one method's rounds, by total time.

    python -m perf.profile_round --target synthetic:qwen3-8b --draft random:5 --method ddtree --budget 15
    python -m perf.profile_round --target synthetic:qwen3-8b --draft random:5 --method ddtree --by-stage --concurrency 8

Runs one generation to capture the CUDA graphs, then profiles a second one with torch.profiler and prints the
kernels that take the most device time per round (graph replays show their kernels individually). --by-stage instead
replays each captured stage's graph alone (draft, tree, verify, commit) and prints each stage's kernels in
microseconds per replay; --concurrency C decodes C prompts at once (engine.batch.BatchDecoder) and profiles the
graphs of the full batch.
"""
from __future__ import annotations

import argparse

import torch

import engine
from engine.batch import BatchDecoder


def stage_table(graphs: dict, replays: int, rows: int) -> None:
    """Each stage's graph replayed alone `replays` times under the profiler: its kernels in us per replay."""
    for name, graph in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.device_time_total for e in events) / replays
        print(f"\n{name}: {total:.1f} us of kernels per replay")
        for e in events[:rows]:
            print(f"  {e.device_time_total / replays:9.1f} us  {e.count // replays:4d} x  {e.key[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="synthetic:qwen3-8b")
    p.add_argument("--draft", default="default")
    p.add_argument("--method", default="ar", choices=engine.METHODS)
    p.add_argument("--budget", type=int, default=15)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--by-stage", action="store_true", help="replay each stage's graph alone, kernels per stage")
    p.add_argument("--concurrency", type=int, default=1, help="prompts decoded at once (BatchDecoder when > 1)")
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it profiles captured CUDA graphs)")
    if args.concurrency < 1 or args.replays < 1:
        p.error("--concurrency and --replays must be >= 1")
    target = engine.load_target(args.target, "cuda", torch.bfloat16)
    drafter = engine.load_drafter(args.draft, target) if args.method != "ar" else None
    settings = engine.DecodeSettings(args.method, args.budget)
    prompt = list(range(1000, 1128))
    if args.concurrency > 1:
        decoder = BatchDecoder(target.model, drafter, settings, rows=args.concurrency)
        prompts = [prompt[: 128 - 8 * i] for i in range(args.concurrency)]  # lengths differ as in serving
        decoder.generate(prompts, args.new_tokens)  # capture graphs, warm up
        graphs = decoder.batch.graphs.get(args.concurrency, {})
    else:
        decoder = engine.Decoder(target.model, drafter, settings)
        decoder.generate(prompt, args.new_tokens)
        graphs = decoder.graphs or {}
    if args.by_stage:
        if not graphs:
            raise SystemExit("no captured graphs to replay (a target whose rounds do not run as graphs)")
        stage_table(graphs, args.replays, args.rows)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        results = (decoder.generate(prompts, args.new_tokens) if args.concurrency > 1
                   else [decoder.generate(prompt, args.new_tokens)])
    r = results[0]
    print(f"{args.method}: {r.rounds} rounds, {r.tok_s:.1f} tok/s, ms/round {r.stage_ms}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
