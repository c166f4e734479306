"""kernels.topk: the Triton top-k log-probabilities against the reference, on fresh random logits with poisoned
outputs; on CPU under the Triton interpreter (a subprocess: `python -m correctness.test_kernel_topk CHECK`), on
a GPU at real shapes (Qwen3's 151,936-token vocabulary) with timings printed under -s."""
from __future__ import annotations

import pytest
import torch

from correctness.kernel_harness import assert_interpreted_ok, hard_logit_cases, run_checks_main
from kernels.topk import topk_logprobs, topk_logprobs_reference, topk_logprobs_triton

POISON = -777


def poisoned(rows: int, k: int, device):
    return (torch.full((rows, k), float("nan"), device=device), torch.full((rows, k), POISON, dtype=torch.long,
                                                                             device=device))


def check_case(logits: torch.Tensor, k: int, chunk=None, context="") -> None:
    want_logp, want_ids = topk_logprobs_reference(logits.cpu(), k)
    got_logp, got_ids = topk_logprobs_triton(logits, k, out=poisoned(logits.shape[0], k, logits.device), chunk=chunk)
    ctx = f"{context} shape={tuple(logits.shape)} {logits.dtype} k={k} chunk={chunk}"
    assert torch.equal(got_ids.cpu(), want_ids), f"{ctx}: ids\n got  {got_ids.tolist()}\n want {want_ids.tolist()}"
    torch.testing.assert_close(got_logp.cpu(), want_logp, rtol=1e-5, atol=1e-5, msg=lambda m: f"{ctx}: logp {m}")


def random_cases(gen: torch.Generator, device) -> int:
    n = 0
    for rows, vocab, k, chunk in ((1, 1, 1, None), (3, 5, 5, None), (16, 37, 8, None), (4, 1000, 8, 128),
                                  (5, 1000, 3, 64), (2, 777, 16, 256), (16, 5000, 8, None), (2, 300, 13, 32)):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)  # bf16 rounding makes ties too
            check_case(logits.to(device), k, chunk, "random")
            n += 1
    return n


def tie_and_inf_cases(gen: torch.Generator, device) -> int:
    n = 0
    for rows, vocab, k, chunk in ((3, 64, 8, 16), (2, 500, 8, 64), (1, 9, 9, None)):
        for name, logits, finite in hard_logit_cases(gen, rows, vocab):  # -inf tails span whole chunks
            check_case(logits.to(device), min(k, finite), chunk, name)
            n += 1
    return n


def _interpreted_checks():
    gen = torch.Generator().manual_seed(7)
    return {"random": lambda: f"{random_cases(gen, 'cpu')} random cases",
            "ties": lambda: f"{tie_and_inf_cases(gen, 'cpu')} tie / -inf / strided cases"}


@pytest.mark.parametrize("check", ["random", "ties"])
def test_triton_topk_under_interpreter(check):
    assert_interpreted_ok("correctness.test_kernel_topk", check)


def test_reference_matches_log_softmax_topk():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4000, generator=gen) * 4
    logp, ids = topk_logprobs_reference(logits, 8)
    want_logp, want_ids = logits.log_softmax(-1).topk(8, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=2e-6)


def test_reference_breaks_ties_by_lower_id_and_checks_k():
    logp, ids = topk_logprobs_reference(torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]), 3)
    assert ids.tolist() == [[1, 2, 4]]
    gen = torch.Generator().manual_seed(5)
    for _ in range(40):  # many ties, some across the k-th place: same order as a full stable sort
        x = torch.randint(0, 4, (5, 300), generator=gen).float()
        k = int(torch.randint(1, 301, (1,), generator=gen))
        want = x.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(topk_logprobs_reference(x, k)[1], want)
    for bad in (0, 6, 2.5):
        with pytest.raises(ValueError, match="k must be"):
            topk_logprobs(torch.zeros(2, 5), bad)
    with pytest.raises(ValueError, match="expected float logits"):
        topk_logprobs(torch.zeros(5, dtype=torch.long), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_topk_matches_reference():
    gen = torch.Generator().manual_seed(11)
    random_cases(gen, "cuda")
    tie_and_inf_cases(gen, "cuda")
    for vocab in (151936, 128256, 49152):
        for k in (1, 8, 15, 32):
            for dtype in (torch.float32, torch.bfloat16):
                check_case((torch.randn(16, vocab, generator=gen) * 4).to(dtype).cuda(), k, None, "real shape")


if __name__ == "__main__":
    run_checks_main(_interpreted_checks())
