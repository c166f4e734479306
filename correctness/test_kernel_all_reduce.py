"""kernels.all_reduce: the one-shot all-reduce fused with the residual add and RMSNorm (tensor parallelism on GPUs).

CPU: the reference is the sum in rank order followed by kernels.fused's RMSNorm reference; the PTX reads aligned
peer rows 16 bytes at a time; the engine's plumbing of the fused path runs at width 1 with the kernel emulated by the
reference. GPU (two or more GPUs):
correctness/all_reduce_worker.py under torchrun, whose calls alternate slots as the engine's do, with random row
counts, queued without synchronisation, a late rank, and CUDA-graph replays: every result equals the reference on the
gathered parts, the same bits on every rank. (The engine's lossless runs at width 2 use it in every layer.)"""
from __future__ import annotations

import json

import pytest
import torch

from engine.launch import run_torchrun, visible_gpus
from kernels.all_reduce import all_reduce_rmsnorm_reference
from kernels.fused import rmsnorm_reference


def test_reference_is_the_rank_ordered_sum_then_the_norm():
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(3, 5, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, generator=gen).to(torch.bfloat16)
    res = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    y, h = all_reduce_rmsnorm_reference(parts, w, 1e-6, res)
    total = (parts[0].float() + parts[1].float() + parts[2].float()).to(torch.bfloat16)
    want_y, want_h = rmsnorm_reference(total, w, 1e-6, res)
    assert torch.equal(h, want_h) and torch.equal(y, want_y)
    assert torch.equal(h, total + res)  # one rounding of the sum, one of the add


@pytest.mark.gpu
@pytest.mark.tp2
def test_gpu_fused_all_reduce_rmsnorm_matches_reference(tmp_path):
    if len(visible_gpus()) < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path / "all_reduce.json"
    run_torchrun(2, ["-m", "correctness.all_reduce_worker", str(out)], timeout=600)
    result = json.loads(out.read_text())
    assert result["calls"] >= 300, result
    assert not result["failures"], "\n".join(result["failures"])


def test_fused_norm_switch_is_off_by_default_and_checked(monkeypatch):
    from engine.errors import EngineError
    from engine.parallel import TensorParallel

    tp = TensorParallel(0, 2)
    monkeypatch.delenv("ENGINE_TP_FUSED_NORM", raising=False)
    tp.enable_fused_norm(torch.device("cpu"), torch.bfloat16, 64)
    assert tp.fused is None  # off by default (and never on a CPU)
    monkeypatch.setenv("ENGINE_TP_FUSED_NORM", "yes")
    with pytest.raises(EngineError, match="ENGINE_TP_FUSED_NORM"):
        tp.enable_fused_norm(torch.device("cpu"), torch.bfloat16, 64)


@pytest.mark.cpu
@pytest.mark.parametrize("aligned", [True, False])
def test_peer_rows_are_read_16_bytes_at_a_time_when_aligned(aligned):
    """The peers' rows come through pointers read from memory, whose alignment Triton cannot see: without the ALIGNED
    hint every element was its own 2-byte NVLink load (the kernel as first measured). Compiled for the H200 with the
    argument specialisation a launch at the 8B's width gets (16-divisible pointers, sizes and strides)."""
    triton = pytest.importorskip("triton")
    import inspect
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.all_reduce import _all_reduce_rmsnorm_kernel as kernel

    names = list(inspect.signature(kernel.fn).parameters)
    constexprs = dict(WORLD=2, HAS_RES=True, BLOCK=4096, SOFT_RNE=False, ALIGNED=aligned)
    types = dict(bufs_ptr="*i64", pads_ptr="*i64", offset="i64", res_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16",
                 h_ptr="*bf16", eps="fp32")
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    divisible = ("bufs_ptr", "pads_ptr", "res_ptr", "w_ptr", "y_ptr", "h_ptr", "offset", "N", "s_res", "s_y", "s_h")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
    peer_loads = re.findall(r"ld\.volatile\.global\.(\S+)", ptx)
    assert peer_loads, "no volatile loads of the peers' rows"
    if aligned:
        assert set(peer_loads) == {"v4.b32"}, peer_loads
    else:
        assert set(peer_loads) == {"b16"}, peer_loads  # the hint is what vectorizes them


def test_engine_fused_path_emulated_on_a_cpu(tiny_checkpoints, tmp_path, monkeypatch):
    """The engine's plumbing of the fused path on a CPU at width 1, the kernel emulated by its reference reading the
    slot it is given: o_proj and down_proj return Partials in alternating slots, the norms after them finish them, a
    captured layer reduces a copy, calls past the slot's rows take the plain path. The logits, the captured features
    and AR's tokens equal the unsharded model's."""
    import torch.distributed as dist

    import engine
    import kernels.all_reduce as all_reduce_module
    from engine.exactness import compare_tokens, tolerance_for
    from engine.parallel import ATTENTION_SLOT, MLP_SLOT, FusedBuffer, TensorParallel, shard_target

    spec = str(tiny_checkpoints["llama-gqa-untied"][0])
    full = engine.load_target(spec, "cpu", torch.float32).model
    ids = list(range(3, 16))  # 13 rows: more than the slot's 8, the plain path
    short = ids[:6]  # 6 rows: the fused path

    def features(model, tokens):
        n = len(tokens)
        cache = model.new_cache(64)
        hidden, feats = model(torch.tensor([tokens]), torch.arange(n)[None], cache,
                              torch.ones(n, n, dtype=torch.bool).tril(), capture=(0, 1))
        return model.logits(hidden[0]), feats

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        tp = TensorParallel(0, 1)
        model = engine.load_target(spec, "cpu", torch.float32).model
        shard_target(model, tp)
        assert tp.fused is None  # a CPU: the plain path unless emulated
        rows, hidden = 8, model.cfg.hidden_size
        tp.fused = FusedBuffer(torch.full((2 * rows * hidden,), float("nan")), None, None, rows)
        slots = []

        def emulated(buffer_ptrs, signal_pads, rank, offset, part, weight, eps, residual=None):
            assert tp.fused.buffer[offset:].data_ptr() == part.data_ptr(), "the part is not at its slot's offset"
            slots.append(offset // (rows * hidden))
            return all_reduce_rmsnorm_reference(part.unsqueeze(0), weight, eps, residual)

        monkeypatch.setattr(all_reduce_module, "all_reduce_rmsnorm_triton", emulated)
        for tokens, fused in ((short, True), (ids, False)):
            slots.clear()
            (got, got_feats), (want, want_feats) = features(model, tokens), features(full, tokens)
            assert bool(slots) == fused, (len(tokens), slots)
            assert slots == [ATTENTION_SLOT, MLP_SLOT] * (len(slots) // 2)
            scale = max(1.0, want.abs().max().item())
            assert (got - want).abs().max().item() <= 1e-4 * scale
            assert (got_feats - want_feats).abs().max().item() <= 1e-4 * max(1.0, want_feats.abs().max().item())
        want_ar = engine.Decoder(full).generate(ids, 12, record_margins=True)
        slots.clear()
        got_ar = engine.Decoder(model).generate(ids, 12)
        assert slots, "AR's one-row steps should take the fused path"
        verdict = compare_tokens(want_ar.tokens, want_ar.margins, got_ar.tokens, tolerance_for(torch.float32))
        assert verdict.ok, verdict.describe()
    finally:
        dist.destroy_process_group()
