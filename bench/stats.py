"""Statistics for the benchmark and study reports (issue 23, "Evidence that holds"): intervals over
seeds, paired and unpaired comparisons, the power calculation that sizes a study, and the wording
of a comparison. Pure: no I/O, numpy and scipy only (scipy is a dependency of echo2).

    from stats import mean_ci, welch_ci, paired_ci, seeds_per_arm, detectable_gap, word_comparison

- `mean_ci(xs)`: the mean with a two-sided t-interval, df = n - 1.
- `bootstrap_ci(xs, seed=0)`: a percentile bootstrap interval of a statistic (default the mean).
- `paired_ci(a, b)`: mean of a[i] - b[i] (the same deals or prompts played twice) with its t-interval.
- `welch_ci(a, b)`: mean(a) - mean(b) of two independent samples, Welch's interval
  (unequal variances, Welch-Satterthwaite df).
- `wilson_ci(k, n)`: a proportion k/n with its Wilson score interval; `newcombe_ci(k1, n1, k2, n2)`:
  k1/n1 - k2/n2 of two independent proportions, Newcombe's hybrid score interval (his method 10).
- `power_two_sample(gap, sd, n)`: power of the two-sided two-sample t-test, n per arm, exact
  (noncentral t); `seeds_per_arm(gap, sd)`: the smallest n per arm reaching 80% power at
  alpha = 0.05; `detectable_gap(n, sd)`: the smallest gap that n per arm detects at that power.
- `word_comparison(interval, claimed_gap)`: "not resolved" when the 95% interval of a difference
  contains 0 or is wider than the gap claimed; otherwise which side is larger, by how much.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

LEVEL = 0.95
POWER = 0.80
ALPHA = 0.05


@dataclass(frozen=True)
class Interval:
    """An estimate with a two-sided interval at `level`; `df` is None for a bootstrap interval."""

    estimate: float
    low: float
    high: float
    level: float
    n: int
    method: str
    df: float | None = None

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def text(self, digits: int = 3) -> str:
        """'0.843 [0.801, 0.885]' (95% interval)."""
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}]"


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with df degrees of freedom (t_quantile(0.975, 4) = 2.776)."""
    if df <= 0:
        raise ValueError(f"df must be positive (got {df})")
    return float(stats.t.ppf(p, df))


def _values(xs: Sequence[float], least: int, what: str) -> np.ndarray:
    a = np.asarray(xs, dtype=float)
    if a.ndim != 1 or len(a) < least:
        raise ValueError(f"{what} needs at least {least} values (got {a.size})")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what}: values must be finite")
    return a


def _t_interval(est: float, se: float, df: float, n: int, level: float, method: str) -> Interval:
    q = t_quantile(1 - (1 - level) / 2, df)
    return Interval(est, est - q * se, est + q * se, level, n, method, df)


def mean_ci(xs: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean over seeds with the t-interval mean +- t(1 - a/2, n - 1) s / sqrt(n)."""
    a = _values(xs, 2, "mean_ci")
    n = len(a)
    return _t_interval(float(a.mean()), float(a.std(ddof=1)) / math.sqrt(n), n - 1, n, level, "t")


def bootstrap_ci(
    xs: Sequence[float],
    stat: Callable[[np.ndarray], float] = np.mean,
    level: float = LEVEL,
    n_boot: int = 10_000,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap: resample xs with replacement n_boot times (numpy's default_rng(seed)),
    the interval is the (1 - level)/2 and (1 + level)/2 quantiles of the resampled statistic.
    Same seed, same interval."""
    a = _values(xs, 2, "bootstrap_ci")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(n_boot, len(a)))
    boots = np.array([stat(row) for row in a[idx]], dtype=float)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return Interval(
        float(stat(a)), float(lo), float(hi), level, len(a), f"percentile bootstrap ({n_boot}, seed {seed})"
    )


def paired_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of the paired differences a[i] - b[i] with its t-interval (df = n - 1): for the same
    deals, prompts or seeds measured under two conditions."""
    x, y = _values(a, 2, "paired_ci"), _values(b, 2, "paired_ci")
    if len(x) != len(y):
        raise ValueError(f"paired_ci needs pairs (got {len(x)} and {len(y)} values)")
    iv = mean_ci(x - y, level)
    return Interval(iv.estimate, iv.low, iv.high, level, iv.n, "paired t", iv.df)


def welch_df(a: Sequence[float], b: Sequence[float]) -> float:
    """Welch-Satterthwaite degrees of freedom of mean(a) - mean(b)."""
    x, y = _values(a, 2, "welch_df"), _values(b, 2, "welch_df")
    va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    if va + vb == 0:
        return float(len(x) + len(y) - 2)
    return float((va + vb) ** 2 / (va**2 / (len(x) - 1) + vb**2 / (len(y) - 1)))


def welch_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) of two independent samples with Welch's t-interval: se =
    sqrt(s_a^2 / n_a + s_b^2 / n_b), df by Welch-Satterthwaite. `n` is the smaller sample."""
    x, y = _values(a, 2, "welch_ci"), _values(b, 2, "welch_ci")
    se = math.sqrt(x.var(ddof=1) / len(x) + y.var(ddof=1) / len(y))
    est = float(x.mean() - y.mean())
    return _t_interval(est, se, welch_df(x, y), min(len(x), len(y)), level, "Welch t")


def wilson_ci(k: int, n: int, level: float = LEVEL) -> Interval:
    """k/n with the Wilson score interval (Wilson 1927); n = 0 gives [0, 1]."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return Interval(0.0, 0.0, 1.0, level, 0, "wilson")
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return Interval(k / n, float(ci.low), float(ci.high), level, n, "wilson")


def newcombe_ci(k1: int, n1: int, k2: int, n2: int, level: float = LEVEL) -> Interval:
    """k1/n1 - k2/n2 of two independent proportions, with Newcombe's (1998) hybrid score interval
    (method 10): each proportion's Wilson interval, combined by square-and-add."""
    a, b = wilson_ci(k1, n1, level), wilson_ci(k2, n2, level)
    d = a.estimate - b.estimate
    low = d - math.sqrt((a.estimate - a.low) ** 2 + (b.high - b.estimate) ** 2)
    high = d + math.sqrt((a.high - a.estimate) ** 2 + (b.estimate - b.low) ** 2)
    return Interval(d, low, high, level, n1 + n2, "newcombe")


def power_two_sample(gap: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided two-sample t-test (equal variances, n per arm) to detect a true
    difference `gap` between the means when each arm's SD is `sd`: exact, from the noncentral t
    with df = 2n - 2 and noncentrality gap / (sd sqrt(2/n))."""
    if n < 2 or sd <= 0:
        raise ValueError(f"power_two_sample needs n >= 2 and sd > 0 (got n={n}, sd={sd})")
    df = 2 * n - 2
    nc = abs(gap) / (sd * math.sqrt(2 / n))
    q = t_quantile(1 - alpha / 2, df)
    return float(stats.nct.sf(q, df, nc) + stats.nct.cdf(-q, df, nc))


def seeds_per_arm(
    gap: float, sd: float, power: float = POWER, alpha: float = ALPHA, most: int = 100_000
) -> int:
    """The smallest n per arm whose two-sided two-sample t-test detects `gap` with `power`
    (gap = 1 SD: 17 per arm; 0.5 SD: 64; Cohen's table)."""
    if gap == 0:
        raise ValueError("a gap of 0 cannot be detected")
    # start from the normal approximation 2 (z_a + z_b)^2 (sd / gap)^2, then step to the exact n
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n = max(2, math.ceil(2 * z**2 * (sd / gap) ** 2))
    while n > 2 and power_two_sample(gap, sd, n - 1, alpha) >= power:
        n -= 1
    while power_two_sample(gap, sd, n, alpha) < power:
        n += 1
        if n > most:
            raise ValueError(f"more than {most} per arm needed")
    return n


def detectable_gap(n: int, sd: float, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest true difference of means that n per arm detects with `power` (two-sided
    two-sample t-test at alpha), in the units of sd."""
    if n < 2 or sd <= 0:
        raise ValueError(f"detectable_gap needs n >= 2 and sd > 0 (got n={n}, sd={sd})")
    hi = sd
    while power_two_sample(hi, sd, n, alpha) < power:
        hi *= 2
    return float(optimize.brentq(lambda g: power_two_sample(g, sd, n, alpha) - power, 0.0, hi, xtol=1e-12))


@dataclass(frozen=True)
class Verdict:
    resolved: bool
    reason: str
    text: str


def word_comparison(
    diff: Interval,
    claimed_gap: float | None = None,
    a: str = "A",
    b: str = "B",
    unit: str = "",
    digits: int = 3,
) -> Verdict:
    """Words a comparison from the interval of a difference a - b. "not resolved" when the
    interval contains 0, or when a gap is claimed and the interval is wider than it (full width
    high - low > |claimed_gap|); otherwise "a > b" (or "a < b") by the estimate."""
    f = f"{{:+.{digits}f}}"
    lvl = f"{round(diff.level * 100)}%"
    ci = f"{f.format(diff.estimate)}{unit} [{lvl} interval {f.format(diff.low)}, {f.format(diff.high)}; {diff.method}, n = {diff.n}]"
    head = f"{a} - {b} = {ci}"
    if diff.contains(0.0):
        return Verdict(False, "contains 0", f"{head}: not resolved (the interval contains 0)")
    if claimed_gap is not None and diff.width > abs(claimed_gap):
        g = f"{abs(claimed_gap):.{digits}f}"
        w = f"{diff.width:.{digits}f}"
        return Verdict(
            False,
            "wider than the gap",
            f"{head}: not resolved (the interval, {w}{unit} wide, is wider than the claimed gap {g}{unit})",
        )
    side = ">" if diff.estimate > 0 else "<"
    return Verdict(True, "resolved", f"{head}: {a} {side} {b}")
