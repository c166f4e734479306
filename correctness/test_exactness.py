"""engine.exactness: the comparator of the exactness rule (docs/design.md): near-tie divergences tolerated, all
else fails."""
from __future__ import annotations

import pytest
import torch

from engine.exactness import Comparison, compare_tokens, tolerance_for

TOL = 1e-4
REF = [5, 9, 2, 2, 7, 1, 3, 8]
WIDE = [3.0, 1.5, 0.8, 2.2, 0.6, 4.0, 1.1, 0.9]  # every margin far above TOL


def with_margin(position: int, margin: float) -> list[float]:
    margins = list(WIDE)
    margins[position] = margin
    return margins


def test_tolerances_per_dtype():
    """float32 tolerates margins below 1e-4; bfloat16 (and float16) below 0.05."""
    assert tolerance_for(torch.float32) == pytest.approx(1e-4, rel=0, abs=1e-12)
    assert tolerance_for(torch.bfloat16) == pytest.approx(0.05, rel=0, abs=1e-12)
    assert tolerance_for(torch.float16) == pytest.approx(0.05, rel=0, abs=1e-12)


def test_identical_sequences_pass():
    """Equal sequences are ok and identical, with no divergence position."""
    c = compare_tokens(REF, WIDE, list(REF), TOL)
    assert c.ok and c.identical and not c.tolerated
    assert c.position is None
    assert c.describe() == "identical"


def test_identical_passes_even_with_tiny_margins():
    """Tiny margins do not matter when nothing diverges."""
    c = compare_tokens(REF, [0.0] * len(REF), list(REF), TOL)
    assert c.ok and c.identical


def test_empty_sequences_are_identical():
    """Two empty sequences compare equal."""
    c = compare_tokens([], [], [], TOL)
    assert c.ok and c.identical


@pytest.mark.parametrize("p", [0, 3, 7])
def test_near_tie_divergence_is_tolerated(p):
    """A divergence where the reference margin is below the tolerance passes, reported as tolerated at p."""
    cand = list(REF)
    cand[p] = REF[p] + 100
    c = compare_tokens(REF, with_margin(p, 3e-5), cand, TOL)
    assert c.ok and c.tolerated and not c.identical
    assert c.position == p
    assert c.margin == pytest.approx(3e-5)


def test_tolerated_comparison_stops_at_first_divergence():
    """After a tolerated near-tie the later tokens may differ freely (the sequences have forked)."""
    p = 2
    cand = REF[:p] + [99, 98, 97, 96, 95, 94]
    c = compare_tokens(REF, with_margin(p, 1e-6), cand, TOL)
    assert c.ok and c.tolerated
    assert c.position == p


def test_tolerated_fork_with_different_length():
    """A tolerated fork may be followed by a continuation of another length."""
    p = 4
    cand = REF[:p] + [42]
    c = compare_tokens(REF, with_margin(p, 0.0), cand, TOL)
    assert c.ok and c.tolerated and c.position == p


def test_first_divergence_decides():
    """Only the first divergence counts: a wide margin there fails even if a later position is a near-tie."""
    cand = list(REF)
    cand[1] += 1
    cand[5] += 1
    margins = with_margin(5, 1e-7)
    c = compare_tokens(REF, margins, cand, TOL)
    assert not c.ok and not c.tolerated
    assert c.position == 1
    assert c.margin == pytest.approx(WIDE[1])


@pytest.mark.parametrize("margin", [TOL, 2 * TOL, 0.5, 10.0])
def test_divergence_at_or_above_tolerance_fails(margin):
    """A divergence where the reference margin is at or above the tolerance is a mismatch."""
    p = 3
    cand = list(REF)
    cand[p] = 0
    c = compare_tokens(REF, with_margin(p, margin), cand, TOL)
    assert not c.ok and not c.tolerated and not c.identical
    assert c.position == p


def test_bf16_tolerance_is_wider():
    """A margin of 0.01 is a near-tie for bfloat16 but a real mismatch for float32."""
    p = 1
    cand = list(REF)
    cand[p] = 0
    margins = with_margin(p, 0.01)
    assert compare_tokens(REF, margins, cand, tolerance_for(torch.bfloat16)).ok
    assert not compare_tokens(REF, margins, cand, tolerance_for(torch.float32)).ok


def test_shorter_candidate_fails():
    """A candidate that is a strict prefix of the reference fails, and the report says it is a length mismatch."""
    c = compare_tokens(REF, WIDE, REF[:5], TOL)
    assert not c.ok and not c.identical and not c.tolerated
    assert c.position == 5 and c.lengths == (len(REF), 5)
    assert "length" in c.describe() and "MISMATCH" in c.describe()


def test_longer_candidate_fails():
    """A candidate that extends the reference fails (no reference margin exists past its end)."""
    c = compare_tokens(REF, WIDE, REF + [4, 4], TOL)
    assert not c.ok and not c.identical and not c.tolerated
    assert c.position == len(REF) and c.lengths == (len(REF), len(REF) + 2)


def test_empty_candidate_fails():
    """An empty candidate against a non-empty reference fails at position 0."""
    c = compare_tokens(REF, WIDE, [], TOL)
    assert not c.ok and c.position == 0


@pytest.mark.parametrize("cut", [0, 5, len(REF) - 1])
def test_shorter_candidate_fails_even_at_a_near_tie(cut):
    """A candidate that only lost tokens agrees with the reference wherever both have one: no near-tie decided
    anything, so a small reference margin at the cut does not excuse it (it is a defect, e.g. tokens dropped at a
    stop or a length limit)."""
    c = compare_tokens(REF, with_margin(cut, 1e-6), REF[:cut], TOL)
    assert not c.ok and not c.tolerated and c.position == cut


def test_missing_margins_fail_safe():
    """Without a recorded margin at the divergence, it is not tolerated."""
    cand = list(REF)
    cand[6] = 0
    c = compare_tokens(REF, WIDE[:3], cand, TOL)
    assert not c.ok and c.margin is None
    assert "n/a" in c.describe()


def test_describe_mentions_position_and_verdict():
    """describe() names the position, and says whether it was a tolerated near-tie or a mismatch."""
    cand = list(REF)
    cand[6] = 0
    bad = compare_tokens(REF, WIDE, cand, TOL)
    assert "position 6" in bad.describe()
    assert "MISMATCH" in bad.describe()
    tied = compare_tokens(REF, with_margin(6, 2e-5), cand, TOL)
    assert "position 6" in tied.describe()
    assert "tolerated" in tied.describe() and "MISMATCH" not in tied.describe()


def test_accepts_tuples_and_lists_alike():
    """A tuple candidate equal to a list reference is identical."""
    assert compare_tokens(REF, WIDE, tuple(REF), TOL).identical


def test_comparison_fields():
    """The result is a Comparison dataclass with the reference margin at the divergence."""
    cand = list(REF)
    cand[0] = 0
    c = compare_tokens(REF, WIDE, cand, TOL)
    assert isinstance(c, Comparison)
    assert c.margin == pytest.approx(WIDE[0])
