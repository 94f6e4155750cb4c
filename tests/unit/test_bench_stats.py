"""bench/stats.py against textbook values worked by hand (issue 23, "Evidence that holds"): t
quantiles from a printed t table, intervals computed step by step in the comments, Cohen's / G*Power's
sample sizes for the two-sample t-test, and the wording rule ("not resolved")."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def st(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as `python bench/NAME.py` imports its siblings
    return importlib.import_module("stats")


@pytest.mark.parametrize(
    ("df", "expected"),
    # two-sided 95% (the 0.975 quantile), from a printed t table
    [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045), (1000, 1.962)],
)
def test_t_quantile_table(st, df, expected):
    assert st.t_quantile(0.975, df) == pytest.approx(expected, abs=5e-4)


def test_mean_ci_by_hand(st):
    # the quickstart's held-out accuracy after training, seeds 0-2 (README): mean 0.848;
    # deviations -0.024, -0.010, +0.034; s^2 = 0.001832 / 2 = 0.000916, s = 0.030266;
    # se = s / sqrt(3) = 0.017474; t(0.975, 2) = 4.303; half-width 0.07519
    iv = st.mean_ci([0.824, 0.838, 0.882])
    assert iv.estimate == pytest.approx(0.848, abs=1e-12)
    assert iv.df == 2 and iv.n == 3
    assert iv.half_width == pytest.approx(0.07519, abs=5e-5)
    assert (iv.low, iv.high) == pytest.approx((0.77281, 0.92318), abs=5e-5)
    assert iv.text() == "0.848 [0.773, 0.923]"


def test_mean_ci_needs_two_values(st):
    with pytest.raises(ValueError):
        st.mean_ci([1.0])
    with pytest.raises(ValueError):
        st.mean_ci([1.0, float("nan")])


def test_paired_ci_by_hand(st):
    # differences 2, 1, 0, 3: mean 1.5; squared deviations 0.25 + 0.25 + 2.25 + 2.25 = 5, s^2 = 5/3,
    # s = 1.29099, se = 0.645497; t(0.975, 3) = 3.1824; half-width 2.05426 -> [-0.554, 3.554]
    iv = st.paired_ci([10, 12, 9, 11], [8, 11, 9, 8])
    assert iv.estimate == 1.5 and iv.df == 3
    assert (iv.low, iv.high) == pytest.approx((-0.55426, 3.55426), abs=5e-5)
    with pytest.raises(ValueError):
        st.paired_ci([1, 2, 3], [1, 2])


def test_paired_is_narrower_than_unpaired_when_pairs_share_noise(st):
    # the same deals played twice: large deal-to-deal spread, small consistent difference
    a = [10.0, 20.0, 30.0, 40.0, 50.0]
    b = [9.0, 19.5, 28.8, 39.1, 49.0]
    paired, welch = st.paired_ci(a, b), st.welch_ci(a, b)
    assert paired.estimate == pytest.approx(welch.estimate)
    assert not paired.contains(0.0) and welch.contains(0.0)


def test_welch_by_hand(st):
    # a = 1..5: mean 3, s^2 = 2.5; b = 2, 4, ..., 12: mean 7, s^2 = 70 / 5 = 14
    # se^2 = 2.5/5 + 14/6 = 0.5 + 2.33333 = 2.83333, se = 1.68325
    # df = 2.83333^2 / (0.5^2/4 + 2.33333^2/5) = 8.02778 / 1.15139 = 6.9723
    # t(0.975, 6.9723) = 2.3665; half-width 3.9835 -> [-7.9835, -0.0165]
    a, b = [1, 2, 3, 4, 5], [2, 4, 6, 8, 10, 12]
    assert st.welch_df(a, b) == pytest.approx(6.9723, abs=1e-4)
    iv = st.welch_ci(a, b)
    assert iv.estimate == -4.0
    assert iv.half_width == pytest.approx(3.9835, abs=1e-3)
    assert (iv.low, iv.high) == pytest.approx((-7.9835, -0.0165), abs=1e-3)


def test_welch_equal_samples_equal_variances_is_pooled(st):
    # equal n and equal variances: Welch's df is 2n - 2, the pooled test's
    a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]
    assert st.welch_df(a, b) == pytest.approx(4.0)
    iv = st.welch_ci(a, b)
    # se = sqrt(1/3 + 1/3) = 0.81650; t(0.975, 4) = 2.7764 -> half-width 2.2669
    assert iv.half_width == pytest.approx(2.2669, abs=1e-4)


def test_bootstrap_seeded_and_sane(st):
    xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    one, again = st.bootstrap_ci(xs, seed=0), st.bootstrap_ci(xs, seed=0)
    assert one == again
    # another seed, other resamples (irregular values, so the quantiles do not land on the same grid)
    ys = [0.13, 0.92, 0.41, 0.77, 0.05, 0.58, 0.36, 0.99]
    b0, b1 = st.bootstrap_ci(ys, n_boot=500, seed=0), st.bootstrap_ci(ys, n_boot=500, seed=1)
    assert (b0.low, b0.high) != (b1.low, b1.high)
    assert one.estimate == 5.5 and one.low < 5.5 < one.high
    # the percentile interval of the mean of 1..10 is close to the normal one, 5.5 +- 1.96 x 0.908 x
    # sqrt(9/10) (the bootstrap's variance has divisor n): 5.5 +- 1.69
    assert one.low == pytest.approx(5.5 - 1.69, abs=0.2)
    assert one.high == pytest.approx(5.5 + 1.69, abs=0.2)
    med = st.bootstrap_ci(xs, stat=lambda r: float(sorted(r)[len(r) // 2]), seed=0)
    assert med.estimate == 6.0


@pytest.mark.parametrize(
    ("gap_sd", "n"),
    # n per group for 80% power, two-sided alpha 0.05 (Cohen 1988, Table 2.4.1; G*Power's exact
    # t-test gives the same, 394 for d = 0.2 where Cohen's normal-based table prints 393)
    [(1.0, 17), (0.8, 26), (0.5, 64), (0.2, 394)],
)
def test_seeds_per_arm_textbook(st, gap_sd, n):
    assert st.seeds_per_arm(gap_sd * 2.0, sd=2.0) == n  # only the ratio gap / sd matters
    assert st.power_two_sample(gap_sd, 1.0, n) >= 0.80
    assert st.power_two_sample(gap_sd, 1.0, n - 1) < 0.80


def test_power_values(st):
    # d = 1, n = 17 per arm: df 32, noncentrality 1 / sqrt(2/17) = 2.9155, power 0.807
    assert st.power_two_sample(1.0, 1.0, 17) == pytest.approx(0.807, abs=1e-3)
    # the normal approximation's 2 (1.96 + 0.8416)^2 = 15.7 -> 16 falls short with a t-test
    assert st.power_two_sample(1.0, 1.0, 16) == pytest.approx(0.781, abs=1e-3)
    # no gap: the power is alpha
    assert st.power_two_sample(0.0, 1.0, 10) == pytest.approx(0.05, abs=1e-9)


def test_detectable_gap(st):
    # inverse of the above: 17 per arm detects just under 1 SD, 64 per arm just under 0.5 SD
    g17, g64 = st.detectable_gap(17, 1.0), st.detectable_gap(64, 1.0)
    assert 0.98 < g17 < 1.0 and 0.49 < g64 < 0.5
    assert st.power_two_sample(g17, 1.0, 17) == pytest.approx(0.80, abs=1e-6)
    # three seeds per arm detect only about 3 SD
    assert st.detectable_gap(3, 1.0) == pytest.approx(3.07, abs=0.01)
    # scales with the SD
    assert st.detectable_gap(17, 0.03) == pytest.approx(0.03 * g17, rel=1e-6)


def test_word_comparison_rules(st):
    iv = st.Interval(0.03, -0.01, 0.07, 0.95, 3, "t", 2.0)
    v = st.word_comparison(iv, 0.03, "vllm", "hf")
    assert not v.resolved and v.reason == "contains 0"
    assert v.text.endswith("not resolved (the interval contains 0)")
    assert v.text.startswith("vllm - hf = +0.030")

    narrow_but_wide = st.Interval(0.05, 0.01, 0.09, 0.95, 3, "t", 2.0)
    v = st.word_comparison(narrow_but_wide, 0.05)
    assert not v.resolved and v.reason == "wider than the gap"
    assert "not resolved" in v.text

    tight = st.Interval(-0.05, -0.07, -0.03, 0.95, 20, "Welch t", 30.0)
    v = st.word_comparison(tight, 0.05, "a", "b")
    assert v.resolved and v.text.endswith(": a < b") and "not resolved" not in v.text
    # with no claimed gap only 0 matters
    assert st.word_comparison(narrow_but_wide).resolved


def test_word_comparison_end_to_end(st):
    # the README's engines over seeds 0-2: vLLM 0.838 / 0.809 / 0.882, HF 0.824 / 0.838 / 0.882
    diff = st.welch_ci([0.838, 0.809, 0.882], [0.824, 0.838, 0.882])
    assert diff.estimate == pytest.approx(-0.005, abs=1e-9)
    v = st.word_comparison(diff, None, "vLLM", "HF")
    assert not v.resolved and "not resolved" in v.text
    assert not math.isnan(diff.df)


@pytest.mark.parametrize(
    "k, n, low, high",
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_textbook(st, k, n, low, high):
    iv = st.wilson_ci(k, n)
    assert iv.estimate == pytest.approx(k / n)
    assert (iv.low, iv.high) == pytest.approx((low, high), abs=6e-5)


@pytest.mark.parametrize(
    "k1, n1, k2, n2, low, high",
    # Newcombe (1998), "Interval estimation for the difference between independent proportions",
    # Table II, method 10 (hybrid score)
    [(56, 70, 48, 80, 0.0524, 0.3339), (9, 10, 3, 10, 0.1705, 0.8090), (5, 56, 0, 29, -0.0381, 0.1926)],
)
def test_newcombe_textbook(st, k1, n1, k2, n2, low, high):
    iv = st.newcombe_ci(k1, n1, k2, n2)
    assert iv.estimate == pytest.approx(k1 / n1 - k2 / n2)
    assert (iv.low, iv.high) == pytest.approx((low, high), abs=6e-5)


def test_proportions_refuse_impossible_counts(st):
    with pytest.raises(ValueError):
        st.wilson_ci(3, 2)
    assert (st.wilson_ci(0, 0).low, st.wilson_ci(0, 0).high) == (0.0, 1.0)
