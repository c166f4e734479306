"""Profile decode rounds on a GPU: the CUDA kernels of one method's rounds, by total time.

    python -m perf.profile_round --target synthetic:qwen3-8b --draft random:5 --method ddtree --budget 15

Runs one generation to capture the CUDA graphs, then profiles a second one with torch.profiler and prints the
kernels that take the most device time per round (graph replays show their kernels individually).
"""
from __future__ import annotations

import argparse

import torch

import engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="synthetic:qwen3-8b")
    p.add_argument("--draft", default="default")
    p.add_argument("--method", default="ar", choices=engine.METHODS)
    p.add_argument("--budget", type=int, default=15)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    target = engine.load_target(args.target, "cuda", torch.bfloat16)
    drafter = engine.load_drafter(args.draft, target) if args.method != "ar" else None
    decoder = engine.Decoder(target.model, drafter, engine.DecodeSettings(args.method, args.budget))
    prompt = list(range(1000, 1128))
    decoder.generate(prompt, args.new_tokens)  # capture graphs, warm up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = decoder.generate(prompt, args.new_tokens)
    print(f"{args.method}: {result.rounds} rounds, {result.tok_s:.1f} tok/s, ms/round {result.stage_ms}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
