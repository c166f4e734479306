"""Profile decode rounds on a GPU: the CUDA kernels of one method's rounds, by total time.

    python -m perf.profile_round --target synthetic:qwen3-8b --draft random:5 --method ddtree --budget 15
    python -m perf.profile_round --target synthetic:qwen3-8b --draft random:5 --method ddtree --by-stage --concurrency 8
    torchrun --nproc_per_node=2 -m perf.profile_round --target synthetic:qwen3-8b --method ar --by-stage --tp 2

Runs one generation to capture the CUDA graphs, then profiles a second one with torch.profiler and prints the
kernels that take the most device time per round (graph replays show their kernels individually), then how much of
the generation's GPU timeline had a kernel running and where it idled (short gaps: launches and dependencies; long
ones: the GPU waiting for the host). --by-stage instead
replays each captured stage's graph alone (draft, tree, verify, commit) and prints each stage's kernels in
microseconds per replay; --concurrency C decodes C prompts at once (engine.batch.BatchDecoder) and profiles the
graphs of the full batch. --by-stage also prints each replay's wall time (a replay timed alone, its own launch
included), its span on the profiler's timeline and the time in it with no kernel running (what the GPU waits for:
launch latency, dependencies, a peer in a collective; kernels that overlap under PDL count once), the kernel time by
kind, and for each kernel the idle time just before it (which launches the GPU waits for). --tp N runs under
torchrun, every rank alike (the collectives need them all), and rank 0 prints; --trace FILE writes rank 0's timeline
of the stage replays for chrome://tracing or Perfetto.

    python -m perf.profile_round --target synthetic:qwen3-8b --method ar --by-stage --solo-width 2

--solo-width N profiles rank 0 of width N alone on one GPU (SoloShard): the model sharded as rank 0's would be, its
collectives skipped, so the times are a rank's step without communication: its half-width GEMVs, attention over
its heads, norms and launches. It counts the collectives a target forward skips and adds --collective-us for each,
a model of what width N costs on top: the measured width-N step minus the solo one is what the collectives and
the waits for the slower rank really cost. For timing only: the tokens are not the model's.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import engine
from engine.batch import BatchDecoder
from engine.draft import DRAFT_WEIGHTS
from engine.errors import Parser
from engine.parallel import TensorParallel


# kernel names -> a kind, first match wins (the per-kind sums of --by-stage)
KINDS = (("all-reduce", ("all_reduce", "allreduce", "nccl", "symm", "barrier")),
         ("attention", ("attn", "flash", "sdpa", "fmha")),
         ("GEMM", ("gemm", "gemv", "skinny", "cutlass", "sm90_xmma", "cublas", "splitk", "nvjet")),
         ("norm", ("rmsnorm", "norm")),
         ("copy", ("copy", "memcpy", "memset", "fill")))


@dataclass
class SoloShard(TensorParallel):
    """Rank `rank` of a width-`world` group alone on one device, with no process group: shard_target shards the model
    as that rank's would be, and its collectives are skipped: an all-reduce returns this rank's part, a gather
    repeats it `world` times (the shapes of the real result). Every kernel of a rank's step but the collectives, for
    timing only: the tokens are not the model's. `calls` counts the collectives skipped."""
    calls: int = 0

    def enable_one_shot(self, device, dtype) -> None:
        pass  # no peers: the plain path, whose collectives are skipped

    def enable_fused_norm(self, device, dtype, hidden: int) -> None:
        pass

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.unsqueeze(0).expand(self.world, *x.shape)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def idle_before(kernels, replays: int) -> dict[str, float]:
    """Per kernel name, the time the GPU ran no kernel just before it started, us per replay. `kernels`: (name,
    start, end) in us of `replays` identical replays, in any order. A gap counts only after the previous kernel has
    ended (a kernel launched early, as programmatic dependent launch allows, overlaps and adds nothing). The gap
    before each replay's first kernel is the graph's launch, not the graph, and is left out."""
    idle: dict[str, float] = {}
    per_replay = max(1, len(kernels) // replays)
    end = None
    for i, (name, start, stop) in enumerate(sorted(kernels, key=lambda k: k[1])):
        if i % per_replay and start > end:
            idle[name] = idle.get(name, 0.0) + (start - end)
        end = stop if end is None else max(end, stop)
    return {name: t / replays for name, t in idle.items()}


def busy_and_gaps(kernels, long_gap_us: float = 20.0) -> tuple[float, float, float, float]:
    """A whole timeline of kernels (name, start, end) in us, in any order -> (span, busy, idle in gaps shorter than
    `long_gap_us`, idle in longer ones): busy is the union of the kernels' intervals, so overlapping kernels count
    once. Short gaps are launch and dependency waits inside and between graphs; long ones are the GPU waiting for
    the host (eager rounds, the prompt's prefill, a host read)."""
    if not kernels:
        return 0.0, 0.0, 0.0, 0.0
    busy = short = long = 0.0
    ordered = sorted(kernels, key=lambda k: k[1])
    first, end = ordered[0][1], ordered[0][1]
    for _, start, stop in ordered:
        if start > end:
            gap = start - end
            if gap < long_gap_us:
                short += gap
            else:
                long += gap
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = max(end, stop)
    return end - first, busy, short, long


def replay_span_and_idle(kernels, replays: int) -> tuple[float, float]:
    """Median over `replays` identical replays (kernels (name, start, end) in us, in any order) of a replay's span,
    its first kernel's start to its last kernel's end, and of the time in that span with no kernel running."""
    ordered = sorted(kernels, key=lambda k: k[1])
    n = max(1, len(ordered) // replays)
    spans, idles = [], []
    for i in range(0, n * replays, n):
        span, busy, _, _ = busy_and_gaps(ordered[i:i + n])
        spans.append(span)
        idles.append(span - busy)
    return sorted(spans)[len(spans) // 2], sorted(idles)[len(idles) // 2]


def wall_us(graph, replays: int) -> float:
    """Median wall time of one replay, in microseconds (CUDA events around each)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def stage_table(graphs: dict, replays: int, rows: int, show: bool = True, trace: str | None = None) -> None:
    """Each stage's graph replayed alone `replays` times under the profiler: its kernels in us per replay, the
    replay's wall time and the kernel time by kind. Under tensor parallelism every rank calls this (the graphs hold
    collectives) and only the rank with `show` prints."""
    for name, graph in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        wall = wall_us(graph, replays)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        if trace and show:
            prof.export_chrome_trace(f"{trace}.{name}.json")
        if not show:
            continue
        cuda = torch.autograd.DeviceType.CUDA
        timeline = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda]
        idle = idle_before(timeline, replays)
        span, idle_in_span = replay_span_and_idle(timeline, replays)
        events = [e for e in prof.key_averages() if e.device_type == cuda]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.device_time_total for e in events) / replays
        launches = sum(e.count for e in events) // replays
        # The wall of a replay timed alone includes its launch; a round's replays follow one another, so the span
        # on the profiler's timeline and the idle time inside it are what a round pays.
        print(f"\n{name}: {wall:.1f} us a replay (median wall, alone), {span:.1f} us from its first kernel to its last,"
              f" {idle_in_span:.1f} us of that without a kernel running; {total:.1f} us of kernels in {launches} "
              f"launches")
        by_kind: dict[str, list[float]] = {}
        for e in events:
            kind = by_kind.setdefault(kernel_kind(e.key), [0.0, 0])
            kind[0] += e.device_time_total / replays
            kind[1] += e.count // replays
        print("  by kind: " + ", ".join(f"{k} {t:.1f} us ({n} x)" for k, (t, n) in
                                        sorted(by_kind.items(), key=lambda kv: -kv[1][0])))
        print("     kernels  launches  idle before")
        for e in events[:rows]:
            print(f"  {e.device_time_total / replays:9.1f} us  {e.count // replays:4d} x  {idle.get(e.key, 0.0):7.1f} us  "
                  f"{e.key[:100]}")


def solo_model(solo: SoloShard, forward, collective_us: float) -> str:
    """Count the collectives one target forward skips (`forward`: a prefill that yields one token) and model what
    they add to a round of width solo.world."""
    solo.calls = 0
    forward()
    n = solo.calls
    return (f"rank 0 of width {solo.world} alone, collectives skipped: {n} in a target forward (AR's step, a verify; "
            f"plus the draft's where ENGINE_SHARD_DRAFT shards it); at {collective_us:g} us each width {solo.world} "
            f"adds about {n * collective_us / 1e3:.2f} ms a round to the times below")


def main() -> None:
    p = Parser(prog="python -m perf.profile_round", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="synthetic:qwen3-8b")
    p.add_argument("--draft", default="default")
    p.add_argument("--draft-weights", default="model", choices=DRAFT_WEIGHTS, help="as engine's --draft-weights")
    p.add_argument("--method", default="ar", choices=engine.METHODS)
    p.add_argument("--budget", type=int, default=15)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--by-stage", action="store_true", help="replay each stage's graph alone, kernels per stage")
    p.add_argument("--concurrency", type=int, default=1, help="prompts decoded at once (BatchDecoder when > 1)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel width (under torchrun --nproc_per_node=N)")
    p.add_argument("--trace", help="with --by-stage: write rank 0's timeline to TRACE.<stage>.json")
    p.add_argument("--solo-width", type=int, default=1,
                   help="profile rank 0 of this width alone on one GPU, its collectives skipped (timing only)")
    p.add_argument("--collective-us", type=float, default=6.4,
                   help="with --solo-width: the modelled cost of one collective, us (two H200s' one-shot all-reduce "
                        "inside a CUDA graph: 6.4)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it profiles captured CUDA graphs)")
    if args.concurrency < 1 or args.replays < 1:
        p.error("--concurrency and --replays must be >= 1")
    if args.solo_width < 1 or (args.solo_width > 1 and args.tp > 1):
        p.error("--solo-width must be >= 1, and runs one process (leave --tp at 1)")
    from engine.parallel import init_tensor_parallel, shard_target

    tp, device = init_tensor_parallel(args.tp)
    if args.solo_width > 1:
        tp = SoloShard(0, args.solo_width)
    show = tp is None or tp.rank == 0
    target = engine.load_target(args.target, device or "cuda", torch.bfloat16)
    if tp is not None:
        shard_target(target.model, tp)
    drafter = engine.load_drafter(args.draft, target, weights=args.draft_weights) if args.method != "ar" else None
    settings = engine.DecodeSettings(args.method, args.budget)
    prompt = list(range(1000, 1128))
    if isinstance(tp, SoloShard):
        print(solo_model(tp, lambda: engine.Decoder(target.model, drafter, settings).generate(prompt, 1),
                         args.collective_us))
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
        stage_table(graphs, args.replays, args.rows, show, args.trace)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        results = (decoder.generate(prompts, args.new_tokens) if args.concurrency > 1
                   else [decoder.generate(prompt, args.new_tokens)])
    if not show:
        return
    r = results[0]
    print(f"{args.method}: {r.rounds} rounds, {r.tok_s:.1f} tok/s, ms/round {r.stage_ms}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    cuda = torch.autograd.DeviceType.CUDA
    span, busy, short, long = busy_and_gaps([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                             if e.device_type == cuda])
    rounds = max(1, sum(x.rounds for x in results))  # (a one-token generation has no round)
    print(f"GPU timeline of the generation (prefill included): {span / 1e3:.2f} ms, a kernel running for "
          f"{busy / 1e3:.2f} ms ({busy / max(span, 1e-9):.0%}); idle {short / rounds:.1f} us a round in gaps under "
          f"20 us and {long / 1e3:.2f} ms in longer ones ({rounds} rounds)")


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
