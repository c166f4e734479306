"""The same-job A/B gate (perf/ab.py): with `--baseline REV`, each selected width x pair x workload x method is
measured on this checkout and on commit REV, alternating fresh processes on the same device, and fails where the head
is slower than the base beyond --ab-threshold with confidence, where tau changed, or where the head is lossy.

    pytest perf -m tp1 --baseline origin/main            # pre-merge selection (engine.workloads.PREMERGE)
    pytest perf -m tp1 --baseline origin/main --ab-full  # every pair, workload and method (nightly)

Without --baseline these tests are deselected; with it, they are the only tests that run.
"""
from __future__ import annotations

import pytest

from engine.launch import visible_gpus
from engine.workloads import GATED_LENGTHS, METHODS, WORKLOADS
from perf.ab import GATE_TEST
from perf.harness import suite_pairs

WIDTHS = [pytest.param(w, marks=getattr(pytest.mark, f"tp{w}"), id=f"tp{w}") for w in (1, 2, 4, 8)]


def pytest_generate_tests(metafunc):
    if "pair" in metafunc.fixturenames:
        metafunc.parametrize("pair", list(suite_pairs(metafunc.config, bool(visible_gpus()))))


@pytest.fixture(scope="session")
def ab_gate(request):
    """The gate, with every selected combination measured (all at once, on first use: the rounds interleave them)."""
    gate = request.config.pluginmanager.get_plugin("perf-ab")
    gate.measure(request.session.items, suite_pairs(request.config, bool(visible_gpus())))
    return gate


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("tp", WIDTHS)
def test_against_base(ab_gate, pair, tp, workload, method):
    for length in GATED_LENGTHS:
        outcome = ab_gate.outcome(tp, pair, workload, length, method)
        if "skip" in outcome:
            pytest.skip(outcome["skip"])
        if "fail" in outcome:
            pytest.fail(outcome["fail"], pytrace=False)
        assert not outcome["problems"], f"{pair}/{workload}/{length}/{method} at tp{tp}: " + "; ".join(
            outcome["problems"])


assert test_against_base.__name__ == GATE_TEST  # the plugin finds its tests by this name
