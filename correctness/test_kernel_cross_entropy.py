"""kernels.cross_entropy: the Triton loss, argmax and gradient against the reference (autograd through a float32
log_softmax) on fresh random logits and labels; on CPU under the Triton interpreter (a subprocess: `python -m
correctness.test_kernel_cross_entropy CHECK`), on a GPU at draft training's shape with timings printed under -s."""
from __future__ import annotations

import pytest
import torch

from correctness.kernel_harness import assert_interpreted_ok, hard_logit_cases, run_checks_main
from kernels.cross_entropy import cross_entropy, cross_entropy_reference, cross_entropy_triton


def check_case(logits: torch.Tensor, labels: torch.Tensor, gen: torch.Generator, context="") -> None:
    """Loss and argmax of every row, and the gradient under a random upstream gradient, against the reference."""
    upstream = torch.randn(logits.shape[0], generator=gen).to(logits.device)
    want_x = logits.detach().clone().requires_grad_()
    want_loss, want_argmax = cross_entropy_reference(want_x, labels)
    (want_loss * upstream).sum().backward()
    x = logits.detach().clone().requires_grad_()
    loss, argmax = cross_entropy_triton(x, labels)
    (loss * upstream).sum().backward()
    ctx = f"{context} shape={tuple(logits.shape)} {logits.dtype}"
    assert torch.equal(argmax, want_argmax), f"{ctx}: argmax {argmax.tolist()} != {want_argmax.tolist()}"
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{ctx}: loss {m}")
    bf16 = logits.dtype == torch.bfloat16  # one rounding to bf16 of nearly equal float32 values: a last-bit flip
    torch.testing.assert_close(x.grad, want_x.grad, rtol=1.6e-2 if bf16 else 1e-5, atol=1e-7,
                               msg=lambda m: f"{ctx}: gradient {m}")


def random_cases(gen: torch.Generator, device) -> int:
    n = 0
    for rows, vocab in ((1, 1), (3, 5), (4, 4096), (5, 4097), (6, 10000), (2, 12289)):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
            labels = torch.randint(vocab, (rows,), generator=gen)
            labels[0] = logits[0].float().argmax()  # a right guess: the gradient's -1 lands on the largest p
            check_case(logits.to(device), labels.to(device), gen, "random")
            n += 1
    return n


def tie_and_inf_cases(gen: torch.Generator, device) -> int:
    n = 0
    for rows, vocab in ((3, 64), (4, 9000)):  # 9000: -inf tails span whole blocks
        for name, logits, finite in hard_logit_cases(gen, rows, vocab):  # labels among the finite logits
            check_case(logits.to(device), torch.randint(finite, (rows,), generator=gen).to(device), gen, name)
            n += 1
    return n


def _interpreted_checks():
    gen = torch.Generator().manual_seed(11)
    return {"random": lambda: f"{random_cases(gen, 'cpu')} random cases",
            "ties": lambda: f"{tie_and_inf_cases(gen, 'cpu')} tie / -inf / strided cases"}


@pytest.mark.parametrize("check", ["random", "ties"])
def test_triton_cross_entropy_under_interpreter(check):
    assert_interpreted_ok("correctness.test_kernel_cross_entropy", check)


def test_reference_is_torch_cross_entropy_and_checks_shapes():
    gen = torch.Generator().manual_seed(5)
    logits, labels = torch.randn(7, 300, generator=gen) * 3, torch.randint(300, (7,), generator=gen)
    loss, argmax = cross_entropy(logits, labels)  # a CPU tensor: the reference
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    assert torch.equal(argmax, logits.argmax(-1))
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_reference(logits, labels[:3])
    with pytest.raises(ValueError, match="logits"):
        cross_entropy_reference(logits[0], labels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cross_entropy_at_the_training_shape():
    """15,360 rows of SmolLM2's 49,152 logits in bfloat16 (32 x 32 blocks x 15 positions): equal to the reference
    (their times: python -m perf.kernel_times)."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(15360, 49152, generator=gen) * 3).to(torch.bfloat16).cuda()
    labels = torch.randint(49152, (15360,), generator=gen).cuda()
    check_case(logits, labels, gen, "training shape")


if __name__ == "__main__":
    run_checks_main(_interpreted_checks())
