"""The statistics behind a reproduction's verdicts: paired tests over seeds and the rank
correlation between the paper's ordering of the methods and ours.

Pairing. Runs of two methods with the same seed share the partition, the initial weights
and the clients sampled in every round (protofl draws each of them from the seed alone),
so the seed-to-seed spread common to both cancels in the per-seed difference
d_s = x_a(s) - x_b(s). Every test below works on those differences (in accuracy points),
over the seeds fixed for the scale in the table file (reproduce/run.py sees to that).

Every verdict has three outcomes at level ``ALPHA`` = 0.05: the claim **shown**, **not
shown**, or **contradicted** (its opposite shown at the same level); and *not comparable*
when it cannot be tested (fewer than ``MIN_SEEDS`` = 3 paired seeds, or a method without
the metric).

* **greater** (a above b by at least a minimum effect delta_min): the one-sided paired
  t-tests of mean(d) > delta_min (shown) and of mean(d) < 0 (contradicted: a below b). The
  interval printed beside them is the two-sided 90 % interval of mean(d): its lower end is
  the one-sided 95 % bound of the first test, so "shown" is "the interval lies above
  delta_min", and "contradicted" is "it lies below 0". delta_min is the claim's
  ``min_effect``: the paper's margin where it states one, else ``MIN_EFFECT`` = 0.5 points.
  A difference between 0 and delta_min, however sure, is *not shown*: a claim is about an
  effect worth stating, and a constant difference of one test image is not one.
* **best** (a above each of k methods): the greater test against each of them; shown only
  if every one is (an intersection-union test: the joint claim keeps level 0.05 without a
  correction); contradicted if some rival is above a at p < 0.05 / k (Bonferroni: "a is
  below at least one of k" is a union of k tests).
* **equal** (a and b within a margin delta of each other): two one-sided tests (TOST).
  *shown equal*: the 90 % interval of mean(d) lies inside (-delta, +delta); *shown
  different*: it lies wholly outside, i.e. beyond +delta or beyond -delta, the exact
  opposite of the claim (a difference that excludes 0 but may still be within the margin
  contradicts nothing).
* **not_worse** (a not below b by more than delta; "does not hurt"): shown when the 90 %
  interval's lower end is above -delta, contradicted when its upper end is below -delta.
* **smaller_std** (a's spread over seeds below b's, a paper's "smaller standard
  deviation" over its trials): the Pitman-Morgan test for the variances of paired values,
  the correlation of the sums and the differences of the per-seed values (cov(a + b,
  a - b) = var a - var b) tested one-sided with n - 2 degrees of freedom; it assumes the
  pairs are roughly bivariate normal and has little power with few seeds.

With ``among`` instead of ``b``, ``not_worse``, ``smaller_std`` and lower-is-better
claims combine their rivals as **best** does.

Multiplicity. A page tests several claims; each is *shown* at 0.05 on its own, so some
"shown" would appear by chance among many. :func:`holm` corrects the *shown* verdicts of a
family of claims for their number (Holm's step-down: the p-values sorted, the i-th
smallest (from 0) must be below 0.05 / (m - i), and every smaller one too, m the claims
of the family with a verdict); a claim shown alone but not after the correction reads
*not shown*, its note saying why. A reproduction page has two families, the paper's
claims and our ablations, each tested in every setting; the comparison page corrects
each paper's claim over the settings it is tested in (its rows are different papers'
claims, and it says so). *Contradicted* is not corrected (its level, per claim, is 0.05;
Bonferroni across the rivals of one "each of" claim).

Constant differences. When d is the same on every seed the t statistic does not exist.
Such a difference counts (p = 0) only when it is at least one test sample in size (the
accuracy one test image is worth, 100 / N points for a metric over N test images);
smaller, it counts for nothing (p = 1). Two methods that differ by a tenth of an image on
every seed are not shown to differ.

The Wilcoxon signed-rank test (exact, one-sided, both directions) is reported beside the
t-test as the distribution-free check, but the verdict rests on the t-test: with n seeds
the smallest one-sided Wilcoxon p-value is 2^-n, 0.125 for three seeds, so it cannot reach
0.05 below five seeds. The t-test assumes the per-seed differences are roughly normal.

Rank correlation: Kendall's tau-b between the paper's values and our means over the
methods that have both (ties, e.g. Ditto's GM = FedAvg's in FedNH's Table 1, are handled
by tau-b), with its two-sided p-value.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, cast, Optional, Sequence, Union

import numpy as np

ALPHA = 0.05
MIN_SEEDS = 3
MIN_EFFECT = 0.5  # points: the smallest difference a "greater" claim is shown for, unless the claim sets its own
CONSTANT = 1e-9  # points: differences this close are the same (80.0 - 79.9 is not exactly 0.1 in floats)
SHOWN, NOT_SHOWN, CONTRADICTED, NOT_COMPARABLE = "shown", "not shown", "contradicted", "not comparable"

# the accuracy one test sample is worth (points), or a function giving it when needed
# (it takes a look at the data, which only a constant difference requires)
Step = Union[None, float, Callable[[], Optional[float]]]


def _p(p: Optional[float]) -> str:
    if p is None or math.isnan(p):
        return "–"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def pairs(a: dict[int, Optional[float]], b: dict[int, Optional[float]]) -> tuple[np.ndarray, list[int]]:
    """Per-seed differences a - b over the seeds where both have a value (in the order of
    ``a``'s seeds), and those seeds."""
    seeds = [s for s, v in a.items() if v is not None and (w := b.get(s)) is not None
             and not math.isnan(v) and not math.isnan(w)]
    return np.array([cast(float, a[s]) - cast(float, b[s]) for s in seeds], dtype=np.float64), seeds


@dataclass
class Paired:
    """The paired comparison of two methods over their common seeds (values in points):
    mean(d) against ``shift`` in both directions."""

    n: int
    mean: float  # mean of d = a - b
    sd: float  # sample std of d (ddof 1)
    ci90: tuple[float, float]  # two-sided 90 % t interval of mean(d): the two one-sided 95 % bounds
    p_for: float  # one-sided paired t-test, H1 mean(d) > shift
    p_against: float  # one-sided paired t-test, H1 mean(d) < shift
    w_for: float  # exact one-sided Wilcoxon signed-rank of d - shift, H1 > (nan when undefined)
    w_against: float
    shift: float = 0.0
    constant: bool = False  # every seed gave the same d: no t statistic
    step: Optional[float] = None  # one test sample (points), looked up for a constant d
    effect: float = 0.0  # the minimum effect p_for and w_for test against (shift + effect); p_against: shift

    def interval(self) -> str:
        lo, hi = self.ci90
        if self.constant:
            return f"{self.mean:+.2f} pts on every one of n = {self.n} seeds"
        return f"{self.mean:+.2f} pts (90 % CI {lo:+.2f} to {hi:+.2f}, n = {self.n})"

    def tests(self) -> str:
        if self.constant:
            one = "of unknown size" if self.step is None else f"{self.step:.3g} pts"
            past = f"beyond {self.shift:+g} pts" if self.shift else "in size"
            counts = "it is" if min(self.p_for, self.p_against) == 0 else "it is not"
            claim = f" (a difference counts for the claim only at {self.effect:g} pts or more)" if self.effect else ""
            return (f"zero spread, so no t-test: a constant difference counts only when at least one test "
                    f"sample ({one}) {past}; {counts}{claim}")
        against = f" against {self.shift:+g} pts" if self.shift else \
            (f" of > {self.effect:g} pts" if self.effect else "")
        return (f"one-sided paired t-test{against} p = {_p(self.p_for)}, the opposite {_p(self.p_against)}; "
                f"Wilcoxon p = {_p(self.w_for)} / {_p(self.w_against)}")

    def text(self) -> str:
        return f"mean difference {self.interval()}; {self.tests()}"

    def line(self) -> str:
        """The short form for one rival of an "each of" claim."""
        if self.constant:
            counts = "counts" if min(self.p_for, self.p_against) == 0 else "less than one test sample"
            return f"{self.mean:+.2f} pts on every seed ({counts})"
        return f"{self.mean:+.2f} pts (90 % CI {self.ci90[0]:+.2f} to {self.ci90[1]:+.2f}), p = {_p(self.p_for)}"


def _resolve(step: Step) -> Optional[float]:
    return step() if callable(step) else step


def paired(d: np.ndarray, step: Step = None, shift: float = 0.0) -> Paired:
    """Both one-sided paired t-tests of mean(d) against ``shift``, the 90 % interval and
    the Wilcoxon tests. A constant d (zero spread) gets p = 0 in its direction when it lies
    at least one test sample (``step``, points) beyond ``shift``, else p = 1 both ways."""
    from scipy import stats

    n = len(d)
    mean = float(d.mean()) if n else float("nan")
    sd = float(d.std(ddof=1)) if n > 1 else float("nan")
    x = d - shift
    w_for = w_against = float("nan")
    if n >= 1 and np.any(x != 0):
        w_for = float(stats.wilcoxon(x, alternative="greater", method="exact").pvalue)
        w_against = float(stats.wilcoxon(x, alternative="less", method="exact").pvalue)
    if n < 2:
        nan = float("nan")
        return Paired(n, mean, sd, (nan, nan), nan, nan, w_for, w_against, shift)
    if np.ptp(x) <= CONSTANT:
        one = _resolve(step)
        # a hair below one sample still counts: the difference of two ratios k/N is inexact
        enough = one is not None and abs(x[0]) >= one * (1 - 1e-9)
        p_for = 0.0 if enough and x[0] > 0 else 1.0
        p_against = 0.0 if enough and x[0] < 0 else 1.0
        return Paired(n, mean, sd, (mean, mean), p_for, p_against, w_for, w_against, shift, True, one)
    half = float(stats.t.ppf(1 - ALPHA, n - 1) * sd / math.sqrt(n))
    return Paired(n, mean, sd, (mean - half, mean + half),
                  float(stats.ttest_1samp(x, 0.0, alternative="greater").pvalue),
                  float(stats.ttest_1samp(x, 0.0, alternative="less").pvalue), w_for, w_against, shift)


@dataclass
class SpreadTest:
    """Pitman-Morgan: is a's spread over the seeds below b's? (paired values)."""

    n: int
    sd_a: float
    sd_b: float
    r: float  # correlation of (a + b) and (a - b); its sign is that of var a - var b
    p_for: float  # H1 var a < var b
    p_against: float  # H1 var a > var b

    def text(self) -> str:
        return (f"std over seeds {self.sd_a:.2f} vs {self.sd_b:.2f} pts (n = {self.n}); Pitman-Morgan "
                f"one-sided p = {_p(self.p_for)}, the opposite {_p(self.p_against)}")

    def line(self) -> str:
        return f"std {self.sd_a:.2f} vs {self.sd_b:.2f}, p = {_p(self.p_for)}"


def spread_test(xa: np.ndarray, xb: np.ndarray) -> SpreadTest:
    from scipy import stats

    s, d = xa + xb, xa - xb
    sd_a, sd_b = float(xa.std(ddof=1)), float(xb.std(ddof=1))
    if np.ptp(s) <= CONSTANT or np.ptp(d) <= CONSTANT:  # a = c - b or a = b + c: the same spread exactly
        return SpreadTest(len(xa), sd_a, sd_b, float("nan"), 1.0, 1.0)
    with warnings.catch_warnings():  # n = 3 leaves one degree of freedom; scipy is right to be terse
        warnings.simplefilter("ignore")
        less = stats.pearsonr(s, d, alternative="less")
        greater = stats.pearsonr(s, d, alternative="greater")
    return SpreadTest(len(xa), sd_a, sd_b, float(less.statistic), float(less.pvalue), float(greater.pvalue))


@dataclass
class Verdict:
    """One claim's outcome: ``verdict`` is SHOWN, NOT_SHOWN, CONTRADICTED or
    NOT_COMPARABLE; ``detail`` says what it rests on, in a sentence; ``note`` qualifies the
    verdict itself (e.g. the rivals it could not be tested against)."""

    verdict: str
    detail: str
    tests: list = field(default_factory=list)
    note: str = ""
    p: Optional[float] = None  # the p-value "shown" rests on (None: not tested); holm() reads it


def _three_way(p_for: float, p_against: float, alpha_against: float = ALPHA) -> str:
    if p_for < ALPHA:
        return SHOWN
    if p_against < alpha_against:
        return CONTRADICTED
    return NOT_SHOWN


def _too_few(n: int, what: str = "") -> Verdict:
    return Verdict(NOT_COMPARABLE, f"{what}{n} paired seed(s); a verdict needs {MIN_SEEDS} or more")


def greater(a: dict[int, Optional[float]], b: dict[int, Optional[float]], step: Step = None,
            shift: float = 0.0, min_effect: float = 0.0) -> Verdict:
    """a above b by more than ``min_effect`` points (shown), or a below b (contradicted);
    ``shift`` = -delta: a not below b by more than delta (both tests against -delta)."""
    d, _ = pairs(a, b)
    if len(d) < MIN_SEEDS:
        return _too_few(len(d))
    p = paired(d, step, shift)
    if min_effect:  # shown: the interval lies above the minimum effect; contradicted: below shift
        past = paired(d, step, shift + min_effect)
        p.p_for, p.w_for, p.effect = past.p_for, past.w_for, min_effect
    return Verdict(_three_way(p.p_for, p.p_against), p.text(), [p], p=p.p_for)


def not_worse(a: dict[int, Optional[float]], b: dict[int, Optional[float]], margin: float,
              step: Step = None) -> Verdict:
    """a not below b by more than ``margin`` points (non-inferiority): mean(d) against -margin."""
    return greater(a, b, step, shift=-margin)


def smaller_std(a: dict[int, Optional[float]], b: dict[int, Optional[float]]) -> Verdict:
    """a's std over the common seeds below b's."""
    _, seeds = pairs(a, b)
    if len(seeds) < MIN_SEEDS:
        return _too_few(len(seeds))
    t = spread_test(np.array([a[s] for s in seeds]), np.array([b[s] for s in seeds]))
    return Verdict(_three_way(t.p_for, t.p_against), t.text(), [t], p=t.p_for)


def each_of(a: dict[int, Optional[float]], others: dict[str, dict[int, Optional[float]]],
            test: Callable[[dict, dict], Verdict], what: str = "above") -> Verdict:
    """``test(a, b)`` against every rival: shown only if shown against each
    (intersection-union); contradicted when some rival's opposite holds at ALPHA / k."""
    if not others:
        return Verdict(NOT_COMPARABLE, "no other method has this metric")
    parts = {label: test(a, b) for label, b in others.items()}
    short = {label: v for label, v in parts.items() if v.verdict == NOT_COMPARABLE}
    if short:
        details = {v.detail for v in short.values()}
        if len(details) == 1:
            who = "each of them" if len(short) == len(parts) else ", ".join(short)
            return Verdict(NOT_COMPARABLE, f"against {who}: {details.pop()}")
        return Verdict(NOT_COMPARABLE, "; ".join(f"against {label}: {v.detail}" for label, v in short.items()))
    k = len(parts)
    tests = [v.tests[0] for v in parts.values()]
    p_all = max(float(v.p) if v.p is not None else 1.0 for v in parts.values())  # intersection-union
    lines = "; ".join(f"vs {label}: {v.tests[0].line()}" for label, v in parts.items())
    against = [label for label, v in parts.items() if v.tests[0].p_against < ALPHA / k]
    failed = [label for label, v in parts.items() if v.verdict != SHOWN]
    if not failed:
        return Verdict(SHOWN, f"{what} each of them at p < {ALPHA}. {lines}", tests, p=p_all)
    if against:
        cut = f"{ALPHA} / {k} = {ALPHA / k:.3g} (Bonferroni over the {k} rivals)" if k > 1 else f"{ALPHA}"
        return Verdict(CONTRADICTED, f"the opposite holds against {', '.join(against)} at p < {cut}. {lines}",
                       tests, p=p_all)
    failed_text = ", ".join(failed)
    if what.startswith("not "):  # "not worse than": no "not not worse than"
        return Verdict(NOT_SHOWN, f"{what} {failed_text}: not shown at p < {ALPHA}. {lines}", tests, p=p_all)
    return Verdict(NOT_SHOWN, f"not {what} {failed_text} at p < {ALPHA}. {lines}", tests, p=p_all)


def best(a: dict[int, Optional[float]], others: dict[str, dict[int, Optional[float]]], step: Step = None,
         min_effect: float = 0.0) -> Verdict:
    """``a`` above every method in ``others`` (label -> values per seed) by more than ``min_effect``."""
    return each_of(a, others, lambda x, y: greater(x, y, step, min_effect=min_effect))


def equal(a: dict[int, Optional[float]], b: dict[int, Optional[float]], margin: float, step: Step = None) -> Verdict:
    """Equivalence within ``margin`` points (TOST at ALPHA); its opposite, a difference
    beyond the margin, is CONTRADICTED ("shown different")."""
    d, _ = pairs(a, b)
    if len(d) < MIN_SEEDS:
        return _too_few(len(d))
    lo = paired(d, step, -margin)  # p_for: H1 mean(d) > -margin; p_against: mean(d) < -margin
    hi = paired(d, step, +margin)  # p_against: H1 mean(d) < +margin; p_for: mean(d) > +margin
    tost = max(lo.p_for, hi.p_against)
    beyond = min(hi.p_for, lo.p_against)
    detail = (f"mean difference {lo.interval()}; TOST with margin ±{margin:g} pts p = {_p(tost)}, "
              f"beyond the margin p = {_p(beyond)}")
    if lo.constant:
        one = "of unknown size" if lo.step is None else f"{lo.step:.3g} pts"
        detail += f" (zero spread: a constant difference counts only by whole test samples, {one})"
    return Verdict(_three_way(tost, beyond), detail, [lo], p=tost)


def holm(verdicts: Sequence[Verdict], what: str = "claims tested together") -> int:
    """Holm's step-down correction of the *shown* verdicts among ``verdicts`` (a page's
    claims, each tested once): with the m verdicts that were tested sorted by p, the i-th
    (from 0) stays shown only if it and every smaller one are below ALPHA / (m - i). A
    verdict that falls reads *not shown*, its note saying so. Returns m."""
    tested = [v for v in verdicts if v.verdict != NOT_COMPARABLE and v.p is not None and not math.isnan(v.p)]
    m = len(tested)
    holding = True
    for i, v in enumerate(sorted(tested, key=lambda v: cast(float, v.p))):
        p = cast(float, v.p)  # tested holds the verdicts with a p
        cut = ALPHA / (m - i)
        holding = holding and p < cut
        if v.verdict == SHOWN and not holding:
            v.verdict = NOT_SHOWN
            why = f"needs p < {cut:.3g}" if p >= cut else "a smaller p missed its cut, and Holm stops there"
            note = f"shown alone (p = {_p(p)}), not after Holm's correction over {m} {what} ({why})"
            v.note = f"{v.note}; {note}" if v.note else note
    return m


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
