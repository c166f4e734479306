"""The floors file: malformed files give one clear error; `record` writes floors from measured results."""
from __future__ import annotations

import json

import pytest

from perf.floors import FloorsError, floor_key, load, main, record

pytestmark = pytest.mark.cpu

ENTRY = dict(device="cpu", tp=1, pair="default", workload="fib", length="short", method="ddtree-15", tok_s=None,
             tau=2.5)


def write(tmp_path, obj, name="floors.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.mark.parametrize("content,mentions", [
    ("{not json", "malformed JSON"),
    ({"version": 2, "floors": []}, "version"),
    ({"version": 1, "floors": [{**ENTRY, "tau": -1}]}, "tau must be a positive finite number"),
    ({"version": 1, "floors": [{k: v for k, v in ENTRY.items() if k != "method"}]}, "missing field 'method'"),
    ({"version": 1, "floors": [ENTRY, ENTRY]}, "duplicate key"),
    ({"version": 1, "floors": [{**ENTRY, "tp": 0}]}, "tp must be a positive integer"),
    ({"version": 1, "floors": [{**ENTRY, "concurrency": "8"}]}, "concurrency must be a positive integer"),
    ({"version": 1, "floors": ["x"]}, "not an object"),
    ({"version": 1, "floors": [{**ENTRY, "pinned": "yes"}]}, "pinned must be true or false"),
    ({"version": 1, "floors": [{**ENTRY, "workload": ["fib"]}]}, "workload must be a string"),
])
def test_malformed_floors(tmp_path, content, mentions):
    with pytest.raises(FloorsError, match=mentions):
        load(write(tmp_path, content))


def test_load_and_missing_file(tmp_path):
    floors = load(write(tmp_path, {"version": 1, "floors": [ENTRY]}))
    assert floors[floor_key("cpu", 1, "default", "fib", "short", "ddtree-15")]["tau"] == 2.5
    assert load(tmp_path / "absent.json") == {}


def results(tmp_path, records):
    base = dict(tp=1, pair="p", workload="fib", length="short", lossless=True, tau=3.0, tok_s_median=100.0)
    return write(tmp_path, {"records": [{**base, **r} for r in records]}, "results.json")


def test_record_writes_margins_and_keeps_other_floors(tmp_path):
    floors_path = write(tmp_path, {"version": 1, "floors": [ENTRY]})
    res = results(tmp_path, [dict(device="NVIDIA H200", method="ar"), dict(device="cpu", method="dflash"),
                             dict(device="cpu", method="ddtree-32", lossless=False),
                             dict(device="NVIDIA H200", workload="heldout", length="128", method="dflash",
                                  tok_s_median=None)])
    assert record([res], floors_path, margin=0.9, tau_margin=0.5) == 3
    floors = load(floors_path)
    heldout = floors[floor_key("NVIDIA H200", 1, "p", "heldout", "128", "dflash")]
    assert heldout["tok_s"] is None and heldout["tau"] == 1.5  # the held-out record gates acceptance only
    gpu = floors[floor_key("NVIDIA H200", 1, "p", "fib", "short", "ar")]
    cpu = floors[floor_key("cpu", 1, "p", "fib", "short", "dflash")]
    assert gpu["tok_s"] == 90.0 and gpu["tau"] == 1.5
    assert cpu["tok_s"] is None and cpu["tau"] == 1.5         # CPU timings are not floors
    assert floor_key("cpu", 1, "p", "fib", "short", "ddtree-32") not in floors  # never from a lossy run
    assert floor_key(*(ENTRY[k] for k in ("device", "tp", "pair", "workload", "length", "method"))) in floors


def test_record_keeps_pinned_floors(tmp_path):
    """A pinned floor is a target: a run that measured less or more leaves it as it is."""
    pinned = {**ENTRY, "pinned": True}
    floors_path = write(tmp_path, {"version": 1, "floors": [pinned]})
    res = results(tmp_path, [dict(device="cpu", pair="default", method="ddtree-15", tau=2.0),
                             dict(device="cpu", pair="default", method="dflash", tau=2.0)])
    assert record([res], floors_path, tau_margin=0.9) == 1
    floors = load(floors_path)
    assert floors[floor_key("cpu", 1, "default", "fib", "short", "ddtree-15")] == pinned
    assert floors[floor_key("cpu", 1, "default", "fib", "short", "dflash")]["tau"] == 1.8


def test_record_cli_errors(tmp_path, capsys):
    assert main(["record", str(write(tmp_path, "[]", "bad.json")), "--floors", str(tmp_path / "f.json")]) == 2
    assert "records" in capsys.readouterr().err
    assert main(["record", str(results(tmp_path, [dict(device="cpu", method="ar")])), "--margin", "1.5",
                 "--floors", str(tmp_path / "f.json")]) == 2
    assert not (tmp_path / "f.json").exists()


def test_record_refuses_a_value_too_large_to_round(tmp_path, capsys):
    """A measured value whose rounding overflows (1e308 x 10**digits) gives no floor: one error, nothing written
    (was an OverflowError traceback)."""
    floors_path = tmp_path / "f.json"
    huge = results(tmp_path, [dict(device="NVIDIA H200", method="ar", tok_s_median=1e308)])
    assert main(["record", str(huge), "--floors", str(floors_path)]) == 2
    assert "gives no positive floor" in capsys.readouterr().err
    assert not floors_path.exists()


@pytest.mark.parametrize("argv", [["record"], ["record", "r.json", "--margin", "q"], ["erase"]])
def test_usage_errors_are_one_line(argv, capsys):
    """A malformed command line is one `error:` line naming the problem, exit code 2 (argparse's default prints
    the usage first)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_floors_path_that_is_a_directory(tmp_path):
    """A floors path that cannot be read is one FloorsError (was an IsADirectoryError traceback)."""
    with pytest.raises(FloorsError, match="unreadable floors file"):
        load(tmp_path)


@pytest.mark.parametrize("field,value,mentions", [
    ("tp", 0, "tp must be a positive integer"),                  # was written, then refused by every later load
    ("concurrency", 0, "concurrency must be a positive integer"),
    ("tp", "x", "tp must be a positive integer"),                 # was a ValueError traceback
    ("workload", ["fib"], "workload must be a string"),           # was a TypeError traceback
])
def test_record_refuses_a_key_the_floors_file_cannot_hold(tmp_path, capsys, field, value, mentions):
    floors_path = tmp_path / "f.json"
    bad = results(tmp_path, [{"device": "cpu", "method": "ar", field: value}])
    assert main(["record", str(bad), "--floors", str(floors_path)]) == 2
    assert mentions in capsys.readouterr().err
    assert not floors_path.exists()


def test_recorded_floors_never_exceed_the_run_they_come_from(tmp_path):
    """At a margin of 1 a floor must still be <= the value it came from: rounding to nearest turned a tau of
    4.7407 into a floor of 4.741, and the H200 run failed its own floors."""
    floors_path = tmp_path / "floors.json"
    taus = (64 / 27, 128 / 27, 4.74074, 5.4468, 2 / 3)
    res = results(tmp_path, [dict(device="NVIDIA H200", method=f"m{i}", tau=t, tok_s_median=t * 1000 + 0.996)
                             for i, t in enumerate(taus)])
    record([res], floors_path, margin=1.0, tau_margin=1.0)
    floors = load(floors_path)
    for i, t in enumerate(taus):
        entry = floors[floor_key("NVIDIA H200", 1, "p", "fib", "short", f"m{i}")]
        assert entry["tau"] <= t and t - entry["tau"] < 1e-3
        assert entry["tok_s"] <= t * 1000 + 0.996


def test_concurrency_keys_floors_apart(tmp_path):
    """The concurrency sweep's records carry their concurrency: recorded under their own key (the field written only
    when it is not 1), and an entry without the field is concurrency 1."""
    floors_path = tmp_path / "floors.json"
    res = results(tmp_path, [dict(device="cpu", method="ar", tau=1.0),
                             dict(device="cpu", method="ar", tau=0.5, concurrency=8)])
    record([res], floors_path, tau_margin=1.0)
    floors = load(floors_path)
    assert floors[floor_key("cpu", 1, "p", "fib", "short", "ar")]["tau"] == 1.0
    assert floors[floor_key("cpu", 1, "p", "fib", "short", "ar", 8)]["tau"] == 0.5
    written = json.loads(floors_path.read_text())["floors"]
    assert sorted(e.get("concurrency", 1) for e in written) == [1, 8] and sum("concurrency" in e for e in written) == 1
