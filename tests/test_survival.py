"""The survival calculator: sane probabilities and a case worked by hand."""

import argparse
import math

import pytest

from inmem_ft.planning.survival import (
    Inputs,
    add_survival_arguments,
    format_report,
    run_survival,
    survival,
)


def _window_for(p, mtbf_hours=1000.0):
    """Interval (s) at which one node fails within the window with probability p."""
    return -math.log(1.0 - p) * mtbf_hours * 3600.0


def test_hand_computed_small_case():
    # One group of 4, p = 0.1 per node.
    interval = _window_for(0.1)
    ec, rep, none = survival(Inputs(4, 4, 2, 1000.0, interval))
    assert ec.p_loss == pytest.approx(4 * 0.1**3 * 0.9 + 0.1**4)  # 3 or 4 of 4 fail: 0.0037
    assert rep.p_loss == pytest.approx(1 - (1 - 0.1**2) ** 2)  # r=1: pairs; a pair lost if both fail
    assert none.p_loss == pytest.approx(1 - 0.9**4)
    ec1, rep1, _ = survival(Inputs(4, 4, 1, 1000.0, interval))
    assert ec1.p_loss == pytest.approx(1 - 0.9**4 - 4 * 0.1 * 0.9**3)  # 0.0523
    # 33% extra memory holds no full copy: one copy is costed anyway, marked as over the budget.
    assert rep1.p_loss == pytest.approx(1 - (1 - 0.1**2) ** 2) and "more than the 33% EC uses" in rep1.note
    # G=5, m=3: one copy each (r=1); 5 nodes make a pair plus a leftover node folded into a triple.
    _, rep5, _ = survival(Inputs(5, 5, 3, 1000.0, interval))
    assert rep5.p_loss == pytest.approx(1 - (1 - 0.1**2) * (1 - 0.1**3))
    assert "leftover" in rep5.note


@pytest.mark.parametrize(
    "N, G, m", [(8, 4, 1), (64, 4, 2), (1024, 8, 2), (12, 6, 4), (10, 5, 3), (5, 5, 3), (14, 7, 4)]
)
@pytest.mark.parametrize("interval_s", [1.0, 600.0, 86400.0 * 30])
def test_probabilities_are_sane(N, G, m, interval_s):
    risks = survival(Inputs(N, G, m, 5000.0, interval_s, reprotect_s=30.0))
    for risk in risks:
        assert 0.0 <= risk.p_loss <= 1.0
    ec, rep, none = risks
    assert ec.p_loss <= none.p_loss
    if interval_s < 86400:
        assert ec.p_loss < none.p_loss / 100
    assert rep.memory_overhead <= ec.memory_overhead or rep.note


def test_longer_window_is_riskier():
    short, long_ = (survival(Inputs(64, 4, 2, 5000.0, s))[0].p_loss for s in (60.0, 3600.0))
    assert 0 < short < long_


@pytest.mark.parametrize(
    "inp, match",
    [
        (Inputs(10, 4, 2, 1000.0, 60.0), "multiple of G"),
        (Inputs(8, 4, 4, 1000.0, 60.0), "smaller than the group size"),
        (Inputs(8, 4, 2, 0.0, 60.0), "MTBF"),
        (Inputs(8, 4, 2, 1000.0, -1.0), "interval"),
        (Inputs(8, 1, 2, 1000.0, 60.0), "group size"),
    ],
)
def test_bad_inputs_are_explained(inp, match):
    with pytest.raises(ValueError, match=match):
        survival(inp)


def test_cli_prints_a_table(capsys):
    parser = add_survival_arguments(argparse.ArgumentParser())
    args = parser.parse_args("-N 16 -G 4 -m 2 --mtbf-hours 20000 --interval-s 600 --reprotect-s 5".split())
    assert run_survival(args) == 0
    out = capsys.readouterr().out
    assert "EC RS(k=2,m=2), 4 group(s) of 4" in out and "replication x1" in out and "no protection" in out
    inp = Inputs(16, 4, 2, 20000.0, 600.0, 5.0)
    assert out == format_report(inp, survival(inp)) + "\n"
