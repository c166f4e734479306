"""The A/B gate's machinery (perf/ab.py) on a CPU: the statistics on synthetic samples, the verdicts (slower, tau
changed, lossy), and two real `pytest perf -m tp1 --baseline HEAD` runs on the hybrid-tiny pair in a snapshot of this
checkout (so that head and base are the same code whatever is uncommitted here): an A/A run passes, and a run whose
head alone has a planted slowdown fails with it reported. About a minute and a half on a 2-core CPU."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.launch import visible_gpus
from engine.workloads import PREMERGE, pairs
from perf.ab import _u_counts, judge, min_rounds, ratio_interval

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]


def records(tok_s, tau=3.0, lossless=True):
    return [dict(tok_s_median=x, tau=tau, lossless=lossless, exactness="identical" if lossless else "token 3 differs")
            for x in tok_s]


def noisy(rng, centre, spread, n=5):
    return [centre * math.exp(rng.gauss(0, spread)) for _ in range(n)]


def test_bench_args_name_every_setting_of_the_pair():
    """Both sides get the pair's whole request: its draft weights included (int8 for the int8-draft pair), so the A/B
    measures the pair the floors name."""
    from engine.workloads import PAIRS
    from perf.ab import bench_args

    for pair in PAIRS:
        name, args = pair.name, bench_args(pair, 1, ["fib"], ["ar", "ddtree-15"], {"fib": 64})
        assert args[args.index("--target") + 1] == pair.target and args[args.index("--draft") + 1] == pair.draft
        if pair.draft_weights == "model":
            assert "--draft-weights" not in args, name
        else:
            assert args[args.index("--draft-weights") + 1] == pair.draft_weights, name
    assert any(p.draft_weights != "model" for p in PAIRS)


def test_mann_whitney_counts():
    assert _u_counts(2, 2) == (1, 1, 2, 1, 1)
    for n, m in [(3, 3), (5, 5), (4, 6)]:
        counts = _u_counts(n, m)
        assert sum(counts) == math.comb(n + m, n) and counts == counts[::-1]
    assert min_rounds() == 3  # P(U = 0) = 1/20 with 3 a side: the fewest for 95%


def test_equal_samples_pass():
    base = [100.0, 101.0, 99.0, 100.5, 99.5]
    v = judge(records(base), records(base), threshold=0.03)
    assert v["verdict"] == "ok" and not v["problems"] and v["ratio"] == pytest.approx(1.0)
    assert v["low"] < 1 < v["high"]


def test_processes_at_different_sm_clocks_are_noted_not_failed():
    head, base = records([100.0, 101, 99, 100, 100]), records([100.0, 100, 101, 99, 100])
    for r in head + base:
        r["sm_clock_mhz"] = [1980, 1980, 1980]
    assert not judge(head, base, 0.03)["notes"]
    base[1]["sm_clock_mhz"] = [1500, 1515, 1980]
    v = judge(head, base, 0.03)
    assert v["verdict"] == "ok" and v["notes"] == ["SM clock after the timed runs ranged 1500-1980 MHz"]


def test_five_percent_slower_with_tight_noise_fails():
    rng = random.Random(1)
    v = judge(records(noisy(rng, 95, 0.003)), records(noisy(rng, 100, 0.003)), threshold=0.03)
    assert v["verdict"] == "SLOWER" and v["ratio"] == pytest.approx(0.95, abs=0.01)
    assert "head slower" in v["problems"][0]


def test_within_threshold_or_noisy_is_not_significant():
    rng = random.Random(2)
    small = judge(records(noisy(rng, 98.5, 0.003)), records(noisy(rng, 100, 0.003)), threshold=0.03)
    assert small["verdict"] == "ok" and small["high"] < 1  # slower, surely, but by less than the threshold
    loud = judge(records(noisy(rng, 95, 0.15)), records(noisy(rng, 100, 0.15)), threshold=0.03)
    assert loud["verdict"] == "ok" and loud["high"] > 0.97


def test_interval_bound_holds_its_confidence():
    """A/A with any noise: the upper bound falls below 1 in at most 5% of runs (the bound is distribution-free)."""
    rng = random.Random(3)
    misses = sum(ratio_interval(noisy(rng, 100, 0.05), noisy(rng, 100, 0.05))[2] < 1 for _ in range(2000))
    assert misses / 2000 <= 0.06
    assert ratio_interval([100, 101], [100, 99])[1:] == (0.0, math.inf)  # 2 a side: no 95% bound exists


def test_tau_change_and_lossy_head_fail():
    same = [100.0, 100.2, 99.8]
    changed = judge(records(same, tau=3.1), records(same, tau=3.0), threshold=0.03)
    assert changed["verdict"] == "TAU" and "tau changed: base [3.0], head [3.1]" in changed["problems"][0]
    allowed = judge(records(same, tau=3.1), records(same, tau=3.0), threshold=0.03, allow_tau_change=True)
    assert allowed["verdict"] == "ok" and "tau changed" in allowed["notes"][0]
    unsteady = judge(records(same[:2], tau=3.0) + records(same[2:], tau=3.1), records(same), threshold=0.03)
    assert unsteady["verdict"] == "TAU"  # a tau that moves between runs of one side is not deterministic
    lossy = judge(records(same, lossless=False), records(same), threshold=0.03)
    assert lossy["verdict"] == "LOSSY" and "diverged from AR: token 3 differs" in lossy["problems"][0]
    base_lossy = judge(records(same), records(same, lossless=False), threshold=0.03)
    assert base_lossy["verdict"] == "ok" and base_lossy["notes"] == ["base output diverged from AR"]


def collect(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "perf", "-m", "tp1", "-p", "no:cacheprovider", "-q",
                           "--collect-only", *options], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")})


def test_selection_and_usage_errors():
    """--baseline keeps only the gate's tests, the pre-merge selection (those of its pairs this machine has);
    without it they are deselected; a revision that is not a commit is one usage error."""
    gate = collect("--baseline", "HEAD").stdout
    here = [p for p in PREMERGE if p in pairs(bool(visible_gpus()))]
    assert sorted(line for line in gate.splitlines() if "::" in line) == sorted(
        f"perf/test_baseline.py::test_against_base[{p}-tp1-{w}-{m}]"
        for p in here for w in PREMERGE[p][0] for m in PREMERGE[p][1])
    assert "test_against_base" not in collect("-k", "hybrid-tiny").stdout
    bad = collect("--baseline", "no-such-revision")
    assert bad.returncode == 4 and "--baseline no-such-revision: not a commit" in bad.stderr
    zero = collect("--baseline", "HEAD", "--ab-rounds", "0")  # was silently the default number of rounds
    assert zero.returncode == 4 and "--ab-rounds 0: at least" in zero.stderr


@pytest.fixture
def snapshot(tmp_path_factory):
    """This checkout's files (tracked and untracked, not ignored) committed to a new repository: `--baseline HEAD`
    there compares the same code."""
    repo = tmp_path_factory.mktemp("snapshot")
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=perf", "-c", "user.email=perf@localhost", "commit",
                                                 "-q", "-m", "snapshot"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True)
    return repo


AB_RUNS = {  # name -> options: an A/A run, and one whose head alone runs each round 3x as long (tok/s / 3)
    # The A/A threshold is wide: it checks the mechanics (both sides run, tau equal, a verdict); a CPU shared with
    # other tests times too loosely for 3%. The planted run takes 6 rounds: at 3 a side the interval's bound is the
    # most extreme of the 9 pairs' ratios, and one base process that the other tests on the 2 cores slowed to a third
    # decided it (a CI run: head 43.6 against base 174.6 tok/s, yet a bound of 0.851); at 6 it is the 8th of 36, past
    # the 6 pairs of any one process.
    "a-a": ("--ab-threshold", "0.5", "--ab-rounds", "3"),
    "planted": ("--ab-threshold", "0.2", "--ab-head-env", "ENGINE_PLANT_SLOWDOWN=2", "--ab-rounds", "6"),
}


def test_a_a_passes_and_planted_slowdown_fails(snapshot, tmp_path):
    """Both runs of `pytest perf -m tp1 --baseline HEAD` on hybrid-tiny's fib DDTree-15 in the snapshot, side by side
    (one torch thread per process, so the two share 2 cores without oversubscription; one test, so that pytest-xdist
    cannot start them twice)."""
    # not an xdist worker, and no plant or kernel switch of the caller's on either side
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k not in ("ENGINE_PLANT_SLOWDOWN", "ENGINE_DISABLE_TRITON")}
    env.update(PYTHONPATH=str(snapshot), OMP_NUM_THREADS="1")
    started = {}
    for name, options in AB_RUNS.items():
        cmd = [sys.executable, "-m", "pytest", "perf", "-m", "tp1", "-p", "no:cacheprovider", "-q", "--baseline",
               "HEAD", "--ab-full", "-k", "hybrid-tiny and fib and ddtree-15", "--ab-results",
               str(tmp_path / f"{name}.json"), *options]
        started[name] = subprocess.Popen(cmd, cwd=snapshot, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
    out = {name: proc.communicate(timeout=600)[0] for name, proc in started.items()}
    rc = {name: proc.returncode for name, proc in started.items()}

    assert rc["a-a"] == 0, out["a-a"][-5000:]
    assert "A/B against the baseline" in out["a-a"] and "1 passed" in out["a-a"]
    results = json.loads((tmp_path / "a-a.json").read_text())
    (c,) = results["comparisons"]
    assert (c["pair"], c["workload"], c["method"], c["verdict"]) == ("hybrid-tiny-synthetic", "fib", "ddtree-15", "ok")
    assert len(c["head_tok_s"]) == len(c["base_tok_s"]) == 3 and c["head_tau"] == c["base_tau"]
    assert [p["side"] for p in results["processes"]] == ["head", "base", "base", "head", "head", "base"]
    assert results["base"]["sha"] == results["head"]["sha"] and not results["head"]["uncommitted_changes"]

    assert rc["planted"] == 1, out["planted"][-5000:]
    assert "head slower" in out["planted"] and "SLOWER" in out["planted"]
    (c,) = json.loads((tmp_path / "planted.json").read_text())["comparisons"]
    assert c["verdict"] == "SLOWER" and c["high"] < 0.8 and c["head_tau"] == c["base_tau"]


def test_one_process_runs_several_bench_requests_and_reports_each(tmp_path):
    """Side.bench at width 1: every request in one fresh process, each with its own results or its own error (a
    base that does not know a pair's preset is a usage error of that request alone; the next still runs)."""
    from perf.ab import Side, SideError

    good = ["--target", "synthetic:hybrid-tiny", "--draft", "none", "--methods", "ar", "--workloads", "fib",
            "--lengths", "x=3", "--repeats", "1", "--warmup", "0"]
    bad = [*good[:1], "synthetic:no-such-preset", *good[2:]]
    first, error, last = Side("head", ROOT).bench([good, bad, good])
    assert [r["method"] for r in first["runs"]] == ["ar"] == [r["method"] for r in last["runs"]]
    assert isinstance(error, SideError) and error.usage and "no-such-preset" in str(error)
    assert "exited 2" in str(error) and "error:" in str(error)


def test_gate_power_rotates_arms_and_judges_each_against_the_base(monkeypatch):
    """perf.gate_power: in a run every arm runs one process a round over every pair (as the gate does), in an order
    that rotates, and each arm is judged against the base with the gate's verdict: an A/A arm passes, a planted 10%
    arm fails "head slower"."""
    from perf import gate_power
    from perf.ab import Side

    rng, order = random.Random(3), []
    speed = {"base": 100.0, "head": 100.0, "plant 0.1": 100.0 / 1.1}

    def bench(self, requests, tp):
        order.append(self.name)
        assert tp == 1 and len(requests) == 2  # both pairs in one process
        results = []
        for args in requests:
            workloads = args[args.index("--workloads") + 1].split(",")
            methods = args[args.index("--methods") + 1].split(",")
            results.append({"runs": [dict(workload=w, length="short", method=m, tau=2.5, lossless=True,
                                          exactness="identical", tok_s_median=speed[self.name] * (1 + rng.gauss(0, 0.002)))
                                     for w in workloads for m in dict.fromkeys(["ar", *methods])]})
        return results

    monkeypatch.setattr(Side, "bench", bench)
    sides = gate_power.arms("unused", [0.1])
    cpu_pairs = pairs(False)
    processes = []
    records = gate_power.run_once(sides, {"default": (cpu_pairs["default"], ("fib",), ("dflash", "ddtree-15")),
                                          "default-synthetic": (cpu_pairs["default-synthetic"], ("json",), ("ar",))},
                                  {"short": 32}, 5, processes, lambda line: None)
    assert order == ["base", "head", "plant 0.1", "head", "plant 0.1", "base", "plant 0.1", "base", "head",
                     "base", "head", "plant 0.1", "head", "plant 0.1", "base"]
    assert len(processes) == 15 and set(records) == {("default", "fib", "short", m) for m in ("dflash", "ddtree-15")} | {
        ("default-synthetic", "json", "short", "ar")}
    verdicts = {(v["arm"], v["method"]): v for v in gate_power.verdicts(records, 0.03)}
    assert all(len(r["base"]) == 5 for r in records.values())  # the AR references of a ddtree-only run are dropped
    for m in ("dflash", "ddtree-15"):
        assert verdicts[("head", m)]["verdict"] == "ok"
        assert verdicts[("plant 0.1", m)]["verdict"] == "SLOWER" and 0.89 < verdicts[("plant 0.1", m)]["ratio"] < 0.93


def test_building_a_model_does_not_import_torch_dynamo():
    """Every gate process builds its models on the meta device: with torch.nn.init switched off there (engine.loading
    ._empty), PyTorch's decompositions never run, so torch._dynamo is not imported (1.3 s of a process's start on
    the 2-core CPU; more on the H200 runner, whose image compiles modules from source)."""
    code = ("import sys, torch, engine; t = engine.load_target('synthetic:hybrid-tiny', 'cpu', torch.float32); "
            "engine.load_drafter('random:1', t); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
