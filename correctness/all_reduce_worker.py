"""One rank of the fused all-reduce + RMSNorm check on GPUs (kernels.all_reduce, engine.parallel):

    torchrun --standalone --nproc_per_node=2 -m correctness.all_reduce_worker OUT.json

Every rank draws its own part, the weight and residual are shared; each call's (y, h) must equal the reference on
every rank's gathered parts (h bit for bit, y within bfloat16 rounding), be the same bits on every rank, and the same
bits as the plain path (the all-reduce, then kernels.fused's rmsnorm kernel). The calls
alternate slots as the engine's do, with random row counts, queued without synchronisation, with a rank made late
(a spin kernel) before some, and replayed from a CUDA graph. Rank 0 writes the findings to OUT.json."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from engine.parallel import MLP_SLOT, ATTENTION_SLOT, Partial, init_tensor_parallel
from kernels.all_reduce import all_reduce_rmsnorm_reference
from kernels.fused import rmsnorm

EPS = 1e-6


def gathered(tp, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(tp.world * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous().view(-1))
    return out.view(tp.world, *x.shape)


def draw(seed: int, rank: int, rows: int, N: int, device):
    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    x = (torch.randn(rows, N, generator=own) * 2).to(device, torch.bfloat16)
    w = torch.randn(N, generator=shared).to(device, torch.bfloat16)
    res = torch.randn(rows, N, generator=shared).to(device, torch.bfloat16)
    return x, w, res


def call(tp, slot, x, w, res):
    """Stage x in `slot` as a row-parallel GEMM would, then the fused all-reduce + norm."""
    part = tp.fused.slot(slot, *x.shape)
    part.copy_(x)
    return tp.all_reduce_rmsnorm(Partial(part, slot, tp), w, EPS, res)


def check(tp, x, w, res, y, h, failures, context):
    want_y, want_h = all_reduce_rmsnorm_reference(gathered(tp, x), w, EPS, res)
    if not torch.equal(h, want_h):
        failures.append(f"{context}: h differs from the reference in {(h != want_h).sum().item()} elements")
    bad = ((y.float() - want_y.float()).abs() > 2 ** -5 + 2 ** -6 * want_y.float().abs()).sum().item()
    if bad:
        failures.append(f"{context}: y differs from the reference beyond bfloat16 rounding in {bad} elements")
    ys = gathered(tp, y)
    if not all(torch.equal(ys[0], ys[r]) for r in range(1, tp.world)):
        failures.append(f"{context}: the ranks' y differ")
    # the plain path (all-reduce, then kernels.fused's rmsnorm), which calls past FUSED_ROWS rows take: the same
    # bits, or a batch's long verify would not reproduce its requests' decode steps
    plain_y, plain_h = rmsnorm(tp.all_reduce(x.clone()), w, EPS, res)
    if not (torch.equal(y, plain_y) and torch.equal(h, plain_h)):
        failures.append(f"{context}: the fused path's bits differ from the plain path's "
                        f"(y in {(y != plain_y).sum().item()} elements, h in {(h != plain_h).sum().item()})")


def main(out_path: str) -> int:
    os.environ["ENGINE_TP_FUSED_NORM"] = "1"  # the path under test (off by default)
    tp, device = init_tensor_parallel(int(os.environ["WORLD_SIZE"]))
    tp.enable_one_shot(device, torch.bfloat16)  # the plain path compared against, as shard_target sets it up
    failures, calls = [], 0
    for N in (4096, 576, 1001):  # 1001: rows not 16-byte aligned, the scalar loads
        tp.fused = None
        tp.enable_fused_norm(device, torch.bfloat16, N)
        if tp.fused is None:
            failures.append(f"N={N}: the fused path was not enabled")
            break
        cap = tp.fused.rows
        # queued: many calls, alternating slots, random rows, no host synchronisation between them; a late rank
        gen = torch.Generator().manual_seed(N)
        results = []
        for i in range(60):
            rows = int(torch.randint(1, cap + 1, (1,), generator=gen)) if i % 3 else 1
            x, w, res = draw(N * 100 + i, tp.rank, rows, N, device)
            if i % 7 == 3 and tp.rank == i % tp.world:
                torch.cuda._sleep(2_000_000)  # this rank arrives late: the others must wait, not read stale parts
            y, h = call(tp, (ATTENTION_SLOT, MLP_SLOT)[i % 2], x, w, res)
            results.append((x, w, res, y, h))
            calls += 1
        torch.cuda.synchronize()
        for i, (x, w, res, y, h) in enumerate(results):
            check(tp, x, w, res, y, h, failures, f"N={N} call {i} ({x.shape[0]} rows)")
        # a CUDA graph of two calls (both slots), replayed with new parts
        x0, w, res = draw(N * 100 + 99, tp.rank, 16, N, device)
        x1 = x0.clone()
        outs = []
        for _ in range(2):  # warm-up outside the capture (compiles the kernel)
            outs = [call(tp, ATTENTION_SLOT, x0, w, res), call(tp, MLP_SLOT, x1, w, res)]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [call(tp, ATTENTION_SLOT, x0, w, res), call(tp, MLP_SLOT, x1, w, res)]
        for j in range(20):
            x0.copy_(draw(N * 100 + 200 + j, tp.rank, 16, N, device)[0])
            x1.copy_(draw(N * 100 + 400 + j, tp.rank, 16, N, device)[0])
            graph.replay()
            calls += 2
            for xi, (y, h) in zip((x0, x1), outs):
                check(tp, xi, w, res, y, h, failures, f"N={N} graph replay {j}")
        torch.cuda.synchronize()
    if tp.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": tp.world, "calls": calls, "failures": failures[:20]}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
