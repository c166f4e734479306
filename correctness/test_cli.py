"""The command line: generate prints the same tokens for every method; --json and bench write their results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def printed_tokens(stdout: str) -> list[int]:
    line = next(l for l in stdout.splitlines() if l.startswith("tokens:"))
    return [int(t) for t in line.split(":", 1)[1].strip().split(",")]


@pytest.mark.slow
def test_generate_methods_print_the_same_tokens(tmp_path):
    prompt = "Write a Python function that checks whether a number is prime."
    outputs = {}
    for method in ("ar", "dflash", "ddtree"):
        out = tmp_path / f"{method}.json"
        proc = run_cli("generate", "--method", method, "--budget", "15", "--max-new-tokens", "20",
                       "--prompt", prompt, "--device", "cpu", "--json", str(out))
        assert proc.returncode == 0, proc.stderr
        outputs[method] = printed_tokens(proc.stdout)
        result = json.loads(out.read_text())
        assert result["tokens"] == outputs[method]
        assert set(result) >= {"tokens", "text", "acceptance_lengths", "stage_ms", "tok_s"}
        assert sum(result["acceptance_lengths"]) >= len(result["tokens"]) - 1
        assert result["tok_s"] > 0 and result["text"]
    assert outputs["dflash"] == outputs["ar"] and outputs["ddtree"] == outputs["ar"]
    assert len(outputs["ar"]) >= 1


@pytest.mark.slow
def test_generate_with_prompt_ids_and_special_tokens(tmp_path):
    """Token ids straight from the command line, special ids (bos, eos, chat markers) inside the prompt."""
    ids = "1,9690,198,2,2683,359,2,1"
    results = []
    for method in ("ar", "ddtree"):
        proc = run_cli("generate", "--method", method, "--prompt-ids", ids, "--max-new-tokens", "12",
                       "--ignore-eos", "--device", "cpu")
        assert proc.returncode == 0, proc.stderr
        results.append(printed_tokens(proc.stdout))
    assert results[0] == results[1] and len(results[0]) == 12


@pytest.mark.slow
def test_bench_writes_table_and_results(tmp_path, capsys):
    from engine.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "--workloads", "fib,json", "--lengths", "short=6", "--methods", "ar,dflash,ddtree-15",
                 "--warmup", "0", "--device", "cpu", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    for method in ("ar", "dflash", "ddtree-15"):
        assert method in printed
    result = json.loads(out.read_text())
    assert {r["method"] for r in result["summary"]} == {"ar", "dflash", "ddtree-15"}
    assert len(result["runs"]) == 2 * 3
    assert all(r["lossless"] is not False for r in result["runs"])
    assert result["environment"]["torch"]
    ar = next(r for r in result["summary"] if r["method"] == "ar")
    assert ar["speedup_vs_ar"] == pytest.approx(1.0) and ar["tau"] == 1.0


def test_bench_workloads_include_the_held_out_set():
    """`--workloads heldout` is the whole held-out set (the benchmark workloads, then workloads.HELDOUT), in order
    and once each; any of its names works alone; an unknown name is one error that lists the choices."""
    from engine.bench import parse_workloads
    from engine.errors import EngineError
    from engine.workloads import HELDOUT, PROMPTS, heldout_prompts, prompt_ids

    assert parse_workloads("heldout") == list(PROMPTS) + list(HELDOUT) == list(heldout_prompts())
    assert parse_workloads("haiku,fib,heldout")[:3] == ["haiku", "fib", "qsort"]
    assert len(parse_workloads("haiku,fib,heldout")) == len(heldout_prompts())
    with pytest.raises(EngineError, match="unknown workload 'sonnet'.*haiku, or heldout"):
        parse_workloads("fib,sonnet")

    class Bare:  # a target without a tokenizer: seeded random ids per workload name
        tokenizer = None
        model = type("M", (), {"cfg": type("C", (), {"vocab_size": 100})})

    assert prompt_ids(Bare, "haiku") == prompt_ids(Bare, "haiku") != prompt_ids(Bare, "fib")


def test_bench_measures_each_method_once(tmp_path, capsys, tiny_checkpoints):
    """A method named twice (or its budget written with a leading zero) is measured and reported once."""
    from engine.cli import main

    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(path), "--draft", "random:1", "--workloads", "fib", "--lengths", "short=4",
                 "--methods", "dflash,ddtree-4,ddtree-04,dflash", "--device", "cpu", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert [r["method"] for r in result["summary"]] == ["ar", "dflash", "ddtree-4"]
    assert [r["method"] for r in result["runs"]] == ["ar", "dflash", "ddtree-4"]


@pytest.mark.slow
def test_bench_concurrency_sweep_writes_table_and_results(tmp_path, capsys, tiny_checkpoints):
    """`bench --concurrency 1,3`: per concurrency and method one record (aggregate and per-request tok/s, TTFT,
    tau, speed-up over AR at the same concurrency), every request checked against its batch-1 AR output."""
    from engine.cli import main

    path, _ = tiny_checkpoints["qwen3-gqa-untied-sharded"]
    out = tmp_path / "sweep.json"
    code = main(["bench", "--target", str(path), "--draft", "random:1", "--acceptance", "synthetic:0.1",
                 "--workloads", "fib,json", "--lengths", "short=8", "--methods", "ar,dflash,ddtree-4",
                 "--concurrency", "3,1", "--warmup", "0", "--device", "cpu", "--json", str(out)])
    assert code == 0
    assert "concurrency" in capsys.readouterr().out
    sweep = json.loads(out.read_text())["sweep"]
    assert [(r["concurrency"], r["method"]) for r in sweep] == [(c, m) for c in (1, 3)
                                                                 for m in ("ar", "dflash", "ddtree-4")]
    assert all(r["lossless"] and r["aggregate_tok_s"] > 0 for r in sweep)
    assert sweep[3]["workloads"] == ["fib", "json", "fib"]
    assert all(r["speedup_vs_ar"] == pytest.approx(1.0) for r in sweep if r["method"] == "ar")
    assert max(r["tau"] for r in sweep) > 2  # the oracle's proposals are accepted
