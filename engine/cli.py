"""Command line: `python -m engine generate` and `python -m engine bench`."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from . import workloads
from .decode import METHODS, DecodeSettings, Decoder
from .errors import EngineError, Parser, WeightsTooLarge
from .draft import DRAFT_WEIGHTS
from .loading import DEFAULT_TARGET, load_drafter, load_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"{DEFAULT_TARGET} (embedded default), synthetic:<preset>, an HF directory or a .gguf file")
    p.add_argument("--draft", default="default",
                   help="default, random[:layers], a DFlash draft directory, or none")
    p.add_argument("--draft-weights", default="model", choices=DRAFT_WEIGHTS,
                   help="model: the draft's weights in the target's dtype; int8: every draft projection and a copy of "
                        "the LM head in int8 (half the draft's bytes; the output stays the target's); w8a8: int8 "
                        "weights, and the rows the qkv, gate/up and LM-head GEMMs read quantized to int8 too")
    p.add_argument("--block-size", type=int, default=None, help="tokens per draft block (default: the draft's)")
    p.add_argument("--topk-cap", type=int, default=workloads.TOPK_CAP, help="DDTree: candidates per depth")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda if present)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights (synthetic targets, random drafts)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel width: run under `torchrun --nproc_per_node=N -m engine ... --tp N` "
                        "(NCCL, a GPU per rank; gloo on CPUs); rank 0 prints and writes results")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt greedily")
    _common(g)
    g.add_argument("--method", default="ddtree", choices=METHODS)
    g.add_argument("--budget", type=int, default=15, help="DDTree: draft tree nodes per round")
    g.add_argument("--max-new-tokens", type=int, default=128)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (wrapped in the target's chat template, if it has one)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, used as they are")
    g.add_argument("--no-chat-template", action="store_true", help="tokenize --prompt as plain text")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the target's end-of-sequence tokens")
    g.add_argument("--json", help="write tokens, text, acceptance_lengths, stage_ms and tok_s to this file")

    b = sub.add_parser("bench", help="the workload matrix: tok/s, acceptance length and speed-up per method")
    _common(b)
    b.add_argument("--methods", default=",".join(workloads.METHODS),
                   help="comma-separated: ar, dflash, ddtree-<budget>; with --concurrency also ddtree-auto (a budget per "
                        "concurrency from measured draft and verify costs, engine/budget.py)")
    b.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                   help=f"comma-separated: {', '.join(workloads.WORKLOADS)}, the held-out prompts' names (HELDOUT in "
                        f"engine/workloads.py), or heldout: the whole held-out set")
    gpu, cpu = workloads.lengths_for("cuda"), workloads.lengths_for("cpu")
    b.add_argument("--lengths", default="short,long",
                   help=f"short, long, or NAME=TOKENS entries (short/long: {gpu['short']}/{gpu['long']} new tokens on "
                        f"a GPU, {cpu['short']}/{cpu['long']} on a CPU)")
    gpu_runs, cpu_runs = workloads.runs_for("cuda"), workloads.runs_for("cpu")
    b.add_argument("--repeats", type=int, default=None,
                   help=f"timed runs per combination, median reported (default: {gpu_runs['repeats']} on a GPU, "
                        f"{cpu_runs['repeats']} on a CPU)")
    b.add_argument("--warmup", type=int, default=None,
                   help=f"untimed runs per combination first (default: {gpu_runs['warmup']} on a GPU, "
                        f"{cpu_runs['warmup']} on a CPU)")
    b.add_argument("--stop-at-eos", action="store_true", help="stop at end-of-sequence (default: fixed lengths)")
    b.add_argument("--acceptance", default="real",
                   help="real, or synthetic[:MISS_RATE]: the draft runs, an oracle from the AR output replaces its "
                        "proposals (default miss rate 0.25); results are labelled synthetic")
    b.add_argument("--concurrency", default=None, metavar="C1,C2,...",
                   help="the concurrency sweep instead of the matrix: at each C, C requests at once (the workloads' "
                        "prompts in turn), per method: aggregate and per-request tok/s, time to first token, tau, "
                        "speed-up over AR at the same C; the first length")
    b.add_argument("--hf-baseline", action="store_true",
                   help="also time transformers' greedy generate on the first workload and length")
    b.add_argument("--json", default="bench-results.json", help="result file")

    from .train_draft import TrainSettings

    d = TrainSettings(out="")
    t = sub.add_parser("train-draft", help="train a DFlash draft for a target from the target's greedy answers")
    t.add_argument("--target", default=DEFAULT_TARGET, help="an HF directory, a .gguf file or the default target")
    t.add_argument("--out", required=True, help="run folder: data.pt, checkpoint.pt, draft/ (DFlash format)")
    t.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda if present)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    for f in fields(TrainSettings):
        if f.name != "out":
            value = getattr(d, f.name)
            kind = dict(action=argparse.BooleanOptionalAction) if isinstance(value, bool) else dict(type=type(value))
            t.add_argument(f"--{f.name.replace('_', '-')}", default=value, **kind,
                           help=f"{f.metadata['help']} (default: %(default)s)")
    return parser


def _device_dtype(args, tp_device=None) -> tuple[torch.device, torch.dtype]:
    device = _device(args.device) if tp_device is None else tp_device  # under TP: the local rank's device
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def _device(name: str) -> torch.device:
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise EngineError(f"unknown device {name!r}") from None
        # torch also names devices the engine has no path for (mps, meta, xpu, ...): they would fail mid-load
        if device.type not in ("cpu", "cuda"):
            raise EngineError(f"unsupported device {name!r}: cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError("--device cuda asked for, but this machine has no usable GPU")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise EngineError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def _draft_name(args, target) -> str:
    """The draft as a result names it: the default resolved, int8 weights marked."""
    name = args.draft if args.draft != "default" else f"default ({target.default_draft})"
    return name + {"int8": " (int8 weights)", "w8a8": " (int8 weights and rows)"}.get(args.draft_weights, "")


def _check_sizes(args) -> None:
    if args.block_size is not None and args.block_size < 2:
        raise EngineError(f"block size must be >= 2, got {args.block_size}")
    if args.topk_cap < 1:
        raise EngineError(f"topk_cap must be >= 1, got {args.topk_cap}")


def _parse_ids(text: str) -> list[int]:
    if not text.replace(",", "").strip():
        raise EngineError("--prompt-ids is empty")
    try:
        return [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:  # a word, or an empty entry ("1,,2", a trailing comma)
        raise EngineError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _load(args, tp_device, tp):
    """The target (sharded under tensor parallelism) on this rank's device."""
    from .parallel import shard_target

    device, dtype = _device_dtype(args, tp_device)
    try:
        target = load_target(args.target, device, dtype)
    except WeightsTooLarge as e:
        if tp is None:
            raise
        raise WeightsTooLarge(f"{e} (under tensor parallelism each rank loads the whole model, then keeps its "
                              f"shard)") from None
    if tp is not None:
        shard_target(target.model, tp)
    return target, device, dtype


def cmd_generate(args, tp=None, tp_device=None) -> int:
    from .results import check_writable, write_json

    if args.budget < 0:
        raise EngineError(f"budget must be >= 0, got {args.budget}")
    if args.max_new_tokens < 1:
        raise EngineError(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    _check_sizes(args)
    if args.json:
        check_writable(args.json)
    ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    target, device, dtype = _load(args, tp_device, tp)
    if ids is None:
        text = args.prompt if args.prompt is not None else workloads.PROMPTS["fib"]
        ids = target.encode(text, chat=not args.no_chat_template)
    settings = DecodeSettings(args.method, args.budget, args.topk_cap)
    drafter = (load_drafter(args.draft, target, args.block_size, args.seed, weights=args.draft_weights)
               if settings.speculative else None)
    decoder = Decoder(target.model, drafter, settings)
    stop = () if args.ignore_eos else target.stop_ids
    result = decoder.generate(ids, args.max_new_tokens, stop)
    if tp is not None and tp.rank != 0:
        return 0  # every rank decoded the same tokens; rank 0 reports them
    text = target.decode(result.tokens)
    if text is not None:
        # a stdout that cannot encode the text (a Latin-1 locale, PYTHONIOENCODING=ascii) gets escapes: a traceback
        # here would lose the finished run's tokens and its --json file
        encoding = sys.stdout.encoding or "utf-8"
        print(text.encode(encoding, "backslashreplace").decode(encoding))
    print("tokens:", ",".join(map(str, result.tokens)))
    stages = " ".join(f"{k} {v:.2f}" for k, v in result.stage_ms.items())
    print(f"{args.method}: {len(result.tokens)} tokens, {result.rounds} rounds, tau {result.tau:.2f}, "
          f"{result.tok_s:.1f} tok/s decode, TTFT {result.prefill_s * 1e3:.1f} ms; ms/round: {stages or '-'}",
          file=sys.stderr)
    if args.json:
        write_json(args.json, dict(tokens=result.tokens, text=text, acceptance_lengths=result.acceptance_lengths,
                                   stage_ms=result.stage_ms, tok_s=result.tok_s, tau=result.tau,
                                   ttft_ms=result.prefill_s * 1e3, method=args.method, target=target.name,
                                   draft=args.draft if drafter is not None else None, prompt_ids=ids))
    return 0


def _parse_lengths(text: str, device) -> dict[str, int]:
    defaults, lengths = workloads.lengths_for(device.type), {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        if not name or name in lengths:
            raise EngineError(f"bad length {item!r}: {'a repeated' if name else 'an empty'} name (short, long, or "
                              f"NAME=TOKENS)")
        if eq:
            if not value.isdecimal() or int(value) < 1:
                raise EngineError(f"bad length {item!r}: NAME=TOKENS with TOKENS >= 1")
            lengths[name] = int(value)
        elif name in defaults:
            lengths[name] = defaults[name]
        else:
            raise EngineError(f"unknown length {name!r} (short, long, or NAME=TOKENS)")
    if not lengths:
        raise EngineError("--lengths is empty")
    return lengths


def _parse_acceptance(text: str) -> float | None:
    if text == "real":
        return None
    kind, _, rate = text.partition(":")
    try:
        miss = float(rate) if rate else 0.25
    except ValueError:
        miss = -1.0
    if kind != "synthetic" or not 0.0 <= miss <= 1.0:
        raise EngineError(f"bad --acceptance {text!r}: real, synthetic or synthetic:MISS_RATE with 0 <= MISS_RATE <= 1")
    return miss


def cmd_bench(args, tp=None, tp_device=None) -> int:
    from .bench import device_bandwidth, format_table, hf_generate_tok_s, parse_workloads, summarize, weight_bytes
    from .measure import Bench, Method
    from .results import check_writable, environment

    _check_sizes(args)
    check_writable(args.json)
    device, dtype = _device_dtype(args, tp_device)
    runs = workloads.runs_for(device.type)
    repeats = args.repeats if args.repeats is not None else runs["repeats"]
    warmup = args.warmup if args.warmup is not None else runs["warmup"]
    if repeats < 1 or warmup < 0:
        raise EngineError("--repeats must be >= 1 and --warmup >= 0")
    main_rank = tp is None or tp.rank == 0
    # once each (as --workloads and --concurrency): a repeat would be measured again and reported twice
    methods = list(dict.fromkeys(Method.parse(m, args.topk_cap).name for m in args.methods.split(",") if m))
    if "ar" not in methods:
        methods.insert(0, "ar")  # the reference for losslessness and speed-up
    chosen = parse_workloads(args.workloads)
    lengths = _parse_lengths(args.lengths, device)
    miss_rate = _parse_acceptance(args.acceptance)
    concurrency = _parse_concurrency(args.concurrency) if args.concurrency is not None else None
    if "ddtree-auto" in methods and not concurrency:
        raise EngineError("ddtree-auto picks its budget per concurrency: use it with --concurrency")
    if args.hf_baseline and concurrency:  # the sweep has no transformers column: say so rather than drop the flag
        raise EngineError("--hf-baseline times one request at a time: run it without --concurrency")
    if "ddtree-auto" in methods and tp is not None:
        raise EngineError("ddtree-auto under tensor parallelism is not supported yet (each rank would time its own "
                          "passes; run it at --tp 1)")
    if main_rank:
        print(f"loading {args.target} ..." + (f" (tensor-parallel width {tp.world})" if tp else ""), file=sys.stderr)
    target, device, dtype = _load(args, tp_device, tp)
    needs_draft = any(Method.parse(m).drafts for m in methods)
    drafter = (load_drafter(args.draft, target, args.block_size, args.seed, weights=args.draft_weights)
               if needs_draft else None)
    bench = Bench(target, drafter, warmup=warmup, repeats=repeats, miss_rate=miss_rate, stop_at_eos=args.stop_at_eos,
                  topk_cap=args.topk_cap)
    if concurrency:
        return _bench_sweep(args, bench, methods, chosen, lengths, concurrency, miss_rate, main_rank)
    records = bench.matrix(methods, chosen, lengths, progress=main_rank)  # checks positions and memory first
    if not main_rank:
        return 0 if all(r["lossless"] for r in records) else 1
    bandwidth = device_bandwidth(device)
    roofline = bandwidth / weight_bytes(target.model) if bandwidth else None
    rows = summarize(records, methods, roofline)
    draft_name = _draft_name(args, target)
    acceptance = "real" if miss_rate is None else f"SYNTHETIC (oracle, miss rate {miss_rate})"
    width = f", tensor-parallel width {tp.world} (roofline per rank)" if tp else ""
    print(f"\ntarget {target.name}, draft {draft_name}, {device} {str(dtype).removeprefix('torch.')}{width}, "
          f"lengths {lengths}, workloads {','.join(chosen)}, acceptance {acceptance}")
    # Which tree ran: `python -m` puts the working directory before PYTHONPATH, so an A/B of two copies must start
    # each side in its own tree; this line shows where it did not.
    print(f"code: {Path(__file__).resolve().parent}")
    if roofline:
        print(f"roofline: {bandwidth / 1e12:.2f} TB/s measured copy bandwidth / {weight_bytes(target.model) / 1e9:.2f}"
              f" GB of weights = {roofline:.0f} AR tok/s")
    print(format_table(rows))
    hf = None
    if args.hf_baseline and tp is not None:
        print("transformers generate: not measured under tensor parallelism (run it at --tp 1)")
    elif args.hf_baseline:
        (name, new_tokens), workload = next(iter(lengths.items())), chosen[0]
        hf_tok_s = hf_generate_tok_s(target, workloads.prompt_ids(target, workload), new_tokens)
        hf = dict(workload=workload, length=name, tok_s=hf_tok_s)
        ar = next(r["tok_s"] for r in rows if r["method"] == "ar")
        print(f"transformers generate ({workload}/{name}): {hf['tok_s']:.1f} tok/s; engine AR is "
              f"{ar / hf['tok_s']:.1f}x that")
    return _results(args.json, dict(environment=environment(device), target=target.name, draft=draft_name,
                                    dtype=str(dtype), tp=tp.world if tp else 1, lengths=lengths, acceptance=acceptance,
                                    bandwidth_bytes_s=bandwidth, weight_bytes=weight_bytes(target.model),
                                    roofline_tok_s=roofline, hf_generate=hf, summary=rows, runs=records),
                    all(r["lossless"] for r in rows), "a speculative method diverged from greedy AR output")


def _results(path: str, results: dict, lossless: bool, divergence: str) -> int:
    """Write the results file (atomically); exit 1 where an output was not lossless."""
    from .results import write_json

    write_json(path, results)
    print(f"results: {path}")
    if not lossless:
        print(f"error: {divergence} (see 'exactness' in the results)", file=sys.stderr)
        return 1
    return 0


def _parse_concurrency(text: str) -> list[int]:
    values = [v for v in text.split(",") if v]
    if not values or not all(v.isdecimal() and int(v) >= 1 for v in values):
        raise EngineError(f"bad --concurrency {text!r}: comma-separated request counts >= 1, e.g. 1,2,4,8")
    return sorted({int(v) for v in values})


def _bench_sweep(args, bench, methods, chosen, lengths, concurrency, miss_rate, main_rank: bool = True) -> int:
    from .measure import sweep
    from .results import environment

    target = bench.target
    (length, new_tokens), = list(lengths.items())[:1]
    records = sweep(bench, methods, chosen, new_tokens, concurrency, progress=main_rank)
    if not main_rank:  # every rank decodes; rank 0 reports
        return 0 if all(r["lossless"] for r in records) else 1
    acceptance = "real" if miss_rate is None else f"SYNTHETIC (oracle, miss rate {miss_rate})"
    device = target.model.device
    dtype = str(target.model.dtype).removeprefix('torch.')
    print(f"\ntarget {target.name}, draft {_draft_name(args, target)}, {device} {dtype}, "
          f"{new_tokens} new tokens per request ({length}), prompts {','.join(chosen)} in turn, acceptance "
          f"{acceptance}")
    print(f"{'concurrency':>11} {'method':<16} {'tok/s':>9} {'per request':>11} {'TTFT ms':>8} {'tau':>6} "
          f"{'vs AR':>6}  lossless")
    for r in records:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        method = r["method"] + (f" ({r['budget']})" if "budget" in r else "")
        print(f"{r['concurrency']:>11} {method:<16} {r['aggregate_tok_s']:>9.1f} {r['request_tok_s']:>11.1f} "
              f"{r['ttft_ms']:>8.1f} {r['tau']:>6.2f} {speedup:>6}  {'yes' if r['lossless'] else 'NO'}")
    for r in records:
        if "budget_policy" in r:
            print(f"budget policy at concurrency {r['concurrency']} (model tok/s = c x tau / (draft + verify ms)): "
                  + ", ".join(f"{b}: tau {v['tau']:.2f}, {v['round_ms']:.1f} ms, {v['tok_s']:.0f}"
                              for b, v in r["budget_policy"].items()) + f" -> {r['budget']}")
    return _results(args.json, dict(environment=environment(device), target=target.name,
                                    draft=_draft_name(args, target), dtype=str(target.model.dtype),
                                    length={length: new_tokens}, acceptance=acceptance,
                                    concurrency=concurrency, sweep=records),
                    all(r["lossless"] for r in records), "a request's output diverged from its batch-1 greedy AR output")


def cmd_train_draft(args) -> int:
    from .measure import heldout_acceptance
    from .results import check_writable, write_json
    from .train_draft import TrainSettings, train

    settings = TrainSettings(**{k: getattr(args, k) for k in asdict(TrainSettings(out="")) if k != "out"},
                             out=args.out)
    settings.check(args.resume)  # before the target loads (minutes for a large one)
    if settings.init not in ("", "default") and not Path(settings.init).expanduser().exists():
        raise EngineError(f"--init: draft path {settings.init} does not exist")  # before the target loads
    check_writable(Path(args.out) / "summary.json", "a training run")
    if (Path(args.out) / "checkpoint.pt").exists() and not args.resume:  # before the target loads (minutes for a
        # large one) and writes its prompts; train() refuses the same folder again
        raise EngineError(f"{args.out} already holds a training run: pass --resume to continue it, or another --out")
    device = _device(args.device)
    # the target in the dtype the engine decodes in, for the answers and the held-out check; the draft trains in
    # float32 master weights with bf16 autocast on GPUs
    target = load_target(args.target, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    t0 = time.perf_counter()
    result = train(target, settings, device, resume=args.resume)
    minutes = (time.perf_counter() - t0) / 60
    taus = heldout_acceptance(target, load_drafter(str(result.draft_dir), target), settings.eval_tokens)
    print(f"held-out acceptance ({settings.eval_tokens} new tokens): "
          + ", ".join(f"{k} tau {v:.3f}" for k, v in taus.items()))
    write_json(Path(args.out) / "summary.json", dict(settings=asdict(settings), heldout_tau=taus, minutes=minutes,
                                                     draft=str(result.draft_dir), validation=result.validation))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .parallel import init_tensor_parallel

    args = build_parser().parse_args(argv)
    tp = None
    try:
        if args.command == "train-draft":
            return cmd_train_draft(args)
        tp, tp_device = init_tensor_parallel(args.tp)
        command = cmd_generate if args.command == "generate" else cmd_bench
        return command(args, tp, tp_device)
    except EngineError as e:
        if tp is None or tp.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if tp is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
