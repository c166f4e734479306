"""The calibrated planted slowdown (engine/plant.py): ENGINE_PLANT_SLOWDOWN=F makes decoding take about 1 + F times as
long and changes no token. On a CPU with the hybrid-tiny target (seconds); on a GPU with the default pair, whose
host-bound loop is where a device-only spin would hide."""
from __future__ import annotations

import statistics

import pytest
import torch

from engine import DecodeSettings, Decoder, load_drafter, load_target
from engine.errors import EngineError
from engine.plant import ENV
from engine.workloads import prompt_ids


def _ratios(monkeypatch, decoder, ids, new_tokens, fraction, pairs=5):
    """Planted over clean decode time, from alternating runs (a drifting machine hits both alike); and the tokens."""
    decoder.generate(ids, new_tokens)  # warm-up (graph capture on a GPU, the plant's clock calibration)
    ratios, outputs = [], set()
    for _ in range(pairs):
        runs = []
        for value in ("", str(fraction)):
            monkeypatch.setenv(ENV, value)
            r = decoder.generate(ids, new_tokens)
            runs.append(r.decode_s)
            outputs.add((tuple(r.tokens), tuple(r.acceptance_lengths)))
        ratios.append(runs[1] / runs[0])
    return statistics.median(ratios), outputs


@pytest.mark.cpu
def test_plant_on_cpu_adds_its_fraction(monkeypatch):
    target = load_target("synthetic:hybrid-tiny", torch.device("cpu"), torch.float32)
    decoder = Decoder(target.model)  # AR: the most rounds per token, the same loop as the other methods
    ratio, outputs = _ratios(monkeypatch, decoder, prompt_ids(target, "fib"), 48, 0.5)
    assert len(outputs) == 1, "the plant changed the output"
    assert 1.2 < ratio < 2.0, f"ENGINE_PLANT_SLOWDOWN=0.5 made decoding {ratio:.2f}x as long (expected about 1.5)"


@pytest.mark.cpu
@pytest.mark.parametrize("value", ["-0.1", "fast", "nan"])
def test_bad_plant_value_is_one_error(monkeypatch, value):
    target = load_target("synthetic:hybrid-tiny", torch.device("cpu"), torch.float32)
    monkeypatch.setenv(ENV, value)
    with pytest.raises(EngineError, match=ENV):
        Decoder(target.model).generate(prompt_ids(target, "fib"), 4)


@pytest.mark.gpu
@pytest.mark.slow
def test_plant_on_gpu_adds_its_fraction(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    target = load_target("smollm2-135m", torch.device("cuda"), torch.bfloat16)
    decoder = Decoder(target.model, load_drafter("default", target), DecodeSettings("ddtree", 15))
    ratio, outputs = _ratios(monkeypatch, decoder, prompt_ids(target, "fib"), 256, 0.1, pairs=7)
    assert len(outputs) == 1, "the plant changed the output"
    assert 1.05 < ratio < 1.2, f"ENGINE_PLANT_SLOWDOWN=0.1 made decoding {ratio:.3f}x as long (expected about 1.1)"
