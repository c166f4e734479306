"""Performance floors: a checked-in JSON file of minimum tok/s and acceptance length (tau), keyed by device,
tensor-parallel width, model pair, workload, length and method.

    python -m perf.floors record perf-results.json [more.json ...] --margin 0.9 --tau-margin 0.98

writes or updates the floors from a run's results (perf/floors.json by default; atomic). tok/s floors are kept
for GPUs only (a CPU's timings are not a gate); tau floors hold on CPUs too (greedy decoding is deterministic).
A floor with "pinned": true is a fixed requirement (a target), not a measurement: `record` leaves it as it is.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

FLOORS_PATH = Path(__file__).with_name("floors.json")
KEY_FIELDS = ("device", "tp", "pair", "workload", "length", "method")


class FloorsError(ValueError):
    """A malformed floors or results file."""


def floor_key(device: str, tp: int, pair: str, workload: str, length: str, method: str, concurrency: int = 1
              ) -> tuple:
    """A floor's key. concurrency: requests decoded at once (the concurrency sweep's records); an entry without the
    field is 1."""
    return (device, int(tp), pair, workload, length, method, int(concurrency))


def load(path: Path = FLOORS_PATH) -> dict[tuple, dict]:
    """Floors by key; an absent file means no floors. Any malformation is one FloorsError naming it."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise FloorsError(f"{path}: malformed JSON ({e})") from None
    except OSError as e:  # a directory, an unreadable file: one error, not a traceback
        raise FloorsError(f"{path}: unreadable floors file ({e.strerror or e})") from None
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("floors"), list):
        raise FloorsError(f"{path}: expected {{\"version\": 1, \"floors\": [...]}}")
    floors = {}
    for i, entry in enumerate(data["floors"]):
        where = f"{path}: floors[{i}]"
        if not isinstance(entry, dict):
            raise FloorsError(f"{where}: not an object")
        missing = [f for f in KEY_FIELDS if f not in entry]
        if missing:
            raise FloorsError(f"{where}: missing field {missing[0]!r}")
        for name in ("tok_s", "tau"):
            value = entry.get(name)
            if value is not None and not _positive(value):
                raise FloorsError(f"{where}: {name} must be a positive finite number or null, got {value!r}")
        if not isinstance(entry.get("pinned", False), bool):
            raise FloorsError(f"{where}: pinned must be true or false, got {entry['pinned']!r}")
        key = _key_of(entry, where)
        if key in floors:
            raise FloorsError(f"{where}: duplicate key {key}")
        floors[key] = entry
    return floors


def _key_of(entry: dict, where: str) -> tuple:
    """The floor key of a floors entry or a results record, its fields checked: `record` must not write a key that
    `load` refuses (a tp or concurrency of 0), nor stop on one with a traceback (a list, a string width)."""
    for name in ("device", "pair", "workload", "length", "method"):
        if not isinstance(entry[name], str):
            raise FloorsError(f"{where}: {name} must be a string, got {entry[name]!r}")
    for name in ("tp", "concurrency"):
        value = entry.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FloorsError(f"{where}: {name} must be a positive integer, got {value!r}")
    return floor_key(*(entry[f] for f in KEY_FIELDS), entry.get("concurrency", 1))


def _positive(x) -> bool:
    """A positive finite number (JSON's NaN and Infinity, booleans and strings are not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _round_down(x: float, digits: int) -> float:
    """A floor must not exceed what it was recorded from: round towards zero (round() may go up, and with a margin
    of 1 the very run it came from would fail)."""
    scaled = x * 10 ** digits
    return math.floor(scaled) / 10 ** digits if math.isfinite(scaled) else math.nan  # nan: no floor (1e308 * 100)


def _floor_of(r: dict, field: str, margin: float, digits: int, where: str) -> float:
    """measured * margin, rounded down; one error for a value no floor can come from (zero, NaN, a string)."""
    value = r[field]
    floor = _round_down(value * margin, digits) if _positive(value) else 0.0
    if not floor > 0:
        raise FloorsError(f"{where}: {field} {value!r} gives no positive floor (margin {margin})")
    return floor


def record(result_files: list[Path], floors_path: Path = FLOORS_PATH, margin: float = 0.9,
           tau_margin: float = 0.98) -> int:
    """Write floors from measured results: tok/s floor = measured * margin (GPUs only), tau floor =
    measured * tau_margin. Existing floors for other keys, and pinned ones, are kept. Returns the number of floors
    written."""
    if not 0 < margin <= 1 or not 0 < tau_margin <= 1:
        raise FloorsError(f"margins must be in (0, 1], got --margin {margin} --tau-margin {tau_margin}")
    floors = load(floors_path)
    written = 0
    for path in result_files:
        try:
            results = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise FloorsError(f"{path}: unreadable results ({e})") from None
        records = results.get("records") if isinstance(results, dict) else None
        if not isinstance(records, list):
            raise FloorsError(f"{path}: expected a perf results file with a 'records' list")
        for i, r in enumerate(records):
            where = f"{path}: records[{i}]"
            if not isinstance(r, dict):
                raise FloorsError(f"{where}: not an object")
            if r.get("lossless") is not True:
                continue  # never raise a floor from output that was not right
            missing = [f for f in (*KEY_FIELDS, "tau") if f not in r]
            if missing:
                raise FloorsError(f"{where}: missing field {missing[0]!r}")
            key = _key_of(r, where)
            if floors.get(key, {}).get("pinned"):
                continue  # a target, not a measurement
            timed = r["device"] != "cpu" and r.get("tok_s_median") is not None  # the held-out record has no tok/s
            tok_s = _floor_of(r, "tok_s_median", margin, 2, where) if timed else None
            entry = dict(zip(KEY_FIELDS, key), **({"concurrency": key[-1]} if key[-1] != 1 else {}))
            floors[key] = dict(entry, tok_s=tok_s, tau=_floor_of(r, "tau", tau_margin, 3, where))
            written += 1
    from engine.errors import EngineError
    from engine.results import write_json

    try:
        write_json(floors_path, dict(version=1, floors=sorted(floors.values(),
                                                              key=lambda e: tuple(map(str, e.values())))))
    except EngineError as e:
        raise FloorsError(str(e)) from None
    return written


def main(argv: list[str] | None = None) -> int:
    from engine.errors import Parser

    p = Parser(prog="python -m perf.floors", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="write or update floors from perf results files")
    r.add_argument("results", nargs="+", type=Path)
    r.add_argument("--floors", type=Path, default=FLOORS_PATH)
    r.add_argument("--margin", type=float, default=0.9, help="tok/s floor = measured median * margin")
    r.add_argument("--tau-margin", type=float, default=0.98, help="tau floor = measured tau * tau margin")
    args = p.parse_args(argv)
    try:
        n = record(args.results, args.floors, args.margin, args.tau_margin)
    except FloorsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{n} floors written to {args.floors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
