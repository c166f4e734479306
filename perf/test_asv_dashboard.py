"""The asv history end to end: a real `asv run` of perf/asv_benchmarks on the default pair (fib only), `asv publish`,
then the published dashboard rendered by headless Chromium, which must show the benchmarks and the values the
run recorded. Everything goes to a temporary directory (a copy of asv.conf.json with its paths moved there)."""
from __future__ import annotations

import functools
import http.server
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.workloads import METHODS, pairs
from perf.asv_benchmarks import offline

ROOT = Path(__file__).resolve().parents[1]
BENCH = "decoding.Decode"
PAIRS = tuple(pairs(on_gpu=False))  # the CPU pairs; the GPU-only ones are skipped here
UNITS = {"track_ms_per_token": "ms/token", "track_tau": "tokens/round"}


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _asv(args, cfg: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "asv", *args, "--config", str(cfg)], env=env, cwd=cfg.parent,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"asv {' '.join(args)} exited {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-3000:]}"
    return p


def _render(chromium: str, url: str, home: Path) -> str:
    # virtual time lets the page's XHRs and scripts finish before the DOM is dumped
    p = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--virtual-time-budget=15000", "--dump-dom", url],
                       env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"chromium failed on {url}: {p.stderr[-2000:]}"
    return p.stdout


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(directory: Path) -> str:
        # asv's pages fetch their JSON by XHR, which Chromium refuses for file:// pages
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(directory)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _rows(dom: str) -> dict[str, str]:
    """Benchmark list page: 'name (params)' -> the text of its value cell."""
    rows = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", dom, re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)
        if len(cells) >= 2:
            name = re.sub(r"<[^>]+>", "", cells[0]).strip()
            rows[re.sub(r"\s+", " ", name)] = re.sub(r"<[^>]+>", "", cells[1]).strip()
    return rows


_PERF_SUITE_TAU = """
import sys, torch, engine
from engine.measure import Bench
from engine.workloads import lengths_for, pairs, runs_for
p = pairs(on_gpu=False)[sys.argv[1]]
target = engine.load_target(p.target, "cpu", torch.float32)
bench = Bench(target, engine.load_drafter(p.draft, target), miss_rate=p.miss_rate, **runs_for("cpu"))
print(bench.measure(sys.argv[2], lengths_for("cpu")["short"], sys.argv[3])["tau"])
"""


def _perf_suite_tau(pair: str, workload: str, method: str, env: dict) -> float:
    """tau of one combination as the perf suite measures it on a CPU (its Bench, the registry's length and runs), in
    a process like asv's (the same environment, so the same threads and rounding)."""
    p = subprocess.run([sys.executable, "-c", _PERF_SUITE_TAU, pair, workload, method], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return float(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.cpu
def test_asv_run_publish_and_dashboard(tmp_path, serve):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no headless Chromium: `apt-get install -y chromium` (.ci/install does it)")
    if offline.missing():
        pytest.skip(f"asv's dashboard JS libraries are not in {offline.JS_DIR} (its pages load them from CDNs): "
                    "`python3 -m perf.asv_benchmarks.offline fetch` (.ci/install does it)")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: asv files results under commits")
    head = head.stdout.strip()

    conf = json.loads((ROOT / "asv.conf.json").read_text())
    assert conf["environment_type"] == "existing" and conf["benchmark_dir"] == "perf/asv_benchmarks"
    # HEAD as the branch: CI may check out a detached commit, and publish graphs only commits on a branch
    conf.update(repo=str(ROOT), branches=["HEAD"], benchmark_dir=str(ROOT / conf["benchmark_dir"]),
                env_dir=str(tmp_path / "env"), results_dir=str(tmp_path / "results"), html_dir=str(tmp_path / "html"))
    cfg = tmp_path / "asv.conf.json"
    cfg.write_text(json.dumps(conf))
    model_cache = os.environ.get("ENGINE_CACHE_DIR") or str(Path.home() / ".cache" / "ddtree-engine")
    # HOME: asv keeps its machine file in ~/.asv-machine.json; the model cache stays the real one
    env = {**os.environ, "HOME": str(tmp_path), "ENGINE_CACHE_DIR": model_cache, "ASV_ENGINE_WORKLOADS": "fib"}
    env.pop("ASV_ENGINE_TARGET", None)
    env.pop("ASV_ENGINE_NEW_TOKENS", None)
    env.pop("ASV_ENGINE_SOURCE", None)

    _asv(["machine", "--yes", "--machine", "asv-test"], cfg, env, 60)
    # --set-commit-hash: an "existing" environment saves results only under an explicit commit
    run = _asv(["run", "--set-commit-hash", head, "--machine", "asv-test", "--bench", f"^{BENCH}\\.track_",
                "--show-stderr"], cfg, env, 600)
    results = [p for p in (tmp_path / "results" / "asv-test").glob(f"{head[:8]}-*.json")]
    assert len(results) == 1, f"no results file for {head[:8]}:\n{run.stdout[-4000:]}"
    recorded = json.loads(results[0].read_text())
    column = {c: i for i, c in enumerate(recorded["result_columns"])}
    values = {}
    for name in UNITS:
        entry = recorded["results"][f"{BENCH}.{name}"]
        combos = itertools.product(*entry[column["params"]])  # asv's flattening order
        values[name] = {tuple(v.strip("'") for v in c): x for c, x in zip(combos, entry[column["result"]])}
    for name in UNITS:
        for pair in PAIRS:
            for m in METHODS:
                x = values[name][(pair, "fib", m)]
                assert x is not None and not math.isnan(x) and x > 0, f"{name} {pair}/fib/{m} recorded {x}"
        assert math.isnan(values[name][("default", "json", "ar")])  # outside ASV_ENGINE_WORKLOADS: skipped
    assert values["track_tau"][("default", "fib", "ar")] == 1.0  # AR commits one token per round
    assert values["track_tau"][("default-synthetic", "fib", "ddtree-15")] > 1.0  # the oracle's tokens are accepted
    # asv measures what the perf suite measures (one loop, one registry): the same tau for the same combination
    for pair in PAIRS:
        want = _perf_suite_tau(pair, "fib", "ddtree-15", env)
        assert values["track_tau"][(pair, "fib", "ddtree-15")] == pytest.approx(want, rel=1e-12), pair

    _asv(["publish"], cfg, env, 300)
    offline.vendor(tmp_path / "html")
    url = serve(tmp_path / "html")
    home = tmp_path / "chromium-home"

    grid = _render(chromium, f"{url}/index.html", home)
    assert "continental origin of swallow" not in grid, "the dashboard's scripts did not load"
    for name in UNITS:
        assert f"Decode.{name}" in grid, f"benchmark grid lacks {name}"

    listed = _rows(_render(chromium, f"{url}/index.html#summarylist", home))
    for name, unit in UNITS.items():
        for pair in PAIRS:
            for m in METHODS:
                key = f"{BENCH}.{name} ('{pair}', 'fib', '{m}')"
                assert key in listed, f"benchmark list lacks {key}; it has {sorted(listed)[:8]}..."
                shown = re.fullmatch(rf"([0-9.]+(?:e[+-]?[0-9]+)?) {re.escape(unit)}", listed[key])  # 1.05e+3 too
                assert shown, f"{key} shows {listed[key]!r}, not a value in {unit}"
                # the page shows 3 significant digits of the recorded value
                recorded_value = values[name][(pair, "fib", m)]
                assert float(shown.group(1)) == pytest.approx(recorded_value, rel=6e-3), (key, shown.group(1))

    graph = _render(chromium, f"{url}/index.html#{BENCH}.track_ms_per_token?p-pair='default'&p-workload='fib'", home)
    for m in METHODS:
        assert f"method-{m}; pair-default; workload-fib" in graph, f"the graph page has no series for {m}"


@pytest.mark.cpu
def test_asv_concurrency_benchmarks(monkeypatch):
    """decoding.Concurrency: the c8 sweep per pair and method, checked lossless, as ms per token and tau (a dense
    and a hybrid pair); a pair left out of ASV_ENGINE_PAIRS skips with the reason."""
    from perf.asv_benchmarks import decoding

    monkeypatch.setenv("ASV_ENGINE_PAIRS", "default-synthetic,hybrid-tiny-synthetic")
    monkeypatch.setenv("ASV_ENGINE_NEW_TOKENS", "4")
    bench = decoding.Concurrency()
    results = bench.setup_cache()
    for method in decoding.CONCURRENCY_METHODS:
        for pair in ("default-synthetic", "hybrid-tiny-synthetic"):
            bench.setup(results, pair, method)
            assert bench.track_c8_ms_per_token(results, pair, method) > 0
            assert bench.track_c8_tau(results, pair, method) >= 1
        with pytest.raises(NotImplementedError, match="not in ASV_ENGINE_PAIRS"):
            bench.setup(results, "default", method)
