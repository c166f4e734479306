"""The perf harness keeps one target on the device at a time, and the suite runs a pair's tests together.

The GPU pairs' targets (the 8B's 16 GB, the 27B's 54 GB, with their drafts, caches and graphs) need not fit one
device together: loading a pair whose target is not loaded first drops the loaded one. Collection orders the tests by
pair, pairs sharing a target next to each other, so that a run loads each target once.
"""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

from engine.workloads import Pair
from perf import harness as harness_module
from perf.conftest import pytest_collection_modifyitems

pytestmark = pytest.mark.cpu


class FakeTarget:
    pass


class FakeConfig:
    def __init__(self, target=None, draft="default"):
        self.options = {"target": target, "draft": draft, "perf_results": "unused.json"}

    def getoption(self, name):
        return self.options[name]


PAIRS = {"a": Pair("a", "t1", "d"), "a-synthetic": Pair("a-synthetic", "t1", "d", 0.25), "b": Pair("b", "t2", "d")}


@pytest.fixture
def fake_harness(monkeypatch):
    loads = []

    def load_target(spec, device, dtype):
        loads.append(spec)
        return FakeTarget()

    monkeypatch.setattr(harness_module, "load_target", load_target)
    monkeypatch.setattr(harness_module, "load_drafter", lambda spec, target, weights: ("drafter", spec, weights))
    monkeypatch.setattr(harness_module, "Bench", lambda target, drafter, miss_rate, **runs: SimpleNamespace(
        target=target, miss_rate=miss_rate))
    monkeypatch.setattr(harness_module, "suite_pairs", lambda config, on_gpu: dict(PAIRS))
    h = harness_module.Harness(FakeConfig())
    return h, loads


def test_a_new_target_releases_the_loaded_one(fake_harness):
    h, loads = fake_harness
    first = weakref.ref(h.bench("a").target)
    assert h.bench("a-synthetic").target is first()  # a pair with the same target shares it: no second load
    assert loads == ["t1"]
    second = h.bench("b")
    gc.collect()
    assert first() is None, "the first target is still referenced after the second was loaded"
    assert list(h._targets) == ["t2"] and list(h._benches) == ["b"]
    assert h.bench("b") is second and loads == ["t1", "t2"]
    h.bench("a")  # back to the first target: loaded again (the suite's order makes this not happen)
    assert loads == ["t1", "t2", "t1"] and list(h._targets) == ["t1"]


def test_collection_groups_tests_by_target_then_pair(monkeypatch):
    pairs = {"p1": Pair("p1", "t1", "d"), "p2": Pair("p2", "t2", "d"), "p3": Pair("p3", "t1", "d", 0.25)}
    monkeypatch.setattr(harness_module, "suite_pairs", lambda config, on_gpu: dict(pairs))

    def item(name, pair=None):
        return SimpleNamespace(name=name, callspec=SimpleNamespace(params={} if pair is None else {"pair": pair}))

    items = [item("acc-p1", "p1"), item("acc-p2", "p2"), item("acc-p3", "p3"), item("plain"),
             item("tput-p1", "p1"), item("tput-p2", "p2"), item("tput-p3", "p3"), SimpleNamespace(name="no-callspec")]
    pytest_collection_modifyitems(FakeConfig(), items)
    assert [i.name for i in items] == ["plain", "no-callspec", "acc-p1", "tput-p1", "acc-p3", "tput-p3", "acc-p2",
                                       "tput-p2"]


@pytest.mark.parametrize("given,written", [
    ("perf-results.json", "perf-results.gw1.json"),
    ("runs.v2/perf", "runs.v2/perf.gw1"),            # was runs.gw1.v2/perf: a folder no one asked for
    ("runs.v2/perf.json", "runs.v2/perf.gw1.json"),
])
def test_results_file_per_xdist_worker(tmp_path, monkeypatch, fake_harness, given, written):
    """Under xdist each worker writes NAME.gwN.json beside the file asked for (docs/testing.md, "Results files")."""
    h, _ = fake_harness
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setattr(harness_module, "environment", lambda device: {})
    h.config.options["perf_results"] = given
    h.records.append(dict(method="ar"))
    h.write_results()
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()] == [written]
