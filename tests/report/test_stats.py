"""pass@k, the bootstrap, the paired difference and McNemar's test against hand-checked numbers."""

import math

import pytest

from dispatcher.report.stats import bootstrap_mean, mcnemar_exact, paired_difference, pass_at_k, pass_at_ks


def test_pass_at_k_is_the_unbiased_estimator_on_a_hand_checked_case():
    # n = 5 attempts, c = 2 resolved: pass@k = 1 - C(3, k) / C(5, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # 1 - 3/5
    assert pass_at_k(5, 2, 2) == pytest.approx(7 / 10)  # 1 - 3/10
    assert pass_at_k(5, 2, 3) == pytest.approx(9 / 10)  # 1 - 1/10
    assert pass_at_k(5, 2, 4) == 1.0  # fewer than 4 failures: any 4 draws include a success
    assert pass_at_k(3, 0, 2) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(2, 3, 1)


def test_pass_at_ks_averages_over_the_instances_that_have_k_attempts():
    outcomes = {"a": (5, 2), "b": (5, 0), "c": (2, 1)}
    got = {p.k: p.estimate for p in pass_at_ks(outcomes)}
    assert got[1].value == pytest.approx((2 / 5 + 0 + 1 / 2) / 3) and got[1].n == 3
    assert got[2].value == pytest.approx((7 / 10 + 0 + 1) / 3) and got[2].n == 3
    assert got[3].value == pytest.approx((9 / 10 + 0) / 2) and got[3].n == 2  # "c" has only 2 attempts
    assert sorted(got) == [1, 2, 3, 4, 5]
    for est in got.values():
        assert est.lo <= est.value <= est.hi


def test_bootstrap_interval_brackets_the_mean_and_is_a_point_for_constant_values():
    iv = bootstrap_mean([0.0, 1.0] * 50, seed=1)
    assert iv.value == 0.5 and 0.35 < iv.lo < 0.5 < iv.hi < 0.65  # about +-1.96 * 0.05
    const = bootstrap_mean([0.25] * 7)
    assert (const.lo, const.value, const.hi) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError):
        bootstrap_mean([])


def test_mcnemar_exact_on_known_tables():
    # 1 discordant pair one way, 6 the other: p = 2 * (C(7,0) + C(7,1)) / 2**7 = 0.125
    pairs = [(True, False)] + [(False, True)] * 6 + [(True, True)] * 3 + [(False, False)] * 2
    m = mcnemar_exact(pairs)
    assert (m.a_only, m.b_only, m.both, m.neither) == (1, 6, 3, 2)
    assert m.p_value == pytest.approx(0.125)
    assert mcnemar_exact([(True, True), (False, False)]).p_value == 1.0  # no discordant pair
    assert mcnemar_exact([(True, False)] * 10).p_value == pytest.approx(2 / 2 ** 10)


def test_a_run_compared_with_itself_differs_by_zero():
    outcomes = {"a": (3, 1), "b": (3, 3), "c": (3, 0)}
    first = {"a": False, "b": True, "c": False}
    d = paired_difference(outcomes, outcomes, first, first)
    assert d.instances == 3 and d.a_rate == d.b_rate == pytest.approx(4 / 9)
    assert (d.difference.value, d.difference.lo, d.difference.hi) == (0.0, 0.0, 0.0)
    assert d.mcnemar.a_only == d.mcnemar.b_only == 0 and d.mcnemar.p_value == 1.0


def test_paired_difference_uses_only_shared_scored_instances():
    a = {"x": (1, 1), "y": (1, 0), "only-a": (1, 1)}
    b = {"x": (1, 0), "y": (1, 0), "only-b": (1, 1), "unscored": (0, 0)}
    d = paired_difference(a, b, {"x": True, "y": False, "only-a": True}, {"x": False, "y": False, "only-b": True})
    assert d.instances == 2
    assert d.difference.value == pytest.approx(0.5)  # x: 1 - 0, y: 0 - 0
    assert d.mcnemar.a_only == 1 and d.mcnemar.b_only == 0 and math.isclose(d.mcnemar.p_value, 1.0)
    with pytest.raises(ValueError, match="share no instance"):
        paired_difference({"p": (1, 1)}, {"q": (1, 1)}, {}, {})
