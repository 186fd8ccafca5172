"""Metric formulas (documented with worked examples in docs/metrics.md).

All accuracies are computed from per-class counts on a test set:
``correct[c]`` = test samples of class c predicted right, ``count[c]`` = test samples of
class c. With per-class weights w (one weight per test sample, by its class):

    weighted_accuracy = sum_c w_c * correct_c / sum_c w_c * count_c

* GM     -- the global model on the full, balanced test set (w = 1).
* PM(V)  -- a client's personalized model on the full test set, w_c = 1 if class c is in
            the client's training data else 0 (FedNH paper, section 4.1).
* PM(L)  -- the same with w_c = the client's training label proportion n_kc / n_k.
* PA     -- a client's personalized model on its own local test set (sampled with its
            training label proportions), plain accuracy.
* GA     -- the global model on the global test set (= GM); for methods without a global
            model, the mean over clients of their personalized model's plain accuracy on it.
Client-level metrics are averaged over the clients evaluated, unweighted; their
fairness is the (population) standard deviation over those clients.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import numpy.typing as npt


def accuracy(correct: np.ndarray, count: np.ndarray) -> float:
    total = float(np.sum(count))
    return float(np.sum(correct)) / total if total > 0 else float("nan")


def weighted_accuracy(correct: np.ndarray, count: np.ndarray, weights: np.ndarray) -> float:
    w = np.asarray(weights, dtype=np.float64)
    den = float(np.sum(w * count))
    return float(np.sum(w * correct)) / den if den > 0 else float("nan")


def weights_v(train_counts: np.ndarray) -> np.ndarray:
    """V: 1 for classes present in the client's training data, else 0."""
    return (np.asarray(train_counts) > 0).astype(np.float64)


def weights_l(train_counts: np.ndarray) -> np.ndarray:
    """L: the client's training label proportions."""
    c = np.asarray(train_counts, dtype=np.float64)
    return c / c.sum() if c.sum() > 0 else c


def per_class_accuracy(correct: np.ndarray, count: np.ndarray) -> list[float]:
    return [float(a) / b if b > 0 else float("nan") for a, b in zip(correct, count)]


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Unweighted mean and population std (numpy's default ddof=0), ignoring NaN."""
    v = np.asarray([x for x in values if x == x], dtype=np.float64)
    if len(v) == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std())


def summarize_clients(per_client: Sequence[dict[str, float]]) -> dict[str, float]:
    """{metric: mean} and {metric_std: std} over clients for every key any client reported."""
    keys: list[str] = []
    for d in per_client:
        keys += [k for k in d if k not in keys]
    out: dict[str, float] = {}
    for k in keys:
        m, s = mean_std(d[k] for d in per_client if k in d)
        out[k] = m
        out[k + "_std"] = s
    return out


def class_geometry(vectors: np.ndarray) -> tuple[float | None, list[list[float | None]]]:
    """Geometry of a method's class vectors (prototypes or fixed-head rows), (C, d).

    Returns the minimum angle in degrees between two classes' vectors,
    ``min_{i != j} arccos(cos(v_i, v_j))`` (None with fewer than two vectors), and the
    (C, C) cosine-similarity matrix. A zero row (a class without a vector yet) is left
    out of the minimum and gives None entries.
    """
    V = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(V, axis=1)
    ok = norms > 1e-12
    U = V / np.where(ok, norms, 1.0)[:, None]
    S = np.clip(U @ U.T, -1.0, 1.0)
    cos = [[float(round(S[i, j], 5)) if ok[i] and ok[j] else None for j in range(len(V))] for i in range(len(V))]
    idx = np.flatnonzero(ok)
    if len(idx) < 2:
        return None, cos
    sub = S[np.ix_(idx, idx)]
    np.fill_diagonal(sub, -1.0)
    return float(np.degrees(np.arccos(sub.max()))), cos


def cluster_purity(assignment: npt.ArrayLike, truth: npt.ArrayLike) -> float:
    """Purity of a clustering: (1/N) sum over clusters of the size of its largest true
    group (1.0 = every cluster holds one group only)."""
    a, t = np.asarray(assignment), np.asarray(truth)
    if a.shape != t.shape or a.size == 0:
        raise ValueError(f"cluster_purity: need two equal-length non-empty labelings, got {a.shape} and {t.shape}")
    return float(sum(np.unique(t[a == k], return_counts=True)[1].max() for k in np.unique(a))) / a.size


# ---------------------------------------------------------------------------------------
# the registry: what each logged metric is, defined once
# ---------------------------------------------------------------------------------------
class MetricInfo:
    """One logged metric, for everything that shows it.

    ``label``: its column in tables (``"GM"``); ``words``: what it is, for axis labels and the
    report (``"global model accuracy, GM"``); ``unit``: ``accuracy`` (a fraction, shown in
    percent), ``clients``, ``samples``, ``s``, ``MB``, ``degrees`` or ``""`` (as it is);
    ``higher_is_better``: its direction (None: neither, e.g. a cost or a setting);
    ``headline``: a column of the comparison tables and the report's, in registry order;
    ``short``: its name in the progress bar and log lines (None: not shown there);
    ``summary``: in the one-line summary after a run.
    """

    __slots__ = ("name", "label", "words", "unit", "higher_is_better", "headline", "short", "summary")

    def __init__(self, name: str, label: str, words: str, unit: str = "", higher_is_better: bool | None = None,
                 headline: bool = False, short: str | None = None, summary: bool = False) -> None:
        self.name, self.label, self.words, self.unit = name, label, words, unit
        self.higher_is_better, self.headline, self.short, self.summary = higher_is_better, headline, short, summary

    @property
    def scale(self) -> float:
        """What a value is multiplied by for display (accuracies in percent, bytes in MB)."""
        return {"accuracy": 100.0, "MB": 1e-6}.get(self.unit, 1.0)


METRIC_INFO: dict[str, MetricInfo] = {}


def register_metric(info: MetricInfo) -> MetricInfo:
    """Add (or replace) a metric: the CLI, the progress bar, tables, plots and the report read it."""
    METRIC_INFO[info.name] = info
    return info


for _info in (
    MetricInfo("train_loss", "loss", "training loss", "", False, short="loss"),  # first in the progress bar
    # the headline accuracies (docs/metrics.md), in the order tables show them
    MetricInfo("gm", "GM", "global model accuracy, GM", "accuracy", True, headline=True, short="gm", summary=True),
    MetricInfo("pm_v", "PM(V)", "personal accuracy, PM(V)", "accuracy", True, headline=True, summary=True),
    MetricInfo("pm_l", "PM(L)", "personal accuracy, PM(L)", "accuracy", True, headline=True, summary=True),
    MetricInfo("pa", "PA", "personal accuracy, PA", "accuracy", True, headline=True, short="pa", summary=True),
    MetricInfo("ga", "GA", "generic accuracy, GA", "accuracy", True, headline=True, summary=True),
    # cluster_purity: clustering methods on scenarios with known client groups (a fraction)
    MetricInfo("cluster_purity", "purity", "cluster purity", "", True, headline=True),
    # epsilon: runs with differential privacy, the privacy spent at privacy.delta (a cost, not a score)
    MetricInfo("epsilon", "ε", "privacy spent, epsilon", "", None, headline=True, short="eps"),
    MetricInfo("acc", "acc", "personal model accuracy", "accuracy", True),
    MetricInfo("gm_per_class", "GM per class", "global model accuracy per class", "accuracy", True),
    MetricInfo("lr", "lr", "learning rate"),
    MetricInfo("bytes_up", "up", "sent up per round", "MB"),
    MetricInfo("bytes_down", "down", "sent down per round", "MB"),
    MetricInfo("selected", "selected", "clients sampled", "clients"),
    MetricInfo("arrived", "arrived", "updates arrived", "clients"),
    MetricInfo("lost", "lost", "updates lost", "clients"),
    MetricInfo("rejected", "rejected", "updates rejected"),
    MetricInfo("evaluated_clients", "evaluated", "clients evaluated", "clients"),
    MetricInfo("train_samples", "samples", "training samples", "samples"),
    MetricInfo("weight_diversity", "diversity", "weight diversity"),
    MetricInfo("proto_min_angle", "min angle", "smallest angle between classes", "degrees"),
    MetricInfo("train_s", "train s", "training time per round", "s"),
    MetricInfo("eval_s", "eval s", "evaluation time per round", "s"),
    MetricInfo("wall_s", "wall s", "time per round", "s"),
    MetricInfo("cpu_s", "cpu s", "CPU time per round", "s"),
    MetricInfo("all_clients", "all clients", "clients evaluated at the end"),
    MetricInfo("privacy_clip", "clip", "clip bound C of the updates"),
    MetricInfo("privacy_unclipped", "unclipped", "updates within the clip (private estimate)"),
    MetricInfo("privacy_sigma", "sigma", "noise multiplier sigma"),
    MetricInfo("privacy_seeded", "seeded", "seeded noise (not private)"),
):
    register_metric(_info)


def headline_metrics() -> tuple[str, ...]:
    """The columns of the comparison tables and the report, in registry order."""
    return tuple(n for n, m in METRIC_INFO.items() if m.headline)


def shown_metrics() -> tuple[tuple[str, str], ...]:
    """(metric, short name) of the progress bar and the log lines, in registry order."""
    return tuple((n, m.short) for n, m in METRIC_INFO.items() if m.short)


def summary_metrics() -> tuple[str, ...]:
    """The metrics of the one-line summary after a run, in registry order."""
    return tuple(n for n, m in METRIC_INFO.items() if m.summary)
