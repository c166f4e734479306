"""The same-job A/B gate: `pytest perf -m tp1 --baseline REV` measures the base commit REV and this checkout (the
head, uncommitted changes included) in one job on one device, and fails a combination whose head is slower than the
base beyond a threshold with confidence, whose acceptance length changed, or whose output is not lossless.

How: REV is exported (`git archive`) to a temporary tree. Each selected (width, pair) is measured by the bench CLI
(`engine bench --json`), from the head's tree and from the base's alternately, in fresh processes whose working
directory and PYTHONPATH are their tree: in each round one process per side runs every width-1 pair in turn (the
engine imported once), and each wider pair runs in its own torchrun. Rounds are ordered head-base, base-head,
head-base, ... so that a drift over the job (clocks, temperature) favours neither side. Both sides go through the
bench CLI, so any commit whose `engine.cli.main` runs `bench` and writes `runs` records can be the base.

Statistics (judge, ratio_interval): one sample per side and round, the process's median tok/s over its timed runs
(the noise that matters is between processes: memory placement, clocks, compilation). head/base is estimated by
Hodges-Lehmann, the median of all pairwise differences of log tok/s, with Moses' distribution-free interval from the
exact Mann-Whitney distribution: each bound is at one-sided confidence CONFIDENCE (the two together a 90% interval).
The samples are treated as unpaired: with n rounds a side, the smallest attainable tail is 1 / C(2n, n) instead of
the signed-rank test's 1 / 2^n, so 3 rounds suffice (5 on a GPU). A combination fails when the interval's upper
bound is below 1 - threshold: slower beyond the threshold with 95% confidence. tau (deterministic on one device)
must be equal on every run of both sides unless --ab-allow-tau-change.

The pre-merge selection (engine.workloads.PREMERGE) is the default; --ab-full measures every pair, workload and
method the suite knows (nightly). `-k` and `-m` narrow either. docs/testing.md, "Gating a change".
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import pytest

from engine.launch import visible_gpus
from engine.loading import cache_root
from engine.workloads import GATED_LENGTHS, in_premerge, lengths_for

ROOT = Path(__file__).resolve().parents[1]
GATE_TEST = "test_against_base"  # perf/test_baseline.py
CONFIDENCE = 0.95
ROUNDS = {"cuda": 5, "cpu": 3}
RUNS = dict(warmup=1, repeats=3)  # per process: one sample is the median of 3 timed runs after a warm-up
TIMEOUT_S = 1800  # one bench process (the full matrix of the 27B pair is the longest)


def add_options(parser) -> None:
    g = parser.getgroup("perf")
    g.addoption("--baseline", metavar="REV", help="A/B gate: measure git revision REV (e.g. origin/main) and this "
                "checkout in this job, interleaved, and fail where the head is slower, changes tau or is lossy")
    g.addoption("--ab-full", action="store_true",
                help="A/B: every pair, workload and method (nightly) instead of the pre-merge selection")
    g.addoption("--ab-threshold", type=float, default=0.03,
                help="A/B: fail where head/base tok/s is below 1 - THRESHOLD with confidence (default 0.03)")
    g.addoption("--ab-allow-tau-change", action="store_true", help="A/B: report, do not fail, a changed tau")
    g.addoption("--ab-rounds", type=int, default=None,
                help=f"A/B: processes per side and (width, pair) (default {ROUNDS['cuda']} on a GPU, "
                     f"{ROUNDS['cpu']} on a CPU; at least {min_rounds()})")
    g.addoption("--ab-results", default="perf-ab-results.json", help="A/B results file (written atomically)")
    g.addoption("--ab-head-env", action="append", default=[], metavar="KEY=VALUE",
                help="A/B: set this variable for the head's processes only, e.g. ENGINE_PLANT_SLOWDOWN=0.05 to "
                     "measure the gate's power")


# --- statistics -------------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _u_counts(n: int, m: int) -> tuple[int, ...]:
    """How many of the C(n+m, n) equally likely orderings (no change) give each Mann-Whitney U, the number of
    (x, y) pairs with x > y, for n x's and m y's: the largest value is an x (beating all m y's) or a y."""
    if n == 0 or m == 0:
        return (1,)
    counts = [0] * (n * m + 1)
    for u, c in enumerate(_u_counts(n - 1, m)):
        counts[u + m] += c
    for u, c in enumerate(_u_counts(n, m - 1)):
        counts[u] += c
    return tuple(counts)


def _depth(n: int, m: int, confidence: float) -> int:
    """The largest k with P(U < k) <= 1 - confidence: the k-th smallest (largest) pairwise difference bounds the
    shift from below (above) at that one-sided confidence. 0: too few samples for it."""
    counts, total = _u_counts(n, m), math.comb(n + m, n)
    k, tail = 0, 0
    while k < len(counts) and (tail + counts[k]) / total <= 1 - confidence:
        tail += counts[k]
        k += 1
    return k


def min_rounds(confidence: float = CONFIDENCE) -> int:
    return next(n for n in range(1, 100) if _depth(n, n, confidence) > 0)


def ratio_interval(head: list[float], base: list[float], confidence: float = CONFIDENCE
                   ) -> tuple[float, float, float]:
    """head/base of positive samples (tok/s): the Hodges-Lehmann estimate and the interval whose bounds each hold at
    one-sided `confidence` (0 and inf where the samples are too few)."""
    diffs = sorted(math.log(h) - math.log(b) for h in head for b in base)
    k = _depth(len(head), len(base), confidence)
    estimate = math.exp(statistics.median(diffs))
    if k == 0:
        return estimate, 0.0, math.inf
    return estimate, math.exp(diffs[k - 1]), math.exp(diffs[-k])


def judge(head: list[dict], base: list[dict], threshold: float, allow_tau_change: bool = False) -> dict:
    """One combination's verdict from its per-round bench records on each side (tok_s_median, tau, lossless,
    exactness): ratio, interval, the problems that fail it and the notes that do not."""
    problems, notes = [], []
    lossy = [r["exactness"] for r in head if not r["lossless"]]
    if lossy:
        problems.append(f"head output diverged from AR: {lossy[0]}")
    if any(not r["lossless"] for r in base):
        notes.append("base output diverged from AR")
    head_tau, base_tau = sorted({round(r["tau"], 9) for r in head}), sorted({round(r["tau"], 9) for r in base})
    if head_tau != base_tau:
        (notes if allow_tau_change else problems).append(
            f"tau changed: base {base_tau}, head {head_tau}" + ("" if allow_tau_change else
                                                              " (--ab-allow-tau-change if intended)"))
    h, b = [r["tok_s_median"] for r in head], [r["tok_s_median"] for r in base]
    ratio = low = high = None
    if h and b and all(x and x > 0 for x in h + b):
        ratio, low, high = ratio_interval(h, b)
        if high < 1 - threshold:
            problems.append(f"head slower: {ratio:.3f}x the base's tok/s, {CONFIDENCE:.0%}-confidence bound "
                            f"{high:.3f} < {1 - threshold:.3f} (head {_fmt(h)}, base {_fmt(b)})")
        elif low > 1 + threshold:
            notes.append(f"head faster: {ratio:.3f}x")
    else:
        problems.append(f"no tok/s to compare (head {h}, base {b})")
    clocks = [c for r in head + base for c in (r.get("sm_clock_mhz") or []) if c]
    if clocks and min(clocks) < 0.95 * max(clocks):  # a slow process may be a slow clock (docs/performance.md)
        notes.append(f"SM clock after the timed runs ranged {min(clocks)}-{max(clocks)} MHz")
    verdict = ("ok" if not problems else "LOSSY" if lossy else "SLOWER" if any("slower" in p for p in problems)
               else "TAU" if head_tau != base_tau else "FAIL")
    return dict(verdict=verdict, ratio=ratio, low=low, high=high, problems=problems, notes=notes,
                head_tok_s=h, base_tok_s=b, head_tau=head_tau, base_tau=base_tau)


def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.1f}" for x in xs) + "]"


# --- running the sides ------------------------------------------------------------------------------------------

class SideError(Exception):
    """A bench process that gave no results. usage: it exited 2, the engine's bad-input code (e.g. a base that does
    not know this pair's preset)."""

    def __init__(self, message: str, usage: bool):
        super().__init__(message)
        self.usage = usage


@dataclass
class Side:
    name: str    # "head" or "base"
    root: Path   # the tree its processes import the engine from
    env: dict = field(default_factory=dict)

    def environ(self) -> dict:
        # PYTHONPATH is the tree alone: a caller's entry (this checkout, say) must not shadow the base's engine
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        # Bytecode cached where the gate can write it: on an image that sets PYTHONDONTWRITEBYTECODE or whose
        # site-packages is read-only, every process otherwise compiles ~1,800 modules from source (4.7 s of a 28 s
        # process on the H200 runner). Startup only: tok/s is measured after it.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.setdefault("PYTHONPYCACHEPREFIX", str(cache_root() / "pycache"))
        return dict(env, PYTHONPATH=str(self.root), **self.env)

    def check_import(self) -> None:
        """The editable install maps `engine` to one checkout: make sure this side imports its own tree."""
        code = "import importlib.util as u; print(u.find_spec('engine').origin)"
        out = subprocess.run([sys.executable, "-c", code], cwd=self.root, env=self.environ(), capture_output=True,
                             text=True).stdout.strip()
        if Path(out).resolve() != (self.root / "engine" / "__init__.py").resolve():
            raise SideError(f"the {self.name} side imports the engine from {out or 'nowhere'}, not {self.root}",
                            usage=False)

    def bench(self, requests: list[list[str]], tp: int = 1, timeout: float = TIMEOUT_S) -> list:
        """Run `engine bench REQUEST --json FILE` for each request from this tree in one fresh process: its results
        file, or the SideError of that request. At width 1 the process imports the engine and makes its CUDA context
        once for all requests (every pair of a round); a wider request runs alone under torchrun."""
        if tp > 1 and len(requests) != 1:
            raise ValueError("a tensor-parallel bench process takes one request")
        with tempfile.TemporaryDirectory() as tmp:
            outs = [Path(tmp) / f"bench{i}.json" for i in range(len(requests))]
            codes = Path(tmp) / "exit_codes.json"
            calls = [["bench", *args, "--json", str(out)] for args, out in zip(requests, outs)]
            if tp == 1:
                cmd = [sys.executable, "-c", _RUNNER, json.dumps(calls), str(codes)]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
                       "-m", "engine", *calls[0]]
            with subprocess.Popen(cmd, cwd=self.root, env=self.environ(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True) as p:
                try:
                    log, _ = p.communicate(timeout=timeout * len(requests))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)  # torchrun's ranks too: they share its session
                    log, _ = p.communicate()
                    return [SideError(f"{self.name}: bench did not finish in {timeout * len(requests):.0f} s\n"
                                      f"{log[-3000:]}", usage=False)] * len(requests)
            exits = json.loads(codes.read_text()) if codes.exists() else [p.returncode]
            logs = log.split(_MARK) if tp == 1 else [log]
            results = []
            for i, out in enumerate(outs):
                rc = exits[i] if i < len(exits) else p.returncode
                part = logs[i + 1] if tp == 1 and i + 1 < len(logs) else log
                if rc in (0, 1) and out.exists():  # exit 1 is a lossy method: its results are written, judge() fails it
                    results.append(json.loads(out.read_text()))
                    continue
                errors = [line for line in part.splitlines() if line.startswith("error:")]
                results.append(SideError(f"{self.name}: `engine {' '.join(calls[i])}` exited {rc}: "
                                         f"{errors[-1] if errors else part[-3000:]}", usage=rc == 2))
            return results


_MARK = "\n--- perf.ab: next bench request ---\n"
# One process, several `engine bench` calls (any commit whose engine.cli has main(argv)); each call's exit code is
# written after it, so that a crash leaves the earlier results usable. Memory is handed back between calls.
_RUNNER = f"""
import gc, json, sys
import torch
from engine.cli import main
calls, codes, exits = json.loads(sys.argv[1]), sys.argv[2], []
for call in calls:
    print({_MARK!r}, flush=True)
    try:
        rc = main(call)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    exits.append(rc)
    with open(codes, "w") as f:
        json.dump(exits, f)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
"""


def bench_args(pair, tp: int, workloads: list[str], methods: list[str], lengths: dict[str, int]) -> list[str]:
    """The same request for both sides, every setting explicit, so the base's own defaults do not enter."""
    args = ["--target", pair.target, "--draft", pair.draft, "--methods", ",".join(methods),
            "--workloads", ",".join(workloads), "--lengths", ",".join(f"{k}={v}" for k, v in lengths.items()),
            "--repeats", str(RUNS["repeats"]), "--warmup", str(RUNS["warmup"])]
    if pair.miss_rate is not None:
        args += ["--acceptance", f"synthetic:{pair.miss_rate}"]
    if pair.draft_weights != "model":  # only where it matters: a base older than the flag can run the other pairs
        args += ["--draft-weights", pair.draft_weights]
    if tp > 1:
        args += ["--tp", str(tp)]
    return args


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def export(sha: str) -> Path:
    """The commit's files in a new temporary folder (no .git: its processes import only what it holds)."""
    tree = Path(tempfile.mkdtemp(prefix=f"perf-ab-{sha[:8]}-"))
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", "--format=tar", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        shutil.rmtree(tree, ignore_errors=True)
        raise RuntimeError(f"git archive {sha} failed")
    return tree


# --- the pytest plugin ------------------------------------------------------------------------------------------

class BaselineGate:
    """Registered by perf/conftest.py. Without --baseline it only deselects the gate's tests; with it, it keeps only
    them (the pre-merge selection unless --ab-full), measures every selected combination once when the first of them
    runs, and reports."""

    def __init__(self, config):
        self.config = config
        self.rev = config.getoption("baseline")
        self.results: dict[tuple, dict] = {}     # (tp, pair, workload, length, method) -> judge() plus records
        self.skips: dict[tuple, str] = {}        # (tp, pair) -> why its tests skip
        self.failures: dict[tuple, str] = {}     # (tp, pair) -> why its tests fail
        self.processes: list[dict] = []
        self.measured = False
        self.base_tree: Path | None = None
        if not self.rev:
            return
        self.threshold = config.getoption("ab_threshold")
        self.allow_tau = config.getoption("ab_allow_tau_change")
        if not 0 <= self.threshold < 1:
            raise pytest.UsageError(f"--ab-threshold is a fraction in [0, 1), got {self.threshold}")
        if getattr(config.option, "numprocesses", None):
            raise pytest.UsageError("--baseline measures both sides on one device, one process at a time: run it "
                                    "without -n")
        self.head_env = {}
        for item in config.getoption("ab_head_env"):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise pytest.UsageError(f"--ab-head-env takes KEY=VALUE, got {item!r}")
            self.head_env[key] = value
        try:
            self.base_sha = _git("rev-parse", "--verify", "--quiet", f"{self.rev}^{{commit}}")
            self.head_sha = _git("rev-parse", "HEAD")
            self.head_dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        except (OSError, subprocess.CalledProcessError):
            raise pytest.UsageError(f"--baseline {self.rev}: not a commit of the repository at {ROOT}") from None
        self.device = "cuda" if visible_gpus() else "cpu"
        rounds = config.getoption("ab_rounds")
        self.rounds = rounds if rounds is not None else ROUNDS[self.device]  # 0 is refused below, not the default
        if self.rounds < min_rounds():
            raise pytest.UsageError(f"--ab-rounds {self.rounds}: at least {min_rounds()} rounds are needed for "
                                    f"{CONFIDENCE:.0%} confidence")
        self.lengths = {k: v for k, v in lengths_for(self.device).items() if k in GATED_LENGTHS}
        from engine.results import check_writable
        from engine.errors import EngineError

        try:
            check_writable(config.getoption("ab_results"), "the A/B results (--ab-results)")
        except EngineError as e:
            raise pytest.UsageError(str(e)) from None

    def pytest_report_header(self, config):
        if self.rev:
            dirty = " + uncommitted changes" if self.head_dirty else ""
            env = f", head env {self.head_env}" if self.head_env else ""
            return (f"A/B gate: head {self.head_sha[:8]}{dirty} against --baseline {self.rev} ({self.base_sha[:8]}),"
                    f" {self.rounds} rounds, threshold {self.threshold:.1%}{env}")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            (keep if self._wanted(item) else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def _wanted(self, item) -> bool:
        gate = getattr(item, "originalname", None) == GATE_TEST
        if not self.rev or not gate:
            return gate == bool(self.rev)  # the gate's tests run with --baseline only, and only they do
        if self.config.getoption("ab_full"):
            return True
        p = item.callspec.params
        user = p["pair"].startswith("user:")  # --target/--draft: the pair asked for is measured
        return in_premerge("default" if user else p["pair"], p["workload"], p["method"])

    # measuring

    def measure(self, items, pairs: dict) -> None:
        """Measure every selected gate combination (items: the session's, after selection), once."""
        if self.measured:
            return
        self.measured = True
        groups: dict[tuple[int, str], tuple[list, list]] = {}
        for item in items:
            if getattr(item, "originalname", None) == GATE_TEST:
                p = item.callspec.params
                workloads, methods = groups.setdefault((p["tp"], p["pair"]), ([], []))
                for chosen, name in ((workloads, p["workload"]), (methods, p["method"])):
                    if name not in chosen:
                        chosen.append(name)
        gpus = len(visible_gpus())
        for tp, pair in list(groups):
            if tp > 1 and self.device != "cuda":
                self.skips[(tp, pair)] = f"tp{tp}: tensor-parallel A/B runs need {tp} GPUs (NCCL)"
            elif tp > gpus and self.device == "cuda":
                self.skips[(tp, pair)] = f"tp{tp} needs {tp} GPUs; this process sees {gpus}"
            if (tp, pair) in self.skips:
                del groups[(tp, pair)]
        if not groups:
            self._write({})  # the skips, on record
            return
        self.base_tree = export(self.base_sha)
        sides = [Side("head", ROOT, self.head_env), Side("base", self.base_tree)]
        for side in sides:
            side.check_import()
        runs: dict[tuple, dict[str, list[dict]]] = {}
        # a process per side and round: every width-1 pair in one, each wider pair in its own torchrun
        batches = [[key for key in groups if key[0] == 1]] + [[key] for key in groups if key[0] > 1]
        batches = [b for b in batches if b]
        self._progress(f"A/B: {len(groups)} (width, pair) groups in {len(batches)} fresh processes a side x "
                       f"{self.rounds} rounds x 2 sides")
        for r in range(self.rounds):
            for batch in batches:
                for side in sides if r % 2 == 0 else sides[::-1]:  # head-base, base-head, ...
                    todo = [key for key in batch if key not in self.skips and key not in self.failures]
                    if todo:
                        self._run(side, r, [(key, pairs[key[1]], *groups[key]) for key in todo], runs)
                        self._write(runs)
        for key, by_side in runs.items():
            if (key[0], key[1]) not in self.skips and (key[0], key[1]) not in self.failures:
                self.results[key] = dict(judge(by_side["head"], by_side["base"], self.threshold, self.allow_tau),
                                         head_runs=by_side["head"], base_runs=by_side["base"])
        self._write(runs)

    def _run(self, side: Side, r: int, todo: list, runs) -> None:
        """One process of `side` in round r over todo: ((tp, pair), spec, workloads, methods) of one width."""
        tp = todo[0][0][0]
        t0 = time.perf_counter()
        results = side.bench([bench_args(spec, tp, workloads, methods, self.lengths)
                              for _, spec, workloads, methods in todo], tp)
        seconds = time.perf_counter() - t0
        for ((tp, pair), _, workloads, methods), result in zip(todo, results):
            if isinstance(result, SideError):
                if result.usage and side.name == "base":
                    self.skips[(tp, pair)] = f"the base cannot run {pair}: {result}"
                else:
                    self.failures[(tp, pair)] = str(result)
                result = None
            self.processes.append(dict(round=r, side=side.name, tp=tp, pair=pair, seconds=round(seconds, 2),
                                       pairs_in_process=len(todo), ok=result is not None,
                                       environment=result.get("environment") if result else None))
            for record in result["runs"] if result else []:
                if record["workload"] in workloads and record["method"] in methods:  # bench adds AR to every run
                    key = (tp, pair, record["workload"], record["length"], record["method"])
                    runs.setdefault(key, {"head": [], "base": []})[side.name].append(record)
        failed = [key[1] for key, *_ in todo if key in self.failures or key in self.skips]
        self._progress(f"A/B round {r + 1}/{self.rounds}: {side.name} tp{tp} {', '.join(k[1] for k, *_ in todo)} "
                       f"{'FAILED ' + ', '.join(failed) if failed else 'done'} in {seconds:.1f} s")

    def _progress(self, line: str) -> None:
        """A line on the terminal while a test runs (minutes of silence would look like a hang in a CI log)."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(line)

    def _write(self, runs) -> None:
        from engine.results import gpu_telemetry, write_json

        keep = ("tok_s_median", "tok_s_min", "tok_s_max", "tau", "lossless", "exactness", "stage_ms", "sm_clock_mhz")
        comparisons = []
        for key, by_side in runs.items():
            entry = dict(zip(("tp", "pair", "workload", "length", "method"), key))
            entry.update({f"{s}_runs": [{k: r.get(k) for k in keep} for r in by_side[s]] for s in ("head", "base")})
            if key in self.results:
                entry.update({k: v for k, v in self.results[key].items() if not k.endswith("_runs")})
            comparisons.append(entry)
        write_json(self.config.getoption("ab_results"), dict(
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            head=dict(sha=self.head_sha, uncommitted_changes=self.head_dirty, env=self.head_env),
            base=dict(rev=self.rev, sha=self.base_sha), device=self.device, rounds=self.rounds,
            lengths=self.lengths, runs_per_process=RUNS, threshold=self.threshold, confidence=CONFIDENCE,
            statistic="Hodges-Lehmann head/base of per-process median tok/s; Moses interval (exact Mann-Whitney), "
                      "each bound one-sided at the confidence",
            telemetry=gpu_telemetry() if self.device == "cuda" else None,
            skipped={f"tp{k[0]} {k[1]}": v for k, v in self.skips.items()},
            failed={f"tp{k[0]} {k[1]}": v for k, v in self.failures.items()},
            processes=self.processes, comparisons=comparisons))

    def outcome(self, tp: int, pair: str, workload: str, length: str, method: str) -> dict:
        """What the gate test asserts: {"skip": reason}, {"fail": message} or judge()'s verdict."""
        if (tp, pair) in self.skips:
            return {"skip": self.skips[(tp, pair)]}
        if (tp, pair) in self.failures:
            return {"fail": self.failures[(tp, pair)]}
        result = self.results.get((tp, pair, workload, length, method))
        return result if result is not None else {"fail": f"no A/B records for {(tp, pair, workload, length, method)}"}

    # reporting

    def pytest_terminal_summary(self, terminalreporter):
        if not self.results and not self.skips and not self.failures:
            return
        tr = terminalreporter
        tr.section("A/B against the baseline")
        dirty = "+" if self.head_dirty else ""
        tr.write_line(f"head {self.head_sha[:8]}{dirty} vs base {self.rev} ({self.base_sha[:8]}); {self.rounds} "
                      f"processes a side, alternating; head/base of median tok/s: Hodges-Lehmann and the "
                      f"{2 * CONFIDENCE - 1:.0%} Mann-Whitney interval; fails where it lies below "
                      f"{1 - self.threshold:.3f}")
        if self.results:
            tr.write_line(f"{'tp':<3} {'pair':<22} {'workload':<8} {'method':<10} {'base tok/s':>10} "
                          f"{'head tok/s':>10} {'head/base':>9}  {'interval':<15} {'tau base':>8} {'tau head':>8}  "
                          f"verdict")
        for (tp, pair, workload, length, method), r in sorted(self.results.items()):
            interval = f"[{r['low']:.3f}, {r['high']:.3f}]" if r["ratio"] is not None else "-"
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            taus = [", ".join(f"{t:.3f}" for t in r[f"{s}_tau"]) for s in ("base", "head")]
            base, head = (f"{statistics.median(r[k]):.1f}" if r[k] else "-" for k in ("base_tok_s", "head_tok_s"))
            tr.write_line(f"{tp:<3} {pair:<22} {workload:<8} {method:<10} {base:>10} {head:>10} "
                          f"{ratio:>9}  {interval:<15} {taus[0]:>8} {taus[1]:>8}  {r['verdict']}"
                          + "".join(f"; {n}" for n in r["notes"]))
        for (tp, pair), why in {**self.skips, **self.failures}.items():
            tr.write_line(f"tp{tp} {pair}: {why.splitlines()[0]}")
        tr.write_line(f"results: {self.config.getoption('ab_results')}")

    def pytest_unconfigure(self, config):
        if self.base_tree is not None:
            shutil.rmtree(self.base_tree, ignore_errors=True)
