"""kernels.all_reduce: the one-shot all-reduce fused with the residual add and RMSNorm (tensor parallelism on GPUs).

CPU: the reference is the sum in rank order followed by kernels.fused's RMSNorm reference. GPU (two or more GPUs):
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
