"""kernels/gated_delta.py: the tree-safe Gated DeltaNet references against the plain definition on fresh random
trees (chains, stars, deep and bushy trees, padded rows, up to 257 rows): every row's state and output are those of
the delta rule run along its own root-to-row path, its conv those of the inputs along that path, and what commit keeps
(the replayed path, the new conv window) is the last accepted row's. The chain form equals transformers' recurrence.

The Triton kernels against those references on fresh random inputs with poisoned outputs (under the interpreter on
CPU, at the 27B shape on a GPU): the tree recurrence on random trees, its schedule (simulated on the host: every
visited row starts from its parent's state), commit's replay, and the property the decoder relies on: a verified
row's output equals, bit for bit on the GPU, a one-row step from the state replayed along its ancestors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from correctness.kernel_harness import assert_interpreted_ok, run_checks_main
from kernels import gated_delta as gd
from kernels.gated_delta import (ancestor_rows, conv_window, delta_update, replay_gated_delta,
                                 tree_causal_conv_reference, tree_gated_delta_reference)


def random_tree(kind: str, T: int, gen: torch.Generator) -> torch.Tensor:
    """parents [T]: row 0 is the root (-1, the committed state); each other row's parent is an earlier row; "padded"
    trees end in rows whose parent is -1 too (unused budget, as build_tree pads)."""
    if kind == "chain":
        return torch.arange(T) - 1
    if kind == "star":
        return torch.tensor([-1] + [0] * (T - 1))
    parents = [-1]
    for i in range(1, T):
        lo = max(0, i - 3) if kind == "deep" else 0
        parents.append(int(torch.randint(lo, i, (1,), generator=gen)))
    if kind == "padded":
        parents[T - T // 4:] = [-1] * (T // 4)
    return torch.tensor(parents)


def path_to(parents: torch.Tensor, r: int) -> list[int]:
    path = []
    while r >= 0:
        path.append(r)
        r = int(parents[r])
    return path[::-1]


def inputs(gen, B, T, H, dk, dv):
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 2
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


CASES = [(kind, T) for kind in ("chain", "star", "deep", "bushy", "padded") for T in (1, 2, 9, 33)] + \
    [("bushy", 65), ("deep", 129), ("bushy", 257)]


@pytest.mark.parametrize("kind,T", CASES)
def test_tree_recurrence_follows_each_rows_own_path(kind, T):
    gen = torch.Generator().manual_seed(T * 31 + len(kind))
    B, H, dk, dv = 2, 3, 8, 5
    parents = random_tree(kind, T, gen)
    q, k, v, g, beta, state = inputs(gen, B, T, H, dk, dv)
    out = torch.full((B, T, H, dv), float("nan"))
    out[:], last = tree_gated_delta_reference(q, k, v, g, beta, parents, state)
    for r in range(T):
        s = state
        for j in path_to(parents, r):
            s = delta_update(s, k[:, j], v[:, j], g[:, j], beta[:, j])
        torch.testing.assert_close(out[:, r], (s * q[:, r, ..., None]).sum(-2), rtol=1e-5, atol=1e-5)
        if r == T - 1:
            torch.testing.assert_close(last, s, rtol=1e-5, atol=1e-5)
    # what commit keeps: the state replayed along an accepted path is the verify pass's state of its last row
    leaf = int(torch.randint(T, (1,), generator=gen))
    path = path_to(parents, leaf)
    padded = torch.tensor(path + [0] * (8 - len(path) % 8))  # a fixed-length path, padded past `accepted`
    kept = replay_gated_delta(state, k, v, g, beta, padded, torch.tensor(len(path)))
    _, want = tree_gated_delta_reference(q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], None, state)
    assert torch.equal(kept, want)


def test_chain_form_equals_transformers_recurrence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(5)
    B, T, Hk, Hv, dk, dv = 2, 11, 2, 4, 8, 6
    q, k = torch.randn(B, T, Hk, dk, generator=gen), torch.randn(B, T, Hk, dk, generator=gen)
    v = torch.randn(B, T, Hv, dv, generator=gen)
    g, beta = -torch.rand(B, T, Hv, generator=gen), torch.rand(B, T, Hv, generator=gen)
    state = torch.randn(B, Hv, dk, dv, generator=gen)
    want, want_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = (F.normalize(q, dim=-1, eps=0) * dk ** -0.5).repeat_interleave(Hv // Hk, dim=2)
    kn = F.normalize(k, dim=-1, eps=0).repeat_interleave(Hv // Hk, dim=2)
    got, got_state = tree_gated_delta_reference(qn, kn, v, g, beta, None, state)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    chain, chain_state = tree_gated_delta_reference(qn, kn, v, g, beta, torch.arange(T) - 1, state)
    assert torch.equal(chain, got) and torch.equal(chain_state, got_state)  # explicit parents: the same chain


@pytest.mark.parametrize("kind,T", CASES[:12] + [("bushy", 65)])
@pytest.mark.parametrize("K", (1, 2, 4))
def test_tree_conv_reads_each_rows_own_ancestors(kind, T, K):
    gen = torch.Generator().manual_seed(T + 7 * K)
    B, C = 2, 5
    parents = random_tree(kind, T, gen)
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    window = torch.randn(B, C, K - 1, generator=gen)
    y = tree_causal_conv_reference(x, w, window, parents)
    for r in range(T):
        seq = torch.cat((window, x[:, path_to(parents, r)].transpose(1, 2)), dim=2)[:, :, -K:]  # oldest first
        torch.testing.assert_close(y[:, r], F.silu((seq * w).sum(-1)), rtol=1e-5, atol=1e-5)
    if K > 1:
        leaf = int(torch.randint(T, (1,), generator=gen))
        path = path_to(parents, leaf)
        padded = torch.tensor(path + [0] * 3)
        kept = conv_window(x, window, padded, torch.tensor(len(path)))
        want = torch.cat((window, x[:, path].transpose(1, 2)), dim=2)[:, :, -(K - 1):]
        assert torch.equal(kept, want)


def test_ancestor_rows_of_a_chain_reach_into_the_window():
    anc = ancestor_rows(None, 4, 3, "cpu")  # entries 0..2 are the window's slots, rows start at 3
    assert anc.tolist() == [[2, 1, 0], [3, 2, 1], [4, 3, 2], [5, 4, 3]]


# ------------------------------------------------------------------------------------------- the Triton path

def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    T = parents.shape[0]
    mask = torch.zeros(T, T, dtype=torch.bool)
    for r in range(T):
        mask[r, path_to(parents, r)] = True
    return mask


def depth_of(parents: torch.Tensor) -> int:
    return max(len(path_to(parents, r)) - 1 for r in range(parents.shape[0]))


@pytest.mark.parametrize("kind,T", CASES + [("star", 257), ("chain", 16)])
def test_schedule_runs_every_row_once_after_its_own_ancestors(kind, T):
    """Every chain's path is the root-to-leaf path of its last row, and every row is run with an output exactly
    once (on the path of the chain it heads or continues); the rows above a chain's head are only replayed."""
    gen = torch.Generator().manual_seed(T * 7 + len(kind))
    parents = random_tree(kind, T, gen)
    schedule = gd.tree_schedule(parents, ancestor_mask(parents), T, 4, "cpu", max_depth=max(1, depth_of(parents)))
    outputs = []
    for path, n, start in zip(schedule.paths.tolist(), schedule.lengths.tolist(), schedule.starts.tolist()):
        if n:
            assert path[:n] == path_to(parents, path[n - 1]), (kind, T, path[:n])
            assert not (parents == path[n - 1]).any()  # chains end at leaves
            outputs += path[start:n]
    assert sorted(outputs) == list(range(T))
    leaves = T - len(set(parents.tolist()) - {-1})
    assert sum(n > 0 for n in schedule.lengths.tolist()) == leaves


def delta_case(gen, B, T, Hk, Hv, dk, dv, kind, dtype=torch.float32, device="cpu"):
    """Random inputs of gated_delta_rule over a random tree; a and b are strided slices of one projection."""
    parents = random_tree(kind, T, gen)
    C = 2 * Hk * dk + Hv * dv
    mixed = torch.randn(B, T, C, generator=gen).to(dtype)
    ab = torch.randn(B, T, 2 * Hv + 5, generator=gen).to(dtype)
    a, b = ab[..., 3:3 + Hv], ab[..., 3 + Hv:3 + 2 * Hv]
    A_log, dt_bias = torch.randn(Hv, generator=gen) * 0.5, torch.randn(Hv, generator=gen)
    state = torch.randn(B, Hv, dk, dv, generator=gen) * 0.5
    to = (lambda t: t.to(device))
    return (parents.to(device), to(mixed), to(a), to(b), to(A_log), to(dt_bias), to(state),
            gd.DeltaDims(Hk, dk, Hv, dv))


def check_delta(gen, B, T, Hk, Hv, dk, dv, kind, dtype=torch.float32, device="cpu", steps: int = 3) -> None:
    """The tree kernel against the reference (outputs, and the last visited row's state for a chain); commit's
    replay against the reference replay; a verified row's output against a one-row step from its parent's state,
    bit for bit."""
    parents, mixed, a, b, A_log, dt_bias, state, dims = delta_case(gen, B, T, Hk, Hv, dk, dv, kind, dtype, device)
    depth = depth_of(parents.cpu())
    schedule = gd.tree_schedule(parents, ancestor_mask(parents.cpu()).to(device), T, 4, device, max_depth=depth)
    out = torch.full((B, T, Hv, dv), float("nan"), dtype=dtype, device=device)
    gd.gated_delta_triton(mixed, a, b, A_log, dt_bias, dims, state, schedule, out, None)
    q, k, v, g, beta = gd.delta_inputs(mixed.cpu(), a.cpu(), b.cpu(), A_log.cpu(), dt_bias.cpu(), dims)
    want, _ = tree_gated_delta_reference(q, k, v, g, beta, parents.cpu(), state.cpu())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().float(), want.to(dtype).float(), **tol, msg=f"{kind} T={T} outputs")
    if kind == "chain":
        last = torch.full_like(state, float("nan"))
        gd.gated_delta_triton(mixed, a, b, A_log, dt_bias, dims, state, gd.chain_schedule(T, 4, device), None, last)
        _, want_last = tree_gated_delta_reference(q, k, v, g, beta, None, state.cpu())
        torch.testing.assert_close(last.cpu(), want_last, **tol, msg="chain's last state")
    rows = gd.RecurrentRows(mixed, mixed, a, b, A_log, dt_bias, dims)
    for r in torch.randperm(T, generator=gen)[:steps].tolist():
        path = path_to(parents.cpu(), r)
        ancestors = torch.tensor(path[:-1] + [0] * 3, device=device)
        kept = state.clone()
        window = torch.zeros(B, mixed.shape[2], 3, dtype=dtype, device=device)
        gd.keep_recurrent(rows, kept, window, ancestors, torch.tensor(len(path) - 1, device=device))
        want_kept = replay_gated_delta(state.cpu(), k, v, g, beta, ancestors.cpu(), torch.tensor(len(path) - 1))
        torch.testing.assert_close(kept.cpu(), want_kept, **tol, msg=f"replay to row {r}'s parent")
        step = torch.full((B, T, Hv, dv), float("nan"), dtype=dtype, device=device)
        one = gd.TreeSchedule(None, schedule.ancestors, torch.tensor([[r]], dtype=torch.int32, device=device),
                              torch.ones(1, dtype=torch.int32, device=device),
                              torch.zeros(1, dtype=torch.int32, device=device))
        gd.gated_delta_triton(mixed, a, b, A_log, dt_bias, dims, kept, one, step, None)
        if device == "cuda":
            assert torch.equal(step[:, r], out[:, r]), f"{kind} T={T}: row {r} verified != its one-row step"
        else:  # the interpreter keeps some float32 intermediates in float64 in registers, not in memory
            torch.testing.assert_close(step[:, r], out[:, r], rtol=1e-6, atol=1e-6)


def check_conv(gen, B, T, C, K, kind, dtype=torch.float32, device="cpu") -> None:
    parents = random_tree(kind, T, gen)
    x = torch.randn(B, T, C, generator=gen).to(dtype).to(device)
    w = torch.randn(C, K, generator=gen).to(dtype).to(device)
    window = torch.randn(B, C, K - 1, generator=gen).to(dtype).to(device)
    schedule = gd.tree_schedule(parents.to(device), ancestor_mask(parents).to(device), T, K, device)
    got = gd.causal_conv_triton(x, w, window, schedule.ancestors)
    want = tree_causal_conv_reference(x.cpu(), w.cpu(), window.cpu(), parents)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.cpu(), want, **tol, msg=f"conv {kind} T={T} K={K}")
    leaf = int(torch.randint(T, (1,), generator=gen))
    path = path_to(parents, leaf)
    padded = torch.tensor(path + [0] * 3, device=device)
    kept = window.clone()
    gd.keep_window_triton(x, kept, padded, torch.tensor(len(path), device=device))
    assert torch.equal(kept.cpu(), conv_window(x.cpu(), window.cpu(), padded.cpu(), torch.tensor(len(path))))


def check_norm(gen, B, T, H, D, dtype=torch.float32, device="cpu") -> None:
    x = torch.randn(B, T, H, D, generator=gen).to(dtype).to(device)
    zw = torch.randn(B, T, H * D + 6, generator=gen).to(dtype).to(device)
    z = zw[..., 6:]  # strided rows, as a slice of the fused projection
    w = (torch.rand(D, generator=gen) + 0.5).to(dtype).to(device)
    got = gd.gated_rmsnorm_triton(x, z, w, 1e-6)
    want = gd.gated_rmsnorm_reference(x.cpu(), z.cpu().reshape(B, T, H, D), w.cpu(), 1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.cpu(), want, **tol, msg=f"gated rmsnorm {dtype}")


def _interp_delta() -> str:
    gen = torch.Generator().manual_seed(11)
    cases = [(1, 1, 1, 1, 8, 4, "chain"), (2, 9, 2, 4, 6, 10, "bushy"), (1, 17, 1, 2, 8, 5, "deep"),
             (1, 12, 2, 2, 4, 8, "star"), (1, 12, 1, 3, 8, 4, "padded"), (2, 7, 2, 4, 8, 8, "chain")]
    for case in cases:
        check_delta(gen, *case, steps=2)
    return f"{len(cases)} tree recurrence cases"


def _interp_conv_norm() -> str:
    gen = torch.Generator().manual_seed(12)
    for kind, T, K in (("chain", 5, 4), ("bushy", 9, 4), ("padded", 12, 2), ("deep", 7, 3)):
        check_conv(gen, 2, T, 37, K, kind)
    check_norm(gen, 2, 3, 2, 12)
    check_norm(gen, 1, 2, 3, 16, torch.bfloat16)
    return "4 conv cases, 2 norm cases"


def check_schedule(gen, kind: str, T: int, K: int, device="cpu", max_depth: int | None = None) -> None:
    """The one-launch schedule equals the reference's tensors exactly (a bool or an int mask, poisoned outputs are
    impossible to leave: every element is written or the comparison fails on torch.empty's garbage)."""
    parents = random_tree(kind, T, gen)
    mask = ancestor_mask(parents)
    depth = depth_of(parents) if max_depth is None else max_depth
    want = gd.tree_schedule_reference(parents, mask, T, K, "cpu", max_depth=depth)
    for m in (mask.to(device), mask.to(torch.int32).to(device)):
        got = gd.tree_schedule_triton(parents.to(device), m, T, K, max_depth=depth)
        for name in ("ancestors", "paths", "lengths", "starts"):
            g, w = getattr(got, name).cpu(), getattr(want, name)
            assert g.dtype == w.dtype and torch.equal(g, w), f"{kind} T={T} K={K} {name}:\n{g}\nwant\n{w}"


def _interp_schedule() -> str:
    gen = torch.Generator().manual_seed(13)
    cases = [(kind, T, K) for kind, T in CASES if T <= 65 for K in (4, 1)] + [("deep", 129, 4), ("chain", 16, 3)]
    for kind, T, K in cases:
        check_schedule(gen, kind, T, K)
    check_schedule(gen, "chain", 20, 4, max_depth=7)  # rows deeper than max_depth: their paths are cut
    return f"{len(cases) + 1} schedule cases"


CHECKS = {"delta": _interp_delta, "conv_norm": _interp_conv_norm, "schedule": _interp_schedule}


@pytest.mark.cpu
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_triton_kernels_under_interpreter(name):
    pytest.importorskip("triton")
    assert_interpreted_ok("correctness.test_kernel_gated_delta", name)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or gd.triton is None, reason="needs CUDA and Triton")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind,T", [("chain", 1), ("chain", 16), ("bushy", 16), ("bushy", 65), ("deep", 65),
                                    ("star", 65), ("padded", 33), ("bushy", 257)])
def test_tree_recurrence_on_gpu_at_the_27b_shape(kind, T):
    """Qwen3.6-27B's Gated DeltaNet shape (16 key heads, 48 value heads of 128 x 128), bfloat16 inputs; the
    schedule's kernel (which the checks below run on) against its reference."""
    gen = torch.Generator().manual_seed(T + len(kind))
    check_schedule(gen, kind, T, 4, "cuda")
    check_delta(gen, 1, T, 16, 48, 128, 128, kind, torch.bfloat16, "cuda", steps=4)
    check_conv(gen, 1, T, 2 * 16 * 128 + 48 * 128, 4, kind, torch.bfloat16, "cuda")
    check_norm(gen, 1, T, 48, 128, torch.bfloat16, "cuda")


if __name__ == "__main__":  # python -m correctness.test_kernel_gated_delta CHECK  (with TRITON_INTERPRET=1)
    run_checks_main(CHECKS)
