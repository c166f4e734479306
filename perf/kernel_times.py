"""Time each Triton kernel against its PyTorch reference at real shapes on a GPU: microseconds per call on random
inputs, each kernel captured in a CUDA graph (launch gaps inside the graph included); a reference too where it
never reads the device on the host, else eagerly (marked "eager": the decode loop never runs those in a graph).

    python -m perf.kernel_times [--json kernel-times.json]

Measurements, not tests: correctness/test_kernel_*.py check that each kernel computes its reference's function;
this prints what each costs (perf/gpu_report.sh runs it).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from engine.errors import Parser


def graph_time_us(fn, reps: int = 50, iters: int = 20) -> float:
    """Microseconds per call of fn: `reps` calls captured in one CUDA graph (after a warm-up on a side stream),
    the graph replayed `iters` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * reps) * 1e6


def eager_time_us(fn, reps: int = 20) -> float:
    """Microseconds per call of fn run eagerly (host reads and launch costs included), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


# References that read device values on the host (ties, a Python heap, lengths, the accepted count): timed eagerly.
EAGER_REFERENCES = ("topk_logprobs", "build_tree", "walk_tree", "compact_kv", "tree_attention", "gated_delta",
                    "causal_conv")


def _fused(gen, bf16) -> list[tuple[str, object, object]]:
    from kernels.fused import (qk_norm_rope_store_reference, qk_norm_rope_store_triton, rmsnorm_reference,
                               rmsnorm_triton, silu_mul_reference, silu_mul_triton)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(bf16)

    N, H, KVH, D, CAP, EPS = 4096, 32, 8, 128, 4096, 1e-6  # Qwen3-8B's attention and hidden width
    cases = []
    for T in (1, 16):
        x, res, w = rand(T, N), rand(T, N), rand(N)
        y, h = torch.empty_like(x), torch.empty_like(x)
        cases.append((f"rmsnorm + residual N={N} T={T}", lambda: rmsnorm_triton(x, w, EPS, res, out=y, h_out=h),
                      lambda: rmsnorm_reference(x, w, EPS, res)))
        qkv, norm = rand(1, T, (H + 2 * KVH) * D), rand(D)
        angles = torch.rand(1, T, D, generator=gen, device="cuda") * 6.28
        cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
        kc, vc = rand(1, KVH, CAP, D), rand(1, KVH, CAP, D)
        slots = torch.arange(1000, 1000 + T, device="cuda")
        args = (qkv, H, KVH, D, norm, norm, EPS, cos, sin, kc, vc, slots)
        q = torch.empty(1, H, T, D, dtype=bf16, device="cuda")
        cases.append((f"qk_norm_rope_store H={H} KVH={KVH} D={D} T={T}",
                      lambda: qk_norm_rope_store_triton(*args, out=q), lambda: qk_norm_rope_store_reference(*args)))
        for inter in (12288, 14336):
            gu = rand(T, 2 * inter)
            act = torch.empty(T, inter, dtype=bf16, device="cuda")
            cases.append((f"silu_mul I={inter} T={T}", lambda: silu_mul_triton(gu, out=act),
                          lambda: silu_mul_reference(gu)))
    return cases


def _tree(gen) -> list[tuple[str, object, object]]:
    from kernels.topk import topk_logprobs_reference, topk_logprobs_triton
    from kernels.tree_ops import (build_tree_reference, build_tree_triton, compact_kv_reference, compact_kv_triton,
                                  walk_tree_reference, walk_tree_triton)

    vocab = 151936  # Qwen3's
    logits = torch.randn(15, vocab, generator=gen, device="cuda")
    cases = [("topk_logprobs [15, 151936] k=8", lambda: topk_logprobs_triton(logits, 8),
              lambda: topk_logprobs_reference(logits, 8))]
    logp, ids = topk_logprobs_triton(logits, 8)
    for budget in (15, 32, 64):
        cases.append((f"build_tree budget {budget}", lambda b=budget: build_tree_triton(logp, ids, b),
                      lambda b=budget: build_tree_reference(logp, ids, b)))
    tokens, parents, _, _, n_nodes = build_tree_triton(logp, ids, 64)
    posterior = torch.randint(vocab, (65,), generator=gen, device="cuda")
    posterior[0] = tokens[0]  # the first node is accepted, so the walk goes at least one level deep
    cases.append(("walk_tree budget 64", lambda: walk_tree_triton(posterior, tokens, parents, n_nodes, 15),
                  lambda: walk_tree_reference(posterior, tokens, parents, n_nodes, 15)))
    k = torch.randn(36, 1, 8, 4096, 128, generator=gen, device="cuda").to(torch.bfloat16)  # Qwen3-8B's cache
    v = torch.randn_like(k)
    start = torch.tensor(1000, device="cuda")
    path = torch.tensor([0, 2, 3, 9, 17, 30, 41, 50, 63] + [0] * 7, device="cuda")
    for accepted in (1, 9):
        n = torch.tensor(accepted, device="cuda")
        cases.append((f"compact_kv 36x8x4096x128 bf16, {accepted} accepted",
                      lambda n=n: compact_kv_triton(k, v, start, path, n),
                      lambda n=n: compact_kv_reference(k, v, start, path, n)))
    return cases


def _attention(gen, bf16) -> list[tuple[str, object, object]]:
    from kernels.tree_attention import tree_attention_reference, tree_attention_triton

    cases = []
    # Qwen3-8B's attention deep in a long answer; Qwen3.6-27B's gated attention at the perf suite's context length
    for H, KVH, D, cap, at, rows in ((32, 8, 128, 4096, 2000, (1, 16, 65)), (24, 4, 256, 1024, 400, (1, 65))):
        kc = torch.randn(1, KVH, cap, D, generator=gen, device="cuda").to(bf16)
        vc = torch.randn_like(kc)
        start = torch.tensor(at, device="cuda")
        for T in rows:
            q = torch.randn(1, H, T, D, generator=gen, device="cuda").to(bf16)
            mask = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
            cases.append((f"tree_attention H={H} KVH={KVH} D={D} T={T} start={at}",
                          lambda q=q, kc=kc, vc=vc, mask=mask, start=start: tree_attention_triton(q, kc, vc, start,
                                                                                                 mask),
                          lambda q=q, kc=kc, vc=vc, mask=mask, at=at: tree_attention_reference(q, kc, vc, at, mask)))
    return cases


def _gated_delta(gen, bf16) -> list[tuple[str, object, object]]:
    """Qwen3.6-27B's Gated DeltaNet layer (16 key heads, 48 value heads of 128 x 128, conv kernel 4): the conv and the
    recurrence for a decode step, a DFlash chain, a random bushy tree and the tree DDTree-64 builds from synthetic
    acceptance's draft scores (a rank-0 spine with rank-1 branches)."""
    from kernels.gated_delta import (DeltaDims, causal_conv_triton, delta_inputs, gated_delta_triton,
                                     tree_causal_conv_reference, tree_gated_delta_reference, tree_schedule)
    from kernels.tree_ops import build_tree_reference

    dims = DeltaDims(16, 128, 48, 128)
    channels = 2 * 16 * 128 + 48 * 128
    depths = 15
    logp = torch.tensor([-0.15, -2.15, -4.15, -6.15, -8.15, -15.6, -15.7, -15.8]).expand(depths, 8).contiguous()
    _, parents, _, visible, _ = build_tree_reference(logp, torch.arange(8).expand(depths, 8), 64)
    bushy = [-1] + [int(torch.randint(0, i, (1,))) for i in range(1, 65)]
    trees = {"decode": [-1], "chain 16": list(range(-1, 15)), "bushy 65": bushy,
             "ddtree-64 tree": [-1] + parents.tolist()}
    state = torch.randn(1, 48, 128, 128, generator=gen, device="cuda") * 0.1
    A_log = torch.randn(48, generator=gen, device="cuda")
    dt_bias = torch.randn(48, generator=gen, device="cuda")
    weight = torch.randn(channels, 4, generator=gen, device="cuda").to(bf16)
    window = torch.randn(1, channels, 3, generator=gen, device="cuda").to(bf16)
    cases = []
    for name, tree in trees.items():
        T = len(tree)
        par = torch.tensor(tree, device="cuda")
        mask = torch.eye(T, dtype=torch.bool, device="cuda")
        for i in range(1, T):
            if tree[i] >= 0:
                mask[i] |= mask[tree[i]]
        sched = tree_schedule(par, mask, T, 4, torch.device("cuda"), max_depth=depths)
        mixed = torch.randn(1, T, channels, generator=gen, device="cuda").to(bf16)
        a, b = (torch.randn(1, T, 48, generator=gen, device="cuda").to(bf16) for _ in range(2))
        out = torch.empty(1, T, 48, 128, dtype=bf16, device="cuda")
        ref_inputs = delta_inputs(mixed, a, b, A_log, dt_bias, dims)
        cases.append((f"gated_delta 27B shape, {name} ({T} rows, {int((sched.lengths > 0).sum())} chains)",
                      lambda m=mixed, a=a, b=b, s=sched, o=out: gated_delta_triton(m, a, b, A_log, dt_bias, dims,
                                                                                 state, s, o, None),
                      lambda r=ref_inputs, p=par: tree_gated_delta_reference(*r, p, state)))
        if name in ("decode", "ddtree-64 tree"):
            cases.append((f"causal_conv 27B shape, {T} rows",
                          lambda m=mixed, s=sched: causal_conv_triton(m, weight, window, s.ancestors),
                          lambda m=mixed, p=par: tree_causal_conv_reference(m, weight, window, p)))
    return cases


def _cross_entropy(gen) -> list[tuple[str, object, object]]:
    from kernels.cross_entropy import cross_entropy_reference, cross_entropy_triton

    logits = (torch.randn(15360, 49152, generator=gen, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(49152, (15360,), generator=gen, device="cuda")

    def step(fn):
        return lambda: fn(logits, labels)[0].sum().backward()
    return [("cross_entropy [15360, 49152] bf16, forward + backward", step(cross_entropy_triton),
             step(cross_entropy_reference))]


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m perf.kernel_times", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the times to this file")
    p.add_argument("--only", metavar="PREFIX", help="only the kernels whose name starts with PREFIX")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: kernel times need a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    rows = []
    cases = _fused(gen, bf16) + _tree(gen) + _attention(gen, bf16) + _gated_delta(gen, bf16) + _cross_entropy(gen)
    for name, kernel, reference in cases:
        if args.only and not name.startswith(args.only):
            continue
        reps = 3 if name.startswith("cross_entropy") else 50
        eager = name.startswith(EAGER_REFERENCES)
        rows.append(dict(kernel=name, triton_us=graph_time_us(kernel, reps=reps),
                         reference_us=eager_time_us(reference) if eager else graph_time_us(reference, reps=reps),
                         reference_timing="eager" if eager else "graph"))
        print(f"{name}: done", file=sys.stderr)
    width = max(len(r["kernel"]) for r in rows)
    print(f"{'kernel':<{width}}  {'Triton us':>10}  {'reference us':>12}")
    for r in rows:
        print(f"{r['kernel']:<{width}}  {r['triton_us']:>10.1f}  {r['reference_us']:>12.1f}"
              + ("  (eager)" if r["reference_timing"] == "eager" else ""))
    if args.json:
        from engine.results import environment, write_json

        write_json(args.json, dict(environment=environment(torch.device("cuda")), times=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
