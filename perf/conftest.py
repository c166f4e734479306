"""The performance suite's options, one GPU per pytest-xdist worker (chosen through NVML, before anything creates a
CUDA context), the floors file (read once: a malformed one is a single usage error), and the shared harness."""
from __future__ import annotations

import os

import pytest

from engine.launch import visible_gpus
from perf import preflight
from perf.ab import BaselineGate, add_options as add_ab_options
from perf.floors import FLOORS_PATH, FloorsError, load


def pytest_addoption(parser):
    g = parser.getgroup("perf", "performance regression suite")
    g.addoption("--target", default=os.environ.get("PERF_TARGET"),
                help="your own target (HF directory, .gguf, synthetic:<preset>); env PERF_TARGET")
    g.addoption("--draft", default=os.environ.get("PERF_DRAFT", "default"),
                help="draft for --target (DFlash directory, random:N, default); env PERF_DRAFT")
    g.addoption("--require-floors", action="store_true", help="fail, instead of skip, where a floor is missing")
    g.addoption("--floors", default=str(FLOORS_PATH), help="floors file (default perf/floors.json)")
    g.addoption("--perf-results", default="perf-results.json",
                help="results file of this run (under xdist, one per worker: NAME.gwN.json)")
    add_ab_options(parser)  # --baseline REV and the A/B gate's options (perf/ab.py)


def pytest_configure(config):
    from engine.errors import EngineError
    from engine.results import check_writable

    preflight.install(config, "perf")  # broken CUDA on a GPU runner: a usage error at session start
    try:
        config.perf_floors = load(config.getoption("floors"))
        check_writable(config.getoption("perf_results"), "the perf results (--perf-results)")
    except (FloorsError, EngineError) as e:
        raise pytest.UsageError(str(e)) from None
    config.pluginmanager.register(BaselineGate(config), "perf-ab")  # the A/B gate (perf/ab.py)
    # One GPU per xdist worker, chosen before anything creates a CUDA context: `pytest perf -m tp1 -n 8`.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    gpus = visible_gpus()
    if worker and gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus[int(worker.removeprefix("gw")) % len(gpus)])
    if worker and not gpus:
        import torch

        torch.set_num_threads(1)  # CPU workers share the cores: oversubscribed intra-op threads crawl


def pytest_collection_modifyitems(config, items):
    """Run a pair's tests together, and pairs that share a target one after another: the harness keeps one target
    on the device at a time, so each target is then loaded once. The order within a pair is kept."""
    from perf.harness import suite_pairs

    pairs = suite_pairs(config, bool(visible_gpus()))
    targets = list(dict.fromkeys(p.target for p in pairs.values()))
    rank = {name: (targets.index(p.target), i) for i, (name, p) in enumerate(pairs.items())}

    def key(item):
        pair = getattr(getattr(item, "callspec", None), "params", {}).get("pair")
        return rank.get(pair, (-1, -1))

    items.sort(key=key)  # stable: tests without a pair first, in their order


@pytest.fixture(scope="session")
def floors(pytestconfig):
    return pytestconfig.perf_floors


@pytest.fixture(scope="session")
def harness(pytestconfig):
    from perf.harness import Harness

    h = Harness(pytestconfig)
    yield h
    h.write_results()
