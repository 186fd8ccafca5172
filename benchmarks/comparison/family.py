"""Every method of protofl side by side: GM, PM(V), PA, GA and s/round under label skew.

    python benchmarks/comparison/family.py --data-dir DATA                  # scale cpu -> fmnist.md
    python benchmarks/comparison/family.py --data-dir DATA --no-run         # the table from the runs made so far
    python benchmarks/comparison/family.py --data-dir DATA --scale smoke    # a check of the script (minutes)
    python benchmarks/comparison/family.py --data-dir DATA --methods fedavg,fednh,fedetf --settings p50c2
    python benchmarks/comparison/family.py --data-dir DATA --claim-methods   # the runs the claims need
    python benchmarks/comparison/family.py --data-dir DATA --exploratory     # the runs outside the plan

Two settings, both on configs/fednh_fmnist.yaml (Fashion-MNIST, cnn_fmnist, and that
config's federated recipe for every method: SGD lr 0.01, momentum 0.9, 5 local epochs, batch
64; no weight decay, no lr decay and no gradient clip, so not all of FedNH's recipe, which
adds weight decay 1e-5, lr decay 0.99 and clip 10). The page states the recipe as read
from its runs' configs (protofl.report.recipe), never by hand:

* ``dir0.3``: 100 clients, Dirichlet(0.3), 10 per round (FedNH's Table 1 split);
* ``p50c2``: 50 clients of exactly 2 classes (each class held by 10 clients), 10 per round
  (FedGELA's Table 5 split).

Scale ``cpu``: 20 rounds; a seeded 20,000 of the 60,000 training images (200 a client on
average in dir0.3, 400 in p50c2); evaluation after rounds 10 and 20; PM(V) and PA over
the 10 clients of the last round. Seeds 0, 1 and 2, fixed before any run and the same for
every method and setting. Every method with its defaults (its paper's; docs/methods).
Scale ``smoke``: 2 rounds on 2,000 images over fewer clients, one seed, one epoch: it
checks the script and says nothing about the methods.

Each setting is one ``protofl sweep`` (its runs under ``--runs``, default
runs/comparison/SCALE/SETTING): a finished run is reused and an interrupted one resumes,
so the table can be built over several sittings. ``--records
benchmarks/comparison/records/cpu`` keeps the record of every finished run there (its
summary, metrics, config and partition: ``protofl.records``), committed beside the page,
so the page is rebuilt from them with ``--no-run`` on any machine and the runs still to
do go on from them (the page's records are one file, records/cpu.jsonl.gz:
protofl.records.pack). The page lists every registered method by family; a cell that
lacks some of its seeds shows how many it has, and a method with no finished run shows
"–". A run that ended but is no result (protofl.run_folder.health: it diverged, a NaN/inf
training loss stopped it; or it collapsed, its final accuracy at chance) is kept in the
records like a finished one, but never averaged into a cell: its cells say how many seeds
count and why the others do not, the setting lists each such run with its reason, and a
claim on its method is *not comparable*. Fashion-MNIST is none of the papers' datasets, so no paper
number sits beside ours here; the papers' own tables are rebuilt by ``protofl reproduce``.

Claims (``CLAIMS``): where a paper of the family says in its own words that its method is
above another (FedETF, SphereFed, CCVR and FedDecorr above FedAvg in GM; FedTGP above
FedProto in PA), the page tests it on both settings over the planned seeds with the paired
t-tests of ``protofl.reproduce.stats`` (shown / not shown / contradicted; shown needs a
difference beyond the claim's minimum effect, and the page's shown verdicts are corrected
for the number of claims tested, Holm), the paper's words and scope beside the verdict.

Exploratory runs (``EXPLORATORY``): a method at other settings, asked after a verdict was
read (e.g. FedDecorr at its authors' code's strength). They run on the planned seeds, sit
in their own section beside their reference method, paired, and give no verdict.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from harness import shown_command  # noqa: E402

from protofl import api  # noqa: E402
from protofl.algorithms import ALGORITHMS  # noqa: E402
from protofl.algorithms.base import by_family  # noqa: E402
from protofl.config import load_config  # noqa: E402
from protofl.metrics import METRIC_INFO  # noqa: E402
from protofl.records import carried, finished  # noqa: E402
from protofl.report import tables  # noqa: E402
from protofl.report.recipe import method_lines, recipe_lines  # noqa: E402
from protofl.run_folder import chance_margin_text, DIVERGED, health, read_config  # noqa: E402
from protofl.reproduce import stats  # noqa: E402
from protofl.reproduce.run import run_value  # noqa: E402
from protofl.reproduce.spec import Metric  # noqa: E402
from protofl.sweeps import plan, sweep  # noqa: E402

# a setting's heading; what it is (clients, split, sampling) is read from its runs' configs
SETTINGS = {
    "dir0.3": ("Dir(0.3)", {}),
    "p50c2": ("P50C2", {"partition.name": "pathological", "partition.classes_per_client": 2,
                        "partition.num_clients": 50, "participation.clients_per_round": 10}),
}
SCALES = {
    "cpu": ([0, 1, 2], {"rounds": 20, "data.train_size": 20_000, "eval.every": 10, "eval.personal_every": 20,
                        "eval.final_all_clients": False}),
    "smoke": ([0], {"rounds": 2, "data.train_size": 2_000, "training.epochs": 1, "eval.every": 2,
                    "eval.personal_every": 2, "eval.final_all_clients": False, "output.checkpoint_every": 0}),
}
# at scale smoke, fewer clients (2,000 images cannot give 100 Dirichlet(0.3) clients 10 each)
SMALLER = {"smoke": {"dir0.3": {"partition.num_clients": 20, "participation.fraction": 0.25},
                     "p50c2": {"partition.num_clients": 10, "participation.clients_per_round": 5}}}
DESCRIPTION = {
    "cpu": ("One recipe for every method (below, read from the runs' configs), each method with its "
            "defaults (its paper's; docs/methods). Fashion-MNIST is none of the papers' datasets, so no paper "
            "number sits beside ours; the papers' own tables are rebuilt by `protofl reproduce` "
            "(benchmarks/RESULTS.md). {rounds} rounds rank the methods early in training: an ordering here is "
            "not a paper's ordering after 100-200 rounds. Some cells repeat another method's by construction: "
            "APFL's, Ditto's and FedAvg-FT's global models are FedAvg's; CCVR and CREFF change only the "
            "server's classifier, so their clients' models (PM(V), PA) are FedAvg's; FedBN is FedAvg on a "
            "model without BatchNorm (cnn_fmnist has none); FedRoD's global model is trained as "
            "BSM-FedAvg's."),
    "smoke": "SMOKE scale: {rounds} rounds on a few images, one seed; it checks the script and says nothing "
             "about the methods.",
}
METRICS = ("gm", "pm_v", "pa", "ga")


@dataclass(frozen=True)
class Claim:
    """A paper's claim that one method's metric is above another's by more than
    ``min_effect`` points, tested over the planned seeds of every setting
    (``protofl.reproduce.stats.greater``: the paired one-sided t-tests, shown / not shown /
    contradicted at 0.05, the shown ones Holm-corrected over the page's claims)."""

    id: str
    paper: str
    text: str  # the paper's own words
    source: str  # where in the paper (or its abstract)
    scope: str  # where the paper makes it, and what is tested here
    metric: str  # gm | pm_v | pa | ga
    a: str
    b: str
    min_effect: float = stats.MIN_EFFECT  # points; none of these claims states a margin we test


# Each paper's claim in its own words where one could be read (the abstract, or the text of
# the paper), tested as the weakest reading that our settings allow: "state of the art" or
# "improves existing algorithms" is at least "above FedAvg".
LEFT_OUT = ("Left out: FedPCL and FedPAC (no comparative sentence in what could be read of them), FPL (its "
            "claims are about domain shift), FedGH (its rivals, \"seven state-of-the-art personalized FL "
            "models\", are not named in its abstract), FedETF's personalization (its personalized model "
            "is the fine-tuning after the last round, which scale cpu does not run: eval.final_all_clients "
            "is off) and FedUV (every copy of its abstract that could be read cuts its claim sentence off, and "
            "its paper's text could not be read).")
CLAIMS: list[Claim] = [
    Claim("fedetf-generalization", "FedETF (Li et al., ICCV 2023)",
          "We devise several effective modules to better adapt the ETF structure in FL, achieving both high "
          "generalization and personalization. Extensive experiments demonstrate that our method achieves "
          "state-of-the-art performances on CIFAR-10, CIFAR-100, and Tiny-ImageNet.", "abstract",
          "The paper: CIFAR-10, CIFAR-100 and Tiny-ImageNet under Dirichlet label skew, against FedAvg, FedProx, "
          "FedDyn, FedRoD, FedNH, CCVR and others. Here: its generalization (GM) above FedAvg's, the weakest "
          "reading of state of the art.", "gm", "fedetf", "fedavg"),
    Claim("spherefed-improves-fedavg", "SphereFed (Dong et al., ECCV 2022)",
          "Extensive experiments indicate that our SphereFed approach is able to improve the accuracy of multiple "
          "existing federated learning algorithms by a considerable margin …",
          "abstract",
          "The paper: several FL algorithms with and without SphereFed on non-i.i.d. data, across datasets and "
          "models. Here: FedAvg with SphereFed (protofl's spherefed) above FedAvg in GM; the size (\"up to 6% "
          "on challenging datasets\") is not tested.", "gm", "spherefed", "fedavg"),
    Claim("ccvr-calibration-helps", "CCVR (Luo et al., NeurIPS 2021)",
          "the classification performance can be significantly improved by post-calibrating the classifier "
          "after federated training", "abstract",
          "The paper: CIFAR-10, CIFAR-100 and CINIC-10 with non-IID clients. Here: FedAvg with CCVR's "
          "calibrated classifier (protofl's ccvr) above FedAvg in GM. Its verdict depends on which draws from the "
          "same Gaussians calibrate the classifier (docs/methods: CCVR's virtual features), so it can move with "
          "a change of how they are drawn.",
          "gm", "ccvr", "fedavg"),
    Claim("feddecorr-improves-fedavg", "FedDecorr (Shi et al., ICLR 2023)",
          "FedDecorr, which is implementation-friendly and computationally-efficient, yields consistent "
          "improvements over baselines on standard benchmark datasets.", "abstract",
          "The paper: CIFAR-10, CIFAR-100 and TinyImageNet under Dirichlet label skew, each baseline with and "
          "without the regularizer (the authors' scripts: 10 clients, MobileNetV2). Here: FedAvg with "
          "FedDecorr above FedAvg in GM, with a small CNN and 50-100 clients, and beta = 0.1 on the paper's "
          "term (the authors' code scales its term so that their 0.1 is about 6.2 here: "
          "docs/methods/global_baselines.md).", "gm", "feddecorr", "fedavg"),
    Claim("fedtgp-above-fedproto", "FedTGP (Zhang et al., AAAI 2024)",
          "Experimental results reveal that FedTGP outperforms FedProto … and surpasses other baseline "
          "methods …", "Introduction (the PDF breaks the name as Fed-Proto)",
          "The paper: 20 clients with eight model architectures in its main table (twelve heterogeneous models in "
          "all; model heterogeneity), pathological (2 classes "
          "a client on CIFAR-10) and Dirichlet(0.1) splits, 1,000 rounds, accuracy of each client's model on its "
          "own test data. Here: one architecture, PA above FedProto's; the sizes (\"by up to 18.96%\" over "
          "FedProto, \"by a large gap\" over the others) are not tested.",
          "pa", "fedtgp", "fedproto"),
    Claim("fedfa-above-fedavg", "FedFA (Zhou, Zhang & Tsang, IEEE TMC 2024)",
          "Extensive experiments show that FedFA significantly outperforms existing approaches on various "
          "classification datasets under label distribution skew and feature distribution skew.", "abstract",
          "The paper: several classification datasets under label and feature skew (its experiments section "
          "could not be read). Here: its global model (GM) above FedAvg's, the weakest reading of "
          "\"outperforms existing approaches\".", "gm", "fedfa", "fedavg"),
    Claim("fedbr-above-fedavg", "FedBR (Guo, Tang & Lin, ICML 2023)",
          "We conducted several experiments to test FedBR and found that it consistently outperforms other "
          "SOTA FL methods.", "abstract",
          "The paper: its experiments (their settings could not be read; the authors' code, built on "
          "DomainBed, loads datasets such as RotatedMNIST, RotatedCIFAR10, PACS and DomainNet). Here: its global model (GM) above FedAvg's, "
          "the weakest reading of \"outperforms other SOTA FL methods\".", "gm", "fedbr", "fedavg"),
]

@dataclass(frozen=True)
class Exploratory:
    """A run outside the plan: a method at other settings, asked after a verdict above. Its
    runs use the planned seeds; its numbers are shown beside its reference method's, paired,
    but they give no verdict and change none."""

    spec: str  # protofl compare syntax, label=name(params)
    against: str  # the reference method
    metric: str
    why: str


EXPLORATORY: list[Exploratory] = [
    Exploratory("feddecorr-beta6.2=feddecorr(beta=6.2)", "fedavg", "gm",
                "FedDecorr at the strength of its authors' code: their beta = 0.1 on their scaling of the term "
                "is beta = 6.2 on the paper's term, which protofl's feddecorr computes "
                "(docs/methods/global_baselines.md). Asked after the claim's verdict (beta = 0.1) was read."),
    Exploratory("feddbe-sgd=feddbe(training.momentum=0)", "fedavg", "pa",
                "FedDBE with its authors' optimizer: plain SGD, no momentum (their client has none, and their "
                "kappa = 50 is set for it), where the page's recipe has momentum 0.9. Asked after FedDBE's "
                "planned Dir(0.3) seed 2 diverged in round 2 (docs/methods/personalization.md). Its PA beside "
                "FedAvg's under the page's recipe (momentum 0.9): two optimizers, so no like-for-like pair."),
    Exploratory("pfedme-plr0.01=pfedme(personal_lr=0.01)", "fedavg", "pa",
                "pFedMe with the inner step of PFLlib's default (personal_lr = 0.01) in place of its authors' "
                "0.09 (set for their MNIST models): every planned Dir(0.3) run diverged in round 1, and the "
                "same seed-0 run diverged with plain SGD too (round 2), but trained with personal_lr = 0.01 "
                "(docs/methods/personalization.md). Asked after those divergences were seen."),
]

# the accuracy one test image is worth, for a metric over the whole balanced test set
# (Fashion-MNIST's 10,000); None for the per-client metrics (reproduce/stats.py)
STEP = {"gm": 100 / 10_000, "ga": 100 / 10_000}


def per_seed(dirs: list[Path], metric: str, seeds: list[int]) -> dict[int, float]:
    """A method's final value of ``metric`` (in %, as the reproduce pages take it) in each of
    its runs of the planned ``seeds``."""
    final = Metric(metric, metric, metric)
    out = {}
    for d in dirs:
        seed = tables.load_summary(d).get("seed")
        if seed in seeds:
            v = run_value(tables.load_rows(d), final)
            if v is not None:
                out[seed] = v
    return out


def claim_verdicts(done: dict[str, dict[str, list[Path]]], seeds: list[int],
                   bad: Optional[dict[str, dict[str, list[tuple[Path, str]]]]] = None
                   ) -> dict[tuple[str, str], stats.Verdict]:
    """(claim id, setting) -> its verdict; ``bad``: setting -> method -> its runs that are
    no result (a claim on such a method is not comparable)."""
    verdicts: dict[tuple[str, str], stats.Verdict] = {}
    for c in CLAIMS:
        for setting in SETTINGS:
            groups = done.get(setting, {})
            lost = [f"{m} seed {finished(d)['seed']}" for m in (c.a, c.b)
                    for d, _ in (bad or {}).get(setting, {}).get(m, []) if finished(d)["seed"] in seeds]
            if lost:
                verdicts[(c.id, setting)] = stats.Verdict(
                    stats.NOT_COMPARABLE, f"no result from {', '.join(lost)} (below)")
                continue
            a = per_seed(groups.get(c.a, []), c.metric, seeds)
            b = per_seed(groups.get(c.b, []), c.metric, seeds)
            verdicts[(c.id, setting)] = stats.greater(a, b, STEP.get(c.metric), min_effect=c.min_effect)
    for c in CLAIMS:  # one paper's claim, tested in every setting: Holm over them
        stats.holm([verdicts[(c.id, setting)] for setting in SETTINGS], "settings")
    return verdicts


def summary_comment(verdicts: dict[tuple[str, str], stats.Verdict], scale: str, seeds: list[int]) -> str:
    """The page's verdicts, machine-readable, as the reproduction pages carry theirs (the
    docs quote them through protofl reproduce quotes)."""
    from protofl.reproduce.pages import SUMMARY
    from protofl.reproduce.render import RULES, short_line

    claims = [{"id": cid, "role": "paper", "setting": SETTINGS[setting][0], "verdict": v.verdict,
               "label": v.verdict + (f", {v.note}" if v.note else ""), "line": short_line(v)}
              for (cid, setting), v in verdicts.items()]
    text = json.dumps({"table": "comparison", "title": "Every method side by side: Fashion-MNIST, the family's "
                       "papers' claims", "rules": RULES, "data": "fmnist", "scale": scale, "seeds": seeds,
                       "claims": claims}, ensure_ascii=False).replace("--", "-\\u002d")
    return f"<!-- {SUMMARY} {text} -->"


def claim_lines(done: dict[str, dict[str, list[Path]]], seeds: list[int], rounds: int,
                bad: Optional[dict[str, dict[str, list[tuple[Path, str]]]]] = None,
                verdicts: Optional[dict[tuple[str, str], stats.Verdict]] = None) -> list[str]:
    """One row per claim, a verdict per setting (``verdicts``, or :func:`claim_verdicts`)."""
    if not CLAIMS:
        return []
    verdicts = claim_verdicts(done, seeds, bad) if verdicts is None else verdicts
    effects = sorted({c.min_effect for c in CLAIMS})
    lines = ["## The papers' claims", "",
             "Each claim in its paper's words, and where the paper makes it; tested here on every setting "
             "over seeds " + ", ".join(map(str, seeds)) + " (the paired one-sided t-tests of "
             "protofl.reproduce.stats: *shown* at p < 0.05 for a difference larger than the claim's minimum effect, "
             + " or ".join(f"{e:g}" for e in effects) + " points here (the paired 90 % interval above it), "
             f"then corrected for the {len(SETTINGS)} settings each claim is tested in (Holm's step-down); "
             "*contradicted* when the opposite (a below b) is shown at p < 0.05, uncorrected; *not shown* "
             "otherwise; fewer than 3 seeds, or a run that is no result: *not comparable*). The rows are different "
             "papers' claims, each its own question: they are not corrected for one another, and no statement "
             "here rests on several rows together. A verdict here is about "
             f"{rounds} rounds on Fashion-MNIST, not about the paper's setting.", "",
             "| claim | paper's words | " + " | ".join(SETTINGS) + " |",
             "|---|---|" + "---|" * len(SETTINGS)]
    for c in CLAIMS:
        cells = []
        for setting in SETTINGS:
            v = verdicts[(c.id, setting)]
            cells.append(f"**{v.verdict}**: " + (v.tests[0].line() if v.tests else v.detail)
                         + (f" ({v.note})" if v.note else ""))
        words = c.text.replace("|", "\\|")
        lines.append(f"| {c.paper}: {c.a} above {c.b} in {c.metric.upper()} | \"{words}\" ({c.source}) | "
                     + " | ".join(cells) + " |")
    lines += [""] + [f"* {c.paper}, {c.a} above {c.b}: {c.scope}" for c in CLAIMS] + ["", LEFT_OUT, ""]
    return lines


def exploratory_lines(done: dict[str, dict[str, list[Path]]], seeds: list[int]) -> list[str]:
    labels = {e.spec: next(iter(api.parse_methods(e.spec))) for e in EXPLORATORY}
    if not any(labels[e.spec] in done.get(s, {}) for e in EXPLORATORY for s in SETTINGS):
        return []
    lines = ["## Exploratory (outside the plan: no verdicts)", "",
             "Runs asked after the verdicts above were read, on the same seeds. The paired difference to "
             "the reference is shown (90 % CI, one-sided p) for what it suggests; it is no verdict and "
             "changes none: a claim's verdict stays the planned run's.", "",
             "| run | against | " + " | ".join(SETTINGS) + " |", "|---|---|" + "---|" * len(SETTINGS)]
    for e in EXPLORATORY:
        cells = []
        for setting in SETTINGS:
            groups = done.get(setting, {})
            a = per_seed(groups.get(labels[e.spec], []), e.metric, seeds)
            b = per_seed(groups.get(e.against, []), e.metric, seeds)
            v = stats.greater(a, b, STEP.get(e.metric))
            mean = f"{sum(a.values()) / len(a):.2f}" if a else "–"
            cells.append(f"{e.metric.upper()} {mean}; vs {e.against}: "
                         + (v.tests[0].line() if v.tests else v.detail))
        lines.append(f"| `{e.spec}` | {e.against} | " + " | ".join(cells) + " |")
    lines += [""] + [f"* `{e.spec}`: {e.why}" for e in EXPLORATORY] + [""]
    return lines


def setting_config(setting: str, scale: str, data_dir: str | None):
    overrides = {**SCALES[scale][1], **SETTINGS[setting][1], **(SMALLER.get(scale, {}).get(setting, {})),
                 "execution.workers": 0, "execution.threads": 1, "output.progress": False}
    if data_dir:
        overrides["data.root"] = data_dir
    return load_config("fednh_fmnist", [f"{k}={v}" for k, v in overrides.items()])


def why_not(runs: list[tuple[Path, str]]) -> str:
    """"2 diverged", "1 collapsed", "1 diverged, 1 collapsed": a method's runs that are no result."""
    kinds = [why.split(":")[0] for _, why in runs]
    return ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))


def cell(row: Optional[dict], m: str, seeds: int, lost: Optional[list[tuple[Path, str]]] = None) -> str:
    """A method's mean ± std over its runs that are results; how many seeds it has when it
    lacks some, and why the others are no result (diverged, collapsed)."""
    lost = lost or []
    if row is None:
        if not lost:
            return "–"
        kinds = {why.split(":")[0] for _, why in lost}
        word = kinds.pop() if len(kinds) == 1 else "no result"
        return f"{word} ({len(lost)} of {seeds} seeds" + (f": {why_not(lost)})" if word == "no result" else ")")
    n = row["count"][m]
    if n == 0:  # a metric the method does not have
        return "–"
    text = tables.pct(*row[m])
    if n == seeds:
        return text
    return f"{text} ({n} of {seeds} seeds" + (f"; {why_not(lost)})" if lost else ")")


def per_round(row: dict) -> str:
    """The s/round cell: CPU seconds where every seed's run recorded them, else wall clock, marked."""
    cpu = row.get("cpu_per_round", float("nan"))
    if cpu == cpu:
        return tables.number(cpu)
    wall = tables.number(row["s_per_round"])
    return f"{wall} (wall)" if wall != "–" else wall


DEFINED = ("gm", "pm_v", "pa", "ga")  # the columns, defined below the tables from docs/metrics.md's words


def page(names: list[str], scale: str, done: dict[str, dict[str, list[Path]]], wall: float,
         hide: Optional[dict[str, str]] = None,
         bad: Optional[dict[str, dict[str, list[tuple[Path, str]]]]] = None) -> str:
    """The page; ``hide``: more flags whose value the shown command replaces (harness.shown_command);
    ``bad``: setting -> method label -> (run folder, why) of its runs that are no result
    (run_folder.health: diverged or collapsed)."""
    bad = bad or {}
    seeds = len(SCALES[scale][0])
    cfg_of = {d: c for d in [*(d for g in done.values() for ds in g.values() for d in ds),
                             *(d for g in bad.values() for runs in g.values() for d, _ in runs)]
              if (c := read_config(d)) is not None}  # each run's config, read once
    rounds = sorted({cfg_of[d].get("rounds") for setting in done.values() for label, dirs in setting.items()
                     if label in names for d in dirs if d in cfg_of} - {None})
    lines = [f"# Every method side by side: Fashion-MNIST, scale {scale}", "",
             f"Written {date.today().isoformat()} from the records of its runs; {len(names)} methods x "
             f"{len(SETTINGS)} settings x seeds {', '.join(map(str, SCALES[scale][0]))}, by:", "", "```",
             shown_command("benchmarks/comparison/family.py", sys.argv[1:], {"--data-dir": "DATA", "--runs": "RUNS",
                                                                              **(hide or {})}),
             "```", "",
             DESCRIPTION[scale].replace("{rounds}", " or ".join(map(str, rounds)) or "Few"), ""]
    for setting, (label, _) in SETTINGS.items():
        groups = done.get(setting, {})
        rows = {r["method"]: r for r in tables.compare_rows(groups, metrics=METRICS)} if groups else {}
        lost = {m: v for m, v in bad.get(setting, {}).items() if m in names}
        have = sum(len(v) for label, v in groups.items() if label in names)  # the exploratory runs apart
        count = f"{have} of {len(names) * seeds} runs finished"
        if lost:
            every = [r for v in lost.values() for r in v]
            count += f"; {why_not(every)} (below)"
        configs = {m: [cfg_of[d] for d in groups.get(m, []) + [d for d, _ in lost.get(m, [])] if d in cfg_of]
                   for m in names}
        recipe = recipe_lines(configs) + method_lines(configs)
        lines += [f"## {label}", "", *[line + "\n" for line in recipe], count + ".", "",
                  "| family | method | GM | PM(V) | PA | GA | s/round |", "|---|---|---|---|---|---|---|"]
        for family, members in by_family(names).items():
            for name in members:
                r, nb = rows.get(name), lost.get(name, [])
                if r is None:
                    c = gm = ga = cell(None, "gm", seeds, nb)  # none finished: "–", or why none counts
                    if nb:  # GM or GA, as the method has a global model or not
                        gm, ga = (c, "= GM") if ALGORITHMS.get(name).has_global_model else ("–", c)
                    lines.append(f"| {family} | {name} | {gm} | {c} | {c} | {ga} | – |")
                    continue
                ga = cell(r, "ga", seeds, nb) if not r.get("global_model", True) else "= GM"
                lines.append(f"| {family} | {name} | {cell(r, 'gm', seeds, nb)} | {cell(r, 'pm_v', seeds, nb)} | "
                             f"{cell(r, 'pa', seeds, nb)} | {ga} | {per_round(r)} |")
        lines.append("")
        if lost:
            lines += ["No result: these runs are left out of the cells above and of every claim on their method. "
                      "A run diverged when a NaN/inf training loss stopped it (its config diverges again in the "
                      f"same round); it {chance_margin_text()}.", ""]
            lines += [f"* {name} seed {finished(d)['seed']}: "
                      + (finished(d)["error"] if finished(d)["status"] == DIVERGED else why)
                      for name in names for d, why in lost.get(name, [])]
            lines.append("")
    verdicts = claim_verdicts(done, SCALES[scale][0], bad) if CLAIMS else {}
    lines += claim_lines(done, SCALES[scale][0], rounds[-1] if rounds else 0, bad, verdicts)
    lines += exploratory_lines(done, SCALES[scale][0])
    words = "; ".join(f"{METRIC_INFO[m].label}: {METRIC_WORDS[m]}" for m in DEFINED)
    lines += [f"{words}. PM(V) and PA are over the clients of the last round (docs/metrics.md). Mean ± std over "
              "the seeds. s/round: mean CPU seconds "
              "a round (training and evaluation, in the run's one process on one thread; as many runs at "
              "once as cores), without the first round; the metrics' `cpu_s`. Unlike wall clock it does "
              "not grow with whatever else the machine ran, though runs sharing the cores still slow each "
              "other somewhat (caches, memory bandwidth). A cell marked (wall) comes from runs made "
              "before protofl recorded CPU time: its wall clock, which grew with whatever else the machine "
              "ran while it was made (two methods doing the same work can differ there by a factor of a few). "
              "benchmarks/timing.md has controlled timings.", "",
              f"Wall time of this invocation: {wall / 60:.1f} min (finished runs are reused)."]
    if CLAIMS:
        lines += ["", summary_comment(verdicts, scale, SCALES[scale][0])]
    return "\n".join(lines) + "\n"


# what each column is, as docs/metrics.md defines it
METRIC_WORDS = {
    "gm": "the global model on the full, balanced global test set (– for a method without one)",
    "pm_v": "each client's personalized model on the full test set, counting only the classes in its "
            "training data (FedNH's PM(V))",
    "pa": "each client's personalized model on its local test set, drawn from the test split with its "
          "training label proportions (FedGELA's PA)",
    "ga": "for a method without a global model, the mean of the personalized models' accuracy on the global "
          "test set; = GM otherwise",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA"))
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--methods", default="", help="comma-separated method names (default: every registered one)")
    p.add_argument("--claim-methods", action="store_true",
                   help="only the methods the papers' claims compare (CLAIMS), in place of --methods")
    p.add_argument("--runs", default=None, help="runs folder (default runs/comparison/SCALE)")
    p.add_argument("--jobs", type=int, default=None, help="runs at once (default: one per core)")
    p.add_argument("--exploratory", action="store_true",
                   help="run only the exploratory entries (EXPLORATORY), in place of --methods")
    p.add_argument("--no-run", action="store_true", help="only the table, from the runs finished so far")
    p.add_argument("--out", default=None, help="the page (default benchmarks/comparison/fmnist.md at scale cpu)")
    p.add_argument("--records", default=None,
                   help="run records, a file (protofl.records.pack; the page's: benchmarks/comparison/records/"
                        "cpu.jsonl.gz) or a folder: its finished runs are not run again, and every run finished is "
                        "added to it")
    args = p.parse_args()

    if args.claim_methods:
        names = [n for n in ALGORITHMS.names() if any(n in (c.a, c.b) for c in CLAIMS)]
    else:
        names = [n for n in args.methods.split(",") if n] or ALGORITHMS.names()
    unknown = [n for n in names if n not in ALGORITHMS.names()]
    if unknown:
        p.error(f"unknown methods: {', '.join(unknown)} (protofl list)")
    settings = [s for s in args.settings.split(",") if s]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        p.error(f"unknown settings: {', '.join(bad)}; settings: {', '.join(SETTINGS)}")
    runs_root = Path(args.runs or f"runs/comparison/{args.scale}")
    seeds = SCALES[args.scale][0]
    methods = api.parse_methods(",".join(names))
    extra = api.parse_methods(",".join(e.spec for e in EXPLORATORY))
    t0 = time.perf_counter()
    planned = {s: plan(setting_config(s, args.scale, args.data_dir), {}, seeds, runs_root / s, {**methods, **extra})
               for s in settings}
    folders = [r.dir.relative_to(runs_root) for runs in planned.values() for r in runs]
    with carried(Path(args.records) if args.records else None, runs_root, folders):
        if not args.no_run:
            for setting in settings:
                out = runs_root / setting
                print(f"[comparison] {setting}: {len(names)} methods x {len(seeds)} seeds -> {out}", flush=True)
                todo = extra if args.exploratory else methods
                sweep(setting_config(setting, args.scale, args.data_dir), {}, seeds, out, todo, jobs=args.jobs,
                      log=lambda m: print(m, flush=True))
    done: dict[str, dict[str, list[Path]]] = {}
    bad: dict[str, dict[str, list[tuple[Path, str]]]] = {}
    for setting, runs in planned.items():
        groups: dict[str, list[Path]] = {}
        for r in runs:
            why = health(r.dir)
            if why is not None:  # it ended, but is no result: diverged or collapsed
                bad.setdefault(setting, {}).setdefault(r.label, []).append((r.dir, why))
            elif api.is_complete(r.dir, r.cfg.rounds):
                groups.setdefault(r.label, []).append(r.dir)
        done[setting] = groups
    # an absolute --records folder names the machine: shown as RECORDS (a relative one as given)
    hide = {"--records": "RECORDS"} if args.records and Path(args.records).is_absolute() else {}
    text = page(names, args.scale, done, time.perf_counter() - t0, hide, bad)
    dest = Path(args.out) if args.out else (HERE / "fmnist.md" if args.scale == "cpu" else None)
    print(text)
    if dest is not None:
        dest.write_text(text)
        print(f"page: {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
