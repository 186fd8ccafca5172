"""The statistics behind a reproduction's verdicts: paired tests over seeds and the rank
correlation between the paper's ordering of the methods and ours.

Pairing. Runs of two methods with the same seed share the partition, the initial weights
and the clients sampled in every round (protofl draws each of them from the seed alone),
so the seed-to-seed spread common to both cancels in the per-seed difference
d_s = x_a(s) - x_b(s). Every test below works on those differences (in accuracy points).

Verdicts (``SHOWN``, ``NOT_SHOWN``, ``NOT_COMPARABLE``), at level ``ALPHA`` = 0.05:

* **greater** ("a is above b"): the one-sided paired t-test of H0 mean(d) <= 0 against
  H1 mean(d) > 0. *shown*: p < 0.05; *not shown*: p >= 0.05 (this includes a difference
  in the other direction; the detail gives its sign and size).
* **best** ("a is above every method in a list"): the greater test against each of them;
  *shown* only if every one of them is shown. An intersection-union test, so no
  multiplicity correction is needed for the joint claim to keep level 0.05.
* **equal** ("a and b about equal"): two one-sided tests (TOST) with an equivalence
  margin delta (points): *shown* when both H0 mean(d) <= -delta and H0 mean(d) >= +delta
  are rejected at 0.05, i.e. the 90 % confidence interval of mean(d) lies inside
  (-delta, +delta).
* *not comparable*: fewer than two seeds with a value for both methods (one seed gives
  no spread to test against), or a method without the metric (e.g. FedPer has no global
  model, so no GM).

The Wilcoxon signed-rank test (exact, one-sided) is reported beside the t-test as the
distribution-free check, but the verdict rests on the t-test: with n seeds the smallest
one-sided Wilcoxon p-value is 2^-n, 0.125 for three seeds, so it cannot reach 0.05
below five seeds. The t-test assumes the per-seed differences are roughly normal.

Rank correlation: Kendall's tau-b between the paper's values and our means over the
methods that have both (ties, e.g. Ditto's GM = FedAvg's in FedNH's Table 1, are handled
by tau-b), with its two-sided p-value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

ALPHA = 0.05
SHOWN, NOT_SHOWN, NOT_COMPARABLE = "shown", "not shown", "not comparable"


@dataclass
class Paired:
    """The paired comparison of two methods over the seeds both have (values in points)."""

    n: int
    mean: float  # mean of d = a - b
    sd: float  # sample std of d (ddof 1)
    ci95: tuple[float, float]  # two-sided 95 % t interval of mean(d)
    p_greater: float  # one-sided paired t-test, H1 mean(d) > 0
    p_wilcoxon: float  # one-sided exact Wilcoxon signed-rank, H1 d > 0 (nan when undefined)

    def text(self) -> str:
        lo, hi = self.ci95
        return (f"mean difference {self.mean:+.2f} pts (95 % CI {lo:+.2f} to {hi:+.2f}, n = {self.n}); "
                f"paired t-test one-sided p = {_p(self.p_greater)}; Wilcoxon p = {_p(self.p_wilcoxon)}")


def _p(p: float) -> str:
    if p is None or math.isnan(p):
        return "–"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def pairs(a: dict[int, Optional[float]], b: dict[int, Optional[float]]) -> tuple[np.ndarray, list[int]]:
    """Per-seed differences a - b over the seeds where both have a value (in the order of
    ``a``'s seeds), and those seeds."""
    seeds = [s for s, v in a.items() if v is not None and b.get(s) is not None
             and not math.isnan(v) and not math.isnan(b[s])]
    return np.array([a[s] - b[s] for s in seeds], dtype=np.float64), seeds


def t_greater(d: np.ndarray, shift: float = 0.0) -> float:
    """One-sided one-sample t-test p-value of H1 mean(d) > shift.

    Differences that are all equal (zero spread, e.g. two methods whose metric is the same
    by construction) have no t statistic: p = 0 if they lie above ``shift``, else 1."""
    from scipy import stats

    x = d - shift
    if len(x) < 2:
        return float("nan")
    if np.ptp(x) == 0:
        return 0.0 if x[0] > 0 else 1.0
    return float(stats.ttest_1samp(x, 0.0, alternative="greater").pvalue)


def paired(d: np.ndarray) -> Paired:
    from scipy import stats

    n = len(d)
    mean = float(d.mean()) if n else float("nan")
    sd = float(d.std(ddof=1)) if n > 1 else float("nan")
    if n > 1:
        half = float(stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n))
        ci = (mean - half, mean + half)
    else:
        ci = (float("nan"), float("nan"))
    if n >= 1 and np.any(d != 0):
        w = float(stats.wilcoxon(d, alternative="greater", method="exact").pvalue)
    else:
        w = float("nan")  # all differences zero: no signed ranks
    return Paired(n, mean, sd, ci, t_greater(d), w)


@dataclass
class Verdict:
    """One claim's outcome: ``verdict`` is SHOWN, NOT_SHOWN or NOT_COMPARABLE; ``detail``
    says what it rests on, in a sentence."""

    verdict: str
    detail: str
    tests: list[Paired] = field(default_factory=list)


def greater(a: dict[int, Optional[float]], b: dict[int, Optional[float]], what: str = "") -> Verdict:
    d, _ = pairs(a, b)
    if len(d) < 2:
        return Verdict(NOT_COMPARABLE, f"{what}{len(d)} paired seed(s); a paired test needs two or more")
    p = paired(d)
    return Verdict(SHOWN if p.p_greater < ALPHA else NOT_SHOWN, what + p.text(), [p])


def best(a: dict[int, Optional[float]], others: dict[str, dict[int, Optional[float]]]) -> Verdict:
    """``a`` above every method in ``others`` (label -> values per seed)."""
    if not others:
        return Verdict(NOT_COMPARABLE, "no other method has this metric")
    parts = {label: greater(a, b) for label, b in others.items()}
    short = [label for label, v in parts.items() if v.verdict == NOT_COMPARABLE]
    if short:
        n = min(len(pairs(a, others[label])[0]) for label in short)
        return Verdict(NOT_COMPARABLE, f"{n} paired seed(s) against {', '.join(short)}; a paired test needs two "
                       "or more")
    failed = [label for label, v in parts.items() if v.verdict != SHOWN]
    tests = [t for v in parts.values() for t in v.tests]
    lines = "; ".join(f"vs {label}: {v.tests[0].mean:+.2f} pts, p = {_p(v.tests[0].p_greater)}"
                      for label, v in parts.items())
    if failed:
        return Verdict(NOT_SHOWN, f"not above {', '.join(failed)} at p < {ALPHA}. {lines}", tests)
    return Verdict(SHOWN, f"above each of them at p < {ALPHA}. {lines}", tests)


def equal(a: dict[int, Optional[float]], b: dict[int, Optional[float]], margin: float) -> Verdict:
    """Equivalence within ``margin`` points (TOST at ALPHA)."""
    d, _ = pairs(a, b)
    if len(d) < 2:
        return Verdict(NOT_COMPARABLE, f"{len(d)} paired seed(s); a paired test needs two or more")
    p = paired(d)
    p_lo = t_greater(d, -margin)  # H1 mean(d) > -margin
    p_hi = t_greater(-d, -margin)  # H1 mean(d) < +margin
    tost = max(p_lo, p_hi)
    detail = (f"mean difference {p.mean:+.2f} pts (95 % CI {p.ci95[0]:+.2f} to {p.ci95[1]:+.2f}, n = {p.n}); "
              f"TOST with margin ±{margin:g} pts p = {_p(tost)}")
    return Verdict(SHOWN if tost < ALPHA else NOT_SHOWN, detail, [p])


@dataclass
class RankCorrelation:
    n: int
    tau: float
    p: float
    paper_order: list[str]
    our_order: list[str]

    def text(self) -> str:
        if self.n < 3:
            return f"{self.n} method(s) with a paper value: no rank correlation"
        return f"Kendall's tau-b = {self.tau:+.2f} over {self.n} methods (two-sided p = {_p(self.p)})"


def order(values: dict[str, float]) -> list[str]:
    """Labels from the highest value down (ties keep the given order)."""
    return [k for k, _ in sorted(values.items(), key=lambda kv: -kv[1])]


def rank_correlation(paper: dict[str, float], ours: dict[str, float]) -> RankCorrelation:
    """Kendall's tau-b over the labels with a finite value on both sides."""
    from scipy import stats

    common = [k for k in paper if k in ours and paper[k] is not None and ours[k] is not None
              and not math.isnan(paper[k]) and not math.isnan(ours[k])]
    p_vals = {k: paper[k] for k in common}
    o_vals = {k: ours[k] for k in common}
    if len(common) < 3:
        return RankCorrelation(len(common), float("nan"), float("nan"), order(p_vals), order(o_vals))
    res = stats.kendalltau([p_vals[k] for k in common], [o_vals[k] for k in common], variant="b")
    return RankCorrelation(len(common), float(res.statistic), float(res.pvalue), order(p_vals), order(o_vals))


def format_order(labels: Sequence[str], values: dict[str, float], digits: int = 2) -> str:
    """"A 70.1 > B 68.0 = C 68.0" (equal values at ``digits`` joined by '=')."""
    out = ""
    prev = None
    for k in labels:
        v = round(values[k], digits)
        if prev is not None:
            out += " = " if v == prev else " > "
        out += f"{k} {v:.{digits}f}"
        prev = v
    return out
