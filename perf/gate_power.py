"""The A/B gate's false alarms and power on this runner: how often an A/A run fails, and how often a planted slowdown
is caught, measured with the gate's own processes and verdicts (perf/ab.py).

    python -m perf.gate_power --plant 0.05 --runs 3                    # the pre-merge pairs, 3 runs each
    python -m perf.gate_power --pairs default --plant 0.05 --plant 0.1 --runs 3 --budget-s 500 --json power.json

Arms: the base (REV, default HEAD, exported as the gate exports it), the head (this checkout) and the head with each
planted slowdown (ENGINE_PLANT_SLOWDOWN=F, engine/plant.py). A run is the gate's number of rounds; in each round every
arm runs one bench process over every pair (as the gate does), with the gate's arguments (perf.ab.bench_args, the
pre-merge workloads and methods), in an order that rotates from round to round. Each run is judged as the gate judges (perf.ab.judge): the
head against the base is an A/A run, which must pass; each plant against the base is a planted run, which should
fail "head slower". The base's processes of a run serve all its comparisons (a third fewer processes than separate
gate runs); runs share nothing. `--budget-s` starts no run that the previous run's duration says would end past it.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import time
from datetime import datetime, timezone

from engine.errors import Parser
from engine.launch import visible_gpus
from engine.results import gpu_telemetry, write_json
from engine.workloads import GATED_LENGTHS, PREMERGE, lengths_for, pairs
from perf.ab import CONFIDENCE, ROUNDS, ROOT, RUNS, Side, SideError, _git, bench_args, export, judge, min_rounds


def arms(base_tree, plants: list[float]) -> list[Side]:
    return [Side("base", base_tree), Side("head", ROOT)] + [
        Side(f"plant {f:g}", ROOT, {"ENGINE_PLANT_SLOWDOWN": f"{f:g}"}) for f in plants]


def run_once(sides: list[Side], chosen: dict, lengths: dict, rounds: int, processes: list, progress) -> dict:
    """One run: `rounds` rounds in which every arm runs one process over every pair, as the gate does;
    {(pair, workload, length, method): {arm: [records]}}."""
    records: dict[tuple, dict[str, list]] = {}
    requests = [bench_args(spec, 1, list(workloads), list(methods), lengths)
                for spec, workloads, methods in chosen.values()]
    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            t0 = time.perf_counter()
            results = side.bench(requests, 1)
            seconds = time.perf_counter() - t0
            processes.append(dict(round=r, arm=side.name, pairs=list(chosen), seconds=round(seconds, 2)))
            progress(f"round {r + 1}/{rounds}: {side.name} {', '.join(chosen)} in {seconds:.1f} s")
            for (name, (spec, workloads, methods)), result in zip(chosen.items(), results):
                if isinstance(result, SideError):
                    raise result
                for rec in result["runs"]:
                    if rec["workload"] in workloads and rec["method"] in methods:  # bench adds AR references
                        key = (name, rec["workload"], rec["length"], rec["method"])
                        records.setdefault(key, {s.name: [] for s in sides})[side.name].append(rec)
    return records


def verdicts(records: dict, threshold: float) -> list[dict]:
    """Per combination and arm other than the base: the gate's verdict against the base."""
    out = []
    for (pair, workload, length, method), by_arm in sorted(records.items()):
        for arm, recs in by_arm.items():
            if arm != "base":
                v = judge(recs, by_arm["base"], threshold)
                out.append(dict(pair=pair, workload=workload, length=length, method=method, arm=arm,
                                verdict=v["verdict"], ratio=v["ratio"], low=v["low"], high=v["high"],
                                problems=v["problems"], arm_tok_s=v["head_tok_s"], base_tok_s=v["base_tok_s"],
                                tau=v["head_tau"], base_tau=v["base_tau"], notes=v["notes"],
                                arm_sm_clock_mhz=[r.get("sm_clock_mhz") for r in recs],
                                base_sm_clock_mhz=[r.get("sm_clock_mhz") for r in by_arm["base"]]))
    return out


def main(argv=None) -> int:
    ap = Parser(prog="python -m perf.gate_power", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the base revision (default HEAD: an A/A of this commit)")
    ap.add_argument("--pairs", default=",".join(PREMERGE), help="pairs of the pre-merge selection to measure")
    ap.add_argument("--plant", type=float, action="append", default=[], metavar="F",
                    help="a planted arm, ENGINE_PLANT_SLOWDOWN=F (repeatable; default 0.05)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the gate's)")
    ap.add_argument("--threshold", type=float, default=0.03, help="the gate's --ab-threshold")
    ap.add_argument("--budget-s", type=float, default=None, help="start no run expected to end past this")
    ap.add_argument("--json", default="gate-power.json", help="results, rewritten atomically after every run")
    args = ap.parse_args(argv)

    device = "cuda" if visible_gpus() else "cpu"
    known = pairs(device == "cuda")
    names = [p for p in args.pairs.split(",") if p]
    bad = [p for p in names if p not in PREMERGE or p not in known]
    rounds = args.rounds or ROUNDS[device]
    plants = args.plant or [0.05]
    problems = ([f"--pairs: {', '.join(bad)} not among the pre-merge pairs this machine has "
                 f"({', '.join(p for p in PREMERGE if p in known)})"] if bad or not names else [])
    problems += [f"--plant {f}: a fraction > 0" for f in plants if not f > 0]
    problems += [f"--runs {args.runs}: at least 1"] if args.runs < 1 else []
    problems += [f"--rounds {rounds}: at least {min_rounds()}"] if rounds < min_rounds() else []
    if problems:
        ap.error("; ".join(problems))
    try:
        base_sha = _git("rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}")
    except Exception:
        ap.error(f"--base {args.base}: not a commit of the repository at {ROOT}")
    lengths = {k: v for k, v in lengths_for(device).items() if k in GATED_LENGTHS}
    chosen = {p: (known[p], *PREMERGE[p]) for p in names}

    base_tree = export(base_sha)
    sides = arms(base_tree, plants)
    for side in sides:
        side.check_import()
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), base=dict(rev=args.base,
                   sha=base_sha), head=_git("rev-parse", "HEAD"), device=device,
                   telemetry=gpu_telemetry() if device == "cuda" else None, rounds=rounds, runs_per_process=RUNS,
                   lengths=lengths, threshold=args.threshold, confidence=CONFIDENCE, arms=[s.name for s in sides],
                   runs=[], processes=[])
    start, last = time.perf_counter(), None
    try:
        for n in range(args.runs):
            elapsed = time.perf_counter() - start
            if args.budget_s is not None and last is not None and elapsed + last > args.budget_s:
                progress(f"stopping after {n} runs: another would end past --budget-s {args.budget_s:g}")
                break
            t0 = time.perf_counter()
            try:
                records = run_once(sides, chosen, lengths, rounds, results["processes"], progress)
            except SideError as e:
                print(f"error: run {n + 1}: {e}", file=sys.stderr)
                return 2
            last = time.perf_counter() - t0
            results["runs"].append(dict(seconds=round(last, 1), comparisons=verdicts(records, args.threshold)))
            write_json(args.json, results)
    finally:
        shutil.rmtree(base_tree, ignore_errors=True)

    print(f"{device}, base {args.base} ({base_sha[:8]}); {rounds} processes an arm per run; the gate's verdict "
          f"against the base at threshold {args.threshold:.1%}")
    print(f"{'run':<4}{'pair':<20}{'workload':<9}{'method':<10}{'arm':<11}{'base tok/s':>11}{'arm tok/s':>10}"
          f"{'ratio':>7}  {'interval':<15} verdict")
    for n, run in enumerate(results["runs"], 1):
        for c in run["comparisons"]:
            measured = c["ratio"] is not None
            interval = f"[{c['low']:.3f}, {c['high']:.3f}]" if measured else "-"
            print(f"{n:<4}{c['pair']:<20}{c['workload']:<9}{c['method']:<10}{c['arm']:<11}"
                  f"{statistics.median(c['base_tok_s']) if measured else 0:>11.1f}"
                  f"{statistics.median(c['arm_tok_s']) if measured else 0:>10.1f}"
                  f"{c['ratio'] if measured else 0:>7.3f}  {interval:<15} {c['verdict']}")
    print("summary (failing combinations / combinations, per run):")
    for arm in results["arms"][1:]:
        per_run = [sum(c["verdict"] != "ok" for c in run["comparisons"] if c["arm"] == arm) for run in results["runs"]]
        total = [sum(c["arm"] == arm for c in run["comparisons"]) for run in results["runs"]]
        print(f"  {arm:<11} " + ", ".join(f"{f}/{t}" for f, t in zip(per_run, total)))
    print(f"process seconds: median {statistics.median(p['seconds'] for p in results['processes']):.1f}, "
          f"total {sum(p['seconds'] for p in results['processes']):.0f}; results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
