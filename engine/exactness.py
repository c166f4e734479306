"""The exactness rule (docs/design.md): speculative output must equal greedy autoregressive output.

A divergence is tolerated only where the autoregressive run's top-1 minus top-2 logit margin at that position
is below the tolerance of the precision (a near-tie that the verify pass may round the other way); the
comparison stops there and the report counts it. Any other divergence fails, and so does a candidate that only
differs in length (it agrees wherever both have a token): a token lost or added is a defect, whatever the margin.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MARGIN_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.05}


def tolerance_for(dtype: torch.dtype) -> float:
    return MARGIN_TOLERANCE[dtype]


@dataclass
class Comparison:
    ok: bool
    identical: bool
    position: int | None = None    # first divergence
    margin: float | None = None    # the reference's top-1 minus top-2 logit margin there
    tolerated: bool = False        # a near-tie divergence: accepted, comparison stopped there
    lengths: tuple[int, int] | None = None  # (reference, candidate) when they differ only in length

    def describe(self) -> str:
        if self.identical:
            return "identical"
        if self.lengths is not None:
            return (f"MISMATCH in length: {self.lengths[1]} tokens against the reference's {self.lengths[0]}, "
                    f"equal up to position {self.position}")
        margin = "n/a" if self.margin is None else f"{self.margin:.3g}"
        verdict = "tolerated near-tie" if self.tolerated else "MISMATCH"
        return f"{verdict} at position {self.position} (reference margin {margin})"


def compare_tokens(reference: list[int], reference_margins: list[float], candidate: list[int],
                   tolerance: float) -> Comparison:
    """Compare a candidate against the reference (greedy AR) tokens, with the reference's per-token margins."""
    if list(candidate) == list(reference):
        return Comparison(ok=True, identical=True)
    p = next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b), None)
    if p is None:  # one is a prefix of the other
        return Comparison(ok=False, identical=False, position=min(len(reference), len(candidate)),
                          lengths=(len(reference), len(candidate)))
    margin = reference_margins[p] if p < len(reference_margins) else None
    tolerated = margin is not None and margin < tolerance
    return Comparison(ok=tolerated, identical=False, position=p, margin=margin, tolerated=tolerated)
