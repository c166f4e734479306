"""The perf suite's side of the measurement harness: model pairs, cached targets, drafters, decoders and AR
references, one record per (pair, workload, length, method), and the results file. The timing itself is
engine.bench.measure, shared with `python -m engine bench`."""
from __future__ import annotations

import os

import torch

from engine import Decoder, load_drafter, load_target
from engine.bench import Method, measure, pooled_tau, synthetic_drafter
from engine.exactness import tolerance_for
from engine.results import environment, gpu_telemetry, write_json
from engine.workloads import HELDOUT_TOKENS, heldout_prompts, prompt_ids

SYNTHETIC_MISS_RATE = 0.25
CPU_LENGTHS = {"short": 32}
GPU_LENGTHS = {"short": 256}


def pair_specs(config, on_gpu: bool) -> dict[str, tuple[str, str, float | None]]:
    """name -> (target, draft, synthetic miss rate or None for real acceptance)."""
    pairs = {"default": ("smollm2-135m", "default", None),
             "default-synthetic": ("smollm2-135m", "default", SYNTHETIC_MISS_RATE)}
    if on_gpu:
        pairs["qwen3-8b-synthetic"] = ("synthetic:qwen3-8b", "random:5", SYNTHETIC_MISS_RATE)
    if config.getoption("target"):
        target, draft = config.getoption("target"), config.getoption("draft")
        pairs[f"user:{target}|{draft}"] = (target, draft, None)
    return pairs


class Harness:
    def __init__(self, config):
        self.config = config
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.on_gpu else "cpu")
        self.dtype = torch.bfloat16 if self.on_gpu else torch.float32
        telemetry = gpu_telemetry() if self.on_gpu else None
        self.device_name = telemetry["name"] if telemetry else "cpu"
        self.lengths = GPU_LENGTHS if self.on_gpu else CPU_LENGTHS
        self.repeats, self.warmup = (3, 1) if self.on_gpu else (1, 0)
        self.pairs = pair_specs(config, self.on_gpu)
        self.records: list[dict] = []
        self._targets, self._drafters, self._decoders, self._references, self._measured = {}, {}, {}, {}, {}
        self._tp_runs: dict[tuple[str, int], dict | AssertionError] = {}  # records, or the run's failure

    def _target(self, spec: str):
        if spec not in self._targets:
            self._targets[spec] = load_target(spec, self.device, self.dtype)
        return self._targets[spec]

    def _drafter(self, pair: str):
        if pair not in self._drafters:
            target_spec, draft_spec, miss_rate = self.pairs[pair]
            target = self._target(target_spec)
            drafter = load_drafter(draft_spec, target)
            if miss_rate is not None:
                longest = max(len(prompt_ids(target, w)) for w in ("fib", "qsort", "arith", "json"))
                drafter = synthetic_drafter(target, drafter, miss_rate, longest + max(self.lengths.values()))
            self._drafters[pair] = drafter
        return self._drafters[pair]

    def measure(self, pair: str, workload: str, length: str, method: str) -> dict:
        key = (pair, workload, length, method)
        if key not in self._measured:
            record = self._run(pair, workload, self.lengths[length], method)
            record["length"] = length
            self._record(key, record)
        return self._measured[key]

    def measure_heldout(self, pair: str, method: str) -> dict:
        """One record for the held-out set (workloads.heldout_prompts(), HELDOUT_TOKENS new tokens each, as
        train-draft's summary): tau over all its rounds, lossless everywhere, tau and tok/s per prompt."""
        key = (pair, "heldout", str(HELDOUT_TOKENS), method)
        if key not in self._measured:
            runs = {w: self._run(pair, w, HELDOUT_TOKENS, method) for w in heldout_prompts()}
            first = next(iter(runs.values()))
            self._record(key, dict(
                {k: first[k] for k in ("device", "tp", "pair", "method", "acceptance", "telemetry")},
                workload="heldout", length=str(HELDOUT_TOKENS), new_tokens=HELDOUT_TOKENS,
                tau=pooled_tau(list(runs.values())),
                lossless=all(r["lossless"] for r in runs.values()),
                exactness={w: r["exactness"] for w, r in runs.items() if not r["lossless"]},
                tok_s_median=None,  # no tok/s floor here: the section 7 records gate speed
                per_prompt={w: dict(tau=r["tau"], tok_s_median=r["tok_s_median"]) for w, r in runs.items()}))
        return self._measured[key]

    def _run(self, pair: str, workload: str, new_tokens: int, method: str) -> dict:
        target_spec, _, miss_rate = self.pairs[pair]
        target = self._target(target_spec)
        ids = prompt_ids(target, workload)
        ref_key = (target_spec, workload, new_tokens)
        if ref_key not in self._references:
            self._references[ref_key] = Decoder(target.model).generate(ids, new_tokens, record_margins=True)
        reference = self._references[ref_key]
        m = Method.parse(method, topk_cap=8)
        drafter = self._drafter(pair) if m.settings.method != "ar" else None
        if miss_rate is not None and drafter is not None:
            drafter.set_reference(ids + reference.tokens)
        if (pair, method) not in self._decoders:
            self._decoders[(pair, method)] = Decoder(target.model, drafter, m.settings)
        record = measure(self._decoders[(pair, method)], ids, new_tokens, (), reference, self.repeats, self.warmup,
                         tolerance_for(self.dtype))
        record.update(device=self.device_name, tp=1, pair=pair, workload=workload, method=method,
                      acceptance="synthetic" if miss_rate is not None and drafter is not None else "real",
                      telemetry=gpu_telemetry() if self.on_gpu else None)
        return record

    def _record(self, key, record: dict) -> None:
        self._measured[key] = record
        self.records.append(record)
        self.write_results()  # after every record: a run cut short (timeout, crash) still leaves its results

    def measure_tp(self, pair: str, tp: int, workload: str, length: str, method: str, methods, workloads) -> dict:
        """A record at tensor-parallel width tp > 1: one `torchrun -m engine bench --tp` per (pair, width) measures
        every workload and method (the same harness inside); its records are reused by the tests that follow."""
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
        import json
        import tempfile

        from correctness.launch import run_torchrun

        target, draft, miss_rate = self.pairs[pair]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bench.json")
            args = ["-m", "engine", "bench", "--tp", str(tp), "--target", target, "--draft", draft,
                    "--methods", ",".join(methods), "--workloads", ",".join(workloads),
                    "--lengths", ",".join(f"{k}={v}" for k, v in self.lengths.items()),
                    "--repeats", str(self.repeats), "--warmup", str(self.warmup), "--json", out]
            if miss_rate is not None:
                args += ["--acceptance", f"synthetic:{miss_rate}"]
            run_torchrun(tp, args, timeout=1800)
            with open(out) as f:
                result = json.load(f)
        telemetry = [gpu_telemetry(i) for i in range(tp)]  # NVML, right after the run (no CUDA context here)
        records = {}
        for r in result["runs"]:
            r.update(device=self.device_name, tp=tp, pair=pair, telemetry=telemetry)
            records[(r["workload"], r["length"], r["method"])] = r
        return records

    def generation(self, pair: str, workload: str, length: str, method: str):
        """A zero-argument call that runs one generation of an already measured combination (for pytest-benchmark,
        which times it on its own clock)."""
        target = self._target(self.pairs[pair][0])
        ids, new_tokens = prompt_ids(target, workload), self.lengths[length]
        decoder = self._decoders[(pair, method)]
        return lambda: decoder.generate(ids, new_tokens)

    def write_results(self) -> None:
        if not self.records:
            return
        path = self.config.getoption("perf_results")
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        if worker:
            stem, dot, ext = path.rpartition(".")
            path = f"{stem}.{worker}.{ext}" if dot else f"{path}.{worker}"
        write_json(path, dict(environment=environment(self.device), records=self.records))
