"""The one measuring loop, shared by `python -m engine bench`, the perf suite, the asv benchmarks and train-draft's
held-out check.

For one target and its drafter, a `Bench` measures (workload, new tokens, method) combinations: an untimed AR run
with logit margins is each combination's reference (cached), synthetic acceptance swaps in an oracle built from
it, then `warmup` untimed and `repeats` timed generations give the median, min and max decode tok/s, the mean
acceptance length tau, ms per round per stage and the time to first token, and the first timed run's tokens are
checked against the reference under the exactness rule (docs/design.md, "Exactness"). A record is a plain dict,
as the results files store it.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from .decode import DecodeSettings, Decoder, GenerationResult
from .errors import EngineError
from .exactness import compare_tokens, tolerance_for
from .oracle import OracleDrafter
from .results import sm_clock_mhz
from .workloads import HELDOUT_METHODS, HELDOUT_TOKENS, LENGTHS, TOPK_CAP, heldout_prompts, prompt_ids


AUTO = "ddtree-auto"


@dataclass(frozen=True)
class Method:
    """A named decoding method: `ar`, `dflash` or `ddtree-<budget>`."""
    name: str
    settings: DecodeSettings

    @classmethod
    def parse(cls, name: str, topk_cap: int = TOPK_CAP) -> "Method":
        kind, _, budget = name.partition("-")
        if name == AUTO:  # the concurrency sweep picks its budget per concurrency (engine/budget.py)
            return cls(name, DecodeSettings("ddtree", 15, topk_cap))
        if kind == "ddtree":
            if not budget.isdecimal():
                raise EngineError(f"bad method {name!r}: write ddtree-<budget>, e.g. ddtree-15")
            # named by its budget, so ddtree-015 is ddtree-15 (one record, one floor key)
            return cls(f"ddtree-{int(budget)}", DecodeSettings("ddtree", int(budget), topk_cap))
        if kind in ("ar", "dflash") and not budget:
            return cls(name, DecodeSettings(kind))
        raise EngineError(f"bad method {name!r} (ar, dflash or ddtree-<budget>)")

    @property
    def drafts(self) -> bool:
        return self.settings.method != "ar"


def pooled_tau(records: list[dict]) -> float:
    """Committed tokens over rounds across records: tau weighted by rounds, not a mean of the records' taus."""
    return sum(sum(r["acceptance_lengths"]) for r in records) / max(1, sum(r["rounds"] for r in records))


class Bench:
    """Measures one target with one drafter (None: AR only). miss_rate: synthetic acceptance, the drafter still runs
    every round (its real cost) and an oracle built from the AR reference replaces its proposals."""

    def __init__(self, target, drafter=None, *, warmup: int, repeats: int, miss_rate: float | None = None,
                 stop_at_eos: bool = False, topk_cap: int = TOPK_CAP):
        if repeats < 1 or warmup < 0:
            raise EngineError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
        self.target, self.drafter, self.miss_rate = target, drafter, miss_rate
        self.warmup, self.repeats, self.topk_cap = warmup, repeats, topk_cap
        self.stop = target.stop_ids if stop_at_eos else ()
        self.tolerance = tolerance_for(target.model.dtype)
        self._references: dict[tuple[str, int], GenerationResult] = {}
        self._decoders: dict[str, Decoder] = {}
        self._oracle: OracleDrafter | None = None
        self._reference_decoder = Decoder(target.model)

    @property
    def synthetic(self) -> bool:
        return self.miss_rate is not None and self.drafter is not None

    def reference(self, workload: str, new_tokens: int) -> GenerationResult:
        """Greedy AR with logit margins: what every method's output is checked against."""
        key = (workload, new_tokens)
        if key not in self._references:
            ids = prompt_ids(self.target, workload)
            self._references[key] = self._reference_decoder.generate(ids, new_tokens, self.stop, record_margins=True)
        return self._references[key]

    def _drafter_for(self, length: int):
        """The drafter to decode with; under synthetic acceptance, an oracle with room for `length` tokens (a longer
        request replaces it, and the decoders whose graphs read its buffers)."""
        if not self.synthetic:
            return self.drafter
        if self._oracle is None or self._oracle.max_length < length:
            # room for every known prompt at the GPU's gated length, so the perf suite never rebuilds it
            longest = max(len(prompt_ids(self.target, w)) for w in heldout_prompts())
            room = max(length, longest + LENGTHS["cuda"]["short"])
            self._oracle = OracleDrafter([], self.target.model.cfg.vocab_size, self.drafter.block_size,
                                         miss_rate=self.miss_rate, device=self.target.model.device, cost=self.drafter,
                                         max_length=room)
            self._decoders = {name: d for name, d in self._decoders.items() if d.drafter is None}
        return self._oracle

    def _decoder(self, method: Method, length: int) -> Decoder:
        drafter = self._drafter_for(length) if method.drafts else None
        if method.name not in self._decoders:  # Decoder refuses a drafting method without a drafter
            self._decoders[method.name] = Decoder(self.target.model, drafter, method.settings)
        return self._decoders[method.name]

    def _ready(self, workload: str, new_tokens: int, method: str | Method):
        """(method, decoder, prompt ids, AR reference) of a combination, with the oracle set to that reference."""
        m = method if isinstance(method, Method) else Method.parse(method, self.topk_cap)
        ids = prompt_ids(self.target, workload)
        reference = self.reference(workload, new_tokens)
        decoder = self._decoder(m, len(ids) + new_tokens)
        if m.drafts and self.synthetic:
            self._oracle.set_reference(ids + reference.tokens)
        return m, decoder, ids, reference

    def generate(self, workload: str, new_tokens: int, method: str | Method) -> GenerationResult:
        """One more generation of a combination, untimed here (pytest-benchmark times it on its own clock)."""
        _, decoder, ids, _ = self._ready(workload, new_tokens, method)
        return decoder.generate(ids, new_tokens, self.stop)

    def measure(self, workload: str, new_tokens: int, method: str | Method, on_run=None) -> dict:
        """One combination's record: tok/s median/min/max over the timed runs, tau, acceptance lengths, rounds, median
        ms per round per stage, TTFT, and the exactness verdict against the AR reference."""
        m, decoder, ids, reference = self._ready(workload, new_tokens, method)
        runs, clocks = [], []
        for _ in range(self.warmup + self.repeats):
            runs.append(decoder.generate(ids, new_tokens, self.stop))
            clocks.append(sm_clock_mhz(self.target.model.device))
            if on_run is not None:
                on_run()
        runs, clocks = runs[self.warmup:], clocks[self.warmup:]
        first = runs[0]
        verdict = compare_tokens(reference.tokens, reference.margins, first.tokens, self.tolerance)
        tok_s = [r.tok_s for r in runs]
        return dict(workload=workload, method=m.name, acceptance="synthetic" if m.drafts and self.synthetic else "real",
                    prompt_tokens=len(ids), new_tokens=len(first.tokens), tok_s_median=statistics.median(tok_s),
                    tok_s_min=min(tok_s), tok_s_max=max(tok_s), tau=first.tau, rounds=first.rounds,
                    acceptance_lengths=first.acceptance_lengths,
                    stage_ms={k: statistics.median(r.stage_ms.get(k, 0.0) for r in runs) for k in first.stage_ms},
                    ttft_ms=statistics.median(r.prefill_s for r in runs) * 1e3,
                    sm_clock_mhz=clocks if any(c is not None for c in clocks) else None,
                    lossless=verdict.ok, exactness=verdict.describe())

    def measure_heldout(self, method: str | Method, new_tokens: int = HELDOUT_TOKENS) -> dict:
        """One record for the held-out set (heldout_prompts(), new_tokens each): tau over all its rounds, lossless
        everywhere, tau and tok/s per prompt. It has no tok/s of its own: the workload records gate speed."""
        runs = {w: self.measure(w, new_tokens, method) for w in heldout_prompts()}
        first = next(iter(runs.values()))
        return dict(workload="heldout", length=str(new_tokens), new_tokens=new_tokens, method=first["method"],
                    acceptance=first["acceptance"], tau=pooled_tau(list(runs.values())),
                    lossless=all(r["lossless"] for r in runs.values()),
                    exactness={w: r["exactness"] for w, r in runs.items() if not r["lossless"]},
                    tok_s_median=None,
                    per_prompt={w: dict(tau=r["tau"], tok_s_median=r["tok_s_median"]) for w, r in runs.items()})

    def check(self, methods: list[str], workloads: list[str], lengths: dict[str, int]) -> None:
        """Refuse, before anything runs, a matrix whose longest prompt plus length passes the position limit or whose
        rounds the device's memory cannot hold (Decoder.check_fits, per method)."""
        longest = max(len(prompt_ids(self.target, w)) for w in workloads)
        new_tokens = max(lengths.values())
        self._reference_decoder.check_fits(longest, new_tokens)
        for name in methods:
            self._decoder(Method.parse(name, self.topk_cap), longest + new_tokens).check_fits(longest, new_tokens)

    def matrix(self, methods: list[str], workloads: list[str], lengths: dict[str, int], progress: bool = True
               ) -> list[dict]:
        """Every method on every (workload, length), with a progress bar on stderr; one record each."""
        from tqdm import tqdm

        self.check(methods, workloads, lengths)
        parsed = [Method.parse(m, self.topk_cap) for m in methods]
        total = len(workloads) * len(lengths) * (len(parsed) * (self.repeats + self.warmup) + 1)
        records = []
        with tqdm(total=total, disable=not progress, desc="bench", unit="run", file=sys.stderr) as bar:
            for workload in workloads:
                for length, new_tokens in lengths.items():
                    bar.set_postfix_str(f"{workload}/{length}/reference")
                    self.reference(workload, new_tokens)
                    bar.update()
                    for m in parsed:
                        bar.set_postfix_str(f"{workload}/{length}/{m.name}")
                        records.append(dict(self.measure(workload, new_tokens, m, on_run=bar.update), length=length))
        return records


def sweep(bench: "Bench", methods: list[str], workloads: list[str], new_tokens: int, concurrency: list[int],
          progress: bool = True) -> list[dict]:
    """The concurrency sweep (`bench --concurrency`): at each concurrency c, c requests at once (the workloads'
    prompts in turn) decoded by a BatchDecoder of c rows, per method: aggregate tok/s (every request's tokens over
    the call's wall time, prefills included), median per-request tok/s and time to first token, tau over all
    rounds; every request checked against its batch-1 AR reference. Medians over the timed runs."""
    from tqdm import tqdm

    from .batch import BatchDecoder
    from .budget import BUDGETS, choose_budgets

    parsed = [Method.parse(m, bench.topk_cap) for m in methods]
    ids = {w: prompt_ids(bench.target, w) for w in workloads}
    longest = max(len(p) for p in ids.values())
    drafter = bench._drafter_for(longest + new_tokens)
    # Every method's rows at the largest concurrency, the draft's buffers included, must fit before the reference
    # runs (ddtree-auto at the smallest budget it may pick)
    widest = max(concurrency)
    for m in parsed:
        settings = DecodeSettings("ddtree", min(BUDGETS), bench.topk_cap) if m.name == AUTO else m.settings
        BatchDecoder(bench.target.model, drafter if m.drafts else None, settings, rows=widest).check_fits(
            [ids[workloads[i % len(workloads)]] for i in range(widest)], new_tokens)
    for w in workloads:
        bench.reference(w, new_tokens)
    policy = {}
    if any(m.name == AUTO for m in parsed):
        policy = choose_budgets(bench, workloads, new_tokens, concurrency)
        drafter = bench._drafter_for(longest + new_tokens)  # the policy's oracle may have replaced it
    if bench.synthetic:
        for w in workloads:
            drafter.add_reference(ids[w], bench.reference(w, new_tokens).tokens)
    records = []
    total = len(concurrency) * len(parsed) * (bench.warmup + bench.repeats)
    with tqdm(total=total, disable=not progress, desc="sweep", unit="run", file=sys.stderr) as bar:
        for c in concurrency:
            names = [workloads[i % len(workloads)] for i in range(c)]
            prompts = [ids[w] for w in names]
            for m in parsed:
                bar.set_postfix_str(f"c{c}/{m.name}")
                settings = m.settings
                if m.name == AUTO:
                    settings = DecodeSettings("ddtree", policy[c].budget, bench.topk_cap)
                decoder = BatchDecoder(bench.target.model, drafter if m.drafts else None, settings, rows=c)
                runs = []
                for _ in range(bench.warmup + bench.repeats):
                    t0 = time.perf_counter()
                    results = decoder.generate(prompts, new_tokens, bench.stop)
                    runs.append((time.perf_counter() - t0, results))
                    bar.update()
                runs = runs[bench.warmup:]
                verdicts = [compare_tokens(bench.reference(w, new_tokens).tokens, bench.reference(w, new_tokens).margins,
                                           r.tokens, bench.tolerance) for w, r in zip(names, runs[0][1])]
                first = runs[0][1]
                records.append(dict(
                    concurrency=c, method=m.name, workloads=names, new_tokens=new_tokens,
                    acceptance="synthetic" if m.drafts and bench.synthetic else "real",
                    aggregate_tok_s=statistics.median(sum(len(r.tokens) for r in rs) / s for s, rs in runs),
                    request_tok_s=statistics.median(statistics.median(r.tok_s for r in rs) for _, rs in runs),
                    ttft_ms=statistics.median(statistics.median(r.prefill_s for r in rs) for _, rs in runs) * 1e3,
                    tau=sum(sum(r.acceptance_lengths) for r in first) / max(1, sum(r.rounds for r in first)),
                    stage_ms={k: statistics.median(rs[0].stage_ms.get(k, 0.0) for _, rs in runs)
                              for k in first[0].stage_ms},
                    lossless=all(v.ok for v in verdicts),
                    exactness=next((v.describe() for v in verdicts if not v.ok), verdicts[0].describe()),
                    **(dict(budget=policy[c].budget, budget_policy=policy[c].table) if m.name == AUTO else {})))
    ar = {r["concurrency"]: r["aggregate_tok_s"] for r in records if r["method"] == "ar"}
    for r in records:
        r["speedup_vs_ar"] = r["aggregate_tok_s"] / ar[r["concurrency"]] if r["concurrency"] in ar else None
    return records


def heldout_acceptance(target, drafter, new_tokens: int = HELDOUT_TOKENS, methods=HELDOUT_METHODS
                       ) -> dict[str, float]:
    """tau per method over the held-out set (`bench --workloads heldout`; train-draft's summary), every output
    checked against AR; one run each and no warm-up, since only the acceptance counts here."""
    bench = Bench(target, drafter, warmup=0, repeats=1)
    taus = {}
    for method in methods:
        record = bench.measure_heldout(method, new_tokens)
        if not record["lossless"]:
            raise EngineError(f"held-out check: {method} diverged from AR: {record['exactness']}")
        taus[method] = record["tau"]
    return taus
