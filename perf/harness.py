"""The perf suite's side of the measuring loop: one engine.measure.Bench per model pair (one target on the device at a
time, each loaded once when the tests run grouped by pair; references and decoders cached), records labelled with
device, width and telemetry, widths above 1 through one `torchrun -m engine bench --tp N` per pair, and the results
file, rewritten after every record."""
from __future__ import annotations

import gc
import json
import os
import tempfile
from pathlib import Path

import torch

from engine import load_drafter, load_target
from engine.launch import run_torchrun
from engine.measure import Bench
from engine.results import environment, gpu_telemetry, write_json
from engine.workloads import (CONCURRENCY_METHODS, GATED_LENGTHS, HELDOUT_TOKENS, WORKLOADS, lengths_for, pairs,
                              runs_for, user_pair)


def suite_pairs(config, on_gpu: bool) -> dict:
    """The registry's pairs for this machine, and the user's own from --target/--draft."""
    target = config.getoption("target")
    return pairs(on_gpu, user_pair(target, config.getoption("draft")) if target else None)


class Harness:
    def __init__(self, config):
        self.config = config
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.on_gpu else "cpu")
        self.dtype = torch.bfloat16 if self.on_gpu else torch.float32
        telemetry = gpu_telemetry() if self.on_gpu else None
        self.device_name = telemetry["name"] if telemetry else "cpu"
        self.lengths = {name: n for name, n in lengths_for(self.device.type).items() if name in GATED_LENGTHS}
        self.runs = runs_for(self.device.type)
        self.pairs = suite_pairs(config, self.on_gpu)
        self.records: list[dict] = []
        self._targets, self._benches, self._measured = {}, {}, {}
        self._tp_runs: dict[tuple[str, int], dict | AssertionError] = {}  # records, or the run's failure

    def bench(self, pair: str) -> Bench:
        if pair not in self._benches:
            p = self.pairs[pair]
            if p.target not in self._targets:
                self.release()  # the suite's targets need not fit the device together (the 8B and 27B on 80 GB)
                self._targets[p.target] = load_target(p.target, self.device, self.dtype)
            target = self._targets[p.target]
            self._benches[pair] = Bench(target, load_drafter(p.draft, target, weights=p.draft_weights),
                                         miss_rate=p.miss_rate, **self.runs)
        return self._benches[pair]

    def release(self) -> None:
        """Drop the loaded target and its pairs' benches (decoders, caches, CUDA graphs) and give their memory back to
        the device. Measured records stay."""
        if not self._targets:
            return
        self._targets.clear()
        self._benches.clear()
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def _labelled(self, pair: str, record: dict, tp: int = 1, telemetry=None) -> dict:
        return dict(record, device=self.device_name, tp=tp, pair=pair,
                    telemetry=telemetry if telemetry is not None else gpu_telemetry() if self.on_gpu else None)

    def measure(self, pair: str, workload: str, length: str, method: str) -> dict:
        key = (pair, workload, length, method)
        if key not in self._measured:
            record = self.bench(pair).measure(workload, self.lengths[length], method)
            self._record(key, self._labelled(pair, dict(record, length=length)))
        return self._measured[key]

    def measure_heldout(self, pair: str, method: str) -> dict:
        """The held-out set's record (Bench.measure_heldout, HELDOUT_TOKENS new tokens per prompt)."""
        key = (pair, "heldout", str(HELDOUT_TOKENS), method)
        if key not in self._measured:
            self._record(key, self._labelled(pair, self.bench(pair).measure_heldout(method, HELDOUT_TOKENS)))
        return self._measured[key]

    def measure_concurrency(self, pair: str, concurrency: int, length: str, method: str) -> dict:
        """The concurrency sweep's record (engine.measure.sweep: `concurrency` requests at once, the workloads'
        prompts in turn), every method of CONCURRENCY_METHODS measured together. tok_s_median is the aggregate
        tok/s; workload "mix"."""
        key = (pair, "mix", length, method, concurrency)
        if key not in self._measured:
            from engine.measure import sweep

            records = sweep(self.bench(pair), list(CONCURRENCY_METHODS), list(WORKLOADS), self.lengths[length],
                            [concurrency], progress=False)
            for r in records:
                labelled = self._labelled(pair, dict(r, workload="mix", workloads=r["workloads"], length=length,
                                                     tok_s_median=r["aggregate_tok_s"]))
                self._record((pair, "mix", length, r["method"], concurrency), labelled)
        return self._measured[key]

    def _record(self, key, record: dict) -> None:
        self._measured[key] = record
        self.records.append(record)
        self.write_results()  # after every record: a run cut short (timeout, crash) still leaves its results

    def measure_tp(self, pair: str, tp: int, workload: str, length: str, method: str, methods, workloads) -> dict:
        """A record at tensor-parallel width tp > 1: one `torchrun -m engine bench --tp` per (pair, width) measures
        every workload and method (the same Bench inside); its records are reused by the tests that follow."""
        if (pair, tp) not in self._tp_runs:
            try:
                self._tp_runs[(pair, tp)] = self._run_tp_bench(pair, tp, methods, workloads)
            except AssertionError as e:  # every test of this (pair, width) reports the one failed run
                self._tp_runs[(pair, tp)] = e
        run = self._tp_runs[(pair, tp)]
        if isinstance(run, AssertionError):
            raise run
        record = run[(workload, length, method)]
        if record not in self.records:
            self.records.append(record)
            self.write_results()
        return record

    def _run_tp_bench(self, pair: str, tp: int, methods, workloads) -> dict:
        p = self.pairs[pair]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bench.json")
            args = ["-m", "engine", "bench", "--tp", str(tp), "--target", p.target, "--draft", p.draft,
                    "--draft-weights", p.draft_weights, "--methods", ",".join(methods), "--workloads", ",".join(workloads),
                    "--lengths", ",".join(f"{k}={v}" for k, v in self.lengths.items()),
                    "--repeats", str(self.runs["repeats"]), "--warmup", str(self.runs["warmup"]), "--json", out]
            if p.miss_rate is not None:
                args += ["--acceptance", f"synthetic:{p.miss_rate}"]
            run_torchrun(tp, args, timeout=1800)
            with open(out) as f:
                result = json.load(f)
        telemetry = [gpu_telemetry(i) for i in range(tp)]  # NVML, right after the run (no CUDA context here)
        return {(r["workload"], r["length"], r["method"]): self._labelled(pair, r, tp, telemetry)
                for r in result["runs"]}

    def generation(self, pair: str, workload: str, length: str, method: str):
        """A zero-argument call that runs one more generation of a measured combination (for pytest-benchmark,
        which times it on its own clock)."""
        bench = self.bench(pair)
        return lambda: bench.generate(workload, self.lengths[length], method)

    def write_results(self) -> None:
        if not self.records:
            return
        path = self.config.getoption("perf_results")
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        if worker:  # the worker goes into the file's name, never a folder's (runs.v2/perf: runs.v2/perf.gw0)
            p = Path(path)
            path = p.with_name(f"{p.stem}.{worker}{p.suffix}")
        write_json(path, dict(environment=environment(self.device), records=self.records))
