"""A page's recipe, read from its runs' configs: the optimizer, learning rate, momentum,
weight decay, schedule, gradient clip, local work, batch, rounds, clients, sampling, data,
partition (with its redraw rule) and model that the runs used, so that no page states a
setting by hand that its runs did not use.

:func:`recipe_lines` takes the configs of a page's runs (as recorded: plain mappings, see
:mod:`protofl.records`) grouped by method. Each part of the recipe is stated as most runs
have it; the methods whose runs differ follow with their values ("fedge, fedgela:
gradient clip 20 (the method's own)": a method's own setting beside the shared recipe,
its gradient clip in ``algorithm.clip_grad``, is named the same way). :func:`method_lines`
states each method's own settings (the config's ``algorithm`` section) the same way, and
:func:`setting` reads one setting for a page's prose (``{{training.momentum}}`` in a
table file's notes), refusing one that the runs do not share.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Mapping

Config = Mapping[str, Any]


def _get(cfg: Config, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _num(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"  # as the config file writes it
    if not isinstance(x, (int, float)):
        return str(x)
    return f"{x:g}" if isinstance(x, float) else f"{x:,}"


def optimizer(cfg: Config) -> str:
    t = _get(cfg, "training", {}) or {}
    name = t.get("optimizer", "sgd")
    text = f"{name.upper() if name == 'sgd' else name.capitalize()} lr {_num(t.get('lr'))}"
    if name in ("sgd", "rmsprop"):
        text += f", momentum {_num(t.get('momentum', 0.0))}"
    if name in ("adam", "adamw"):
        text += f", betas {', '.join(map(_num, t.get('betas') or []))}"
    return text + f", weight decay {_num(t.get('weight_decay', 0.0))}"


def schedule(cfg: Config) -> str:
    t = _get(cfg, "training", {}) or {}
    kind, decay = t.get("schedule", "exponential"), t.get("lr_decay", 1.0)
    if kind == "exponential":
        text = "constant lr" if decay == 1 else f"lr x {_num(decay)} a round"
    elif kind == "cosine":
        text = f"cosine lr to {_num(t.get('min_lr', 0.0))}"
    elif t.get("milestones"):
        text = f"lr x {_num(decay)} at rounds {', '.join(map(_num, t['milestones']))}"
    else:
        text = f"lr x {_num(decay)} every {_num(t.get('step_size'))} rounds"
    if t.get("warmup_rounds"):
        text += f" after {_num(t['warmup_rounds'])} warm-up rounds from {_num(t.get('warmup_factor'))} x lr"
    return text


def clip(cfg: Config) -> str:
    shared, own = _get(cfg, "training.clip_grad"), _get(cfg, "algorithm.clip_grad")
    if own is not None:
        return f"gradient clip {_num(own)} (the method's own)"
    return "no gradient clip" if shared is None else f"gradient clip {_num(shared)}"


def local_work(cfg: Config) -> str:
    steps, epochs = _get(cfg, "training.steps"), _get(cfg, "training.epochs")
    work = f"{_num(steps)} local steps" if steps is not None else \
        f"{_num(epochs)} local epoch{'s' if epochs != 1 else ''}"
    return f"{work}, batch {_num(_get(cfg, 'training.batch_size'))}"


def federation(cfg: Config) -> str:
    n = _get(cfg, "partition.num_clients")
    per, frac = _get(cfg, "participation.clients_per_round"), _get(cfg, "participation.fraction")
    each = f"{_num(per)} a round" if per is not None else ("every client every round" if frac == 1 else
                                                           f"a fraction {_num(frac)} a round")
    sampling = _get(cfg, "participation.sampling", "fixed")
    how = "" if sampling == "fixed" else f" ({sampling} sampling)"
    p, group_p = _get(cfg, "participation.p", 1.0), _get(cfg, "participation.group_p")
    period = _get(cfg, "participation.period", 1)
    if group_p:
        how += f", a sampled client's reply arriving with probability {', '.join(map(_num, group_p))} by group"
    elif p is not None and p < 1:
        how += f", a sampled client's reply arriving with probability {_num(p)}"
    if (group_p or (p is not None and p < 1)) and period and period > 1:
        how += f" (drawn every {_num(period)} rounds)"
    return f"{_num(_get(cfg, 'rounds'))} rounds, {_num(n)} client{'s' if n != 1 else ''}, {each}{how}"


# data keys that say where or how the data is fetched, not what it is
_WHERE = ("name", "root", "train_size", "download", "mirrors", "verify")


def data(cfg: Config) -> str:
    d = _get(cfg, "data", {}) or {}
    size = d.get("train_size")
    text = str(d.get("name"))
    rest = ", ".join(f"{k} {_num(v)}" for k, v in d.items() if k not in _WHERE and v is not None)
    if rest:
        text += f" ({rest})"
    if size is not None:
        text += f", a seeded {_num(size)} training samples"
    return text + f", model {_get(cfg, 'model.name')}"


def partition(cfg: Config) -> str:
    p = _get(cfg, "partition", {}) or {}
    name = p.get("name")
    if name == "dirichlet":
        text = f"Dirichlet({_num(p.get('beta'))})"
        if p.get("min_size"):
            text += (f", the whole split redrawn until every client has at least {_num(p['min_size'])} "
                     f"training samples")
        return text
    if name == "pathological":
        text = f"pathological, {_num(p.get('classes_per_client'))} classes a client"
        if p.get("samples_per_client") is not None:
            text += f", {_num(p['samples_per_client'])} training samples a client"
        return text
    rest = ", ".join(f"{k} {_num(v)}" for k, v in p.items() if k not in ("name", "num_clients") and v is not None)
    return f"{name}" + (f" ({rest})" if rest else "")


def evaluation(cfg: Config) -> str:
    every = _get(cfg, "eval.every")
    text = ("evaluated every round" if every == 1 else f"evaluated every {_num(every)} rounds") if every else \
        "evaluated after the last round"
    if _get(cfg, "eval.final_all_clients"):
        text += "; personalized models over every client at the end"
    return text


# how a config says each part of the recipe, in the order a page states them
PARTS: tuple[Callable[[Config], str], ...] = (
    optimizer, schedule, clip, local_work, federation, data, partition, evaluation)


def recipe_lines(runs: Mapping[str, Iterable[Config]], what: str = "runs") -> list[str]:
    """The recipe of ``runs`` (method label -> its runs' configs): one line with each part
    as most runs have it, then, where some methods' runs differ, one line naming them with
    their values. Every word comes from the configs."""
    per: dict[str, list[Config]] = {label: list(cfgs) for label, cfgs in runs.items()}
    total = sum(len(v) for v in per.values())
    if not total:
        return []
    common, changes = [], []
    for how in PARTS:
        texts = {label: Counter(how(c) for c in cfgs) for label, cfgs in per.items() if cfgs}
        overall: Counter[str] = Counter()
        for c in texts.values():
            overall.update(c)
        main = overall.most_common(1)[0][0]
        common.append(main)
        others: dict[str, list[str]] = {}
        for label, c in texts.items():
            for text in c:
                if text != main:
                    others.setdefault(text, []).append(label)
        for text, labels in others.items():
            changes.append(f"{', '.join(sorted(labels))}: {text}")
    lines = [f"Recipe, read from the configs of the {total} {what}: " + "; ".join(common) + "."]
    if changes:
        lines.append("Where methods' runs differ from it: " + "; ".join(changes) + ".")
    return lines


# the settings each server optimizer reads (algorithms.serveropt.server_step)
_SERVER_USES = {"none": (), "avgm": ("server_momentum",), "adagrad": ("server_momentum", "server_tau"),
                "adam": ("server_momentum", "server_beta2", "server_tau"),
                "yogi": ("server_momentum", "server_beta2", "server_tau")}


def _own(alg: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a config's ``algorithm`` section that a page states: not its name,
    not its gradient clip (a part of the recipe), of the server optimizer's only those it
    reads, its step size where it is set (SCAFFOLD's global step) or the optimizer's
    default where it is null."""
    from ..algorithms.serveropt import DEFAULT_SERVER_LR

    opt = alg.get("server_opt") or "none"
    unused = {"server_momentum", "server_beta2", "server_tau"} - set(_SERVER_USES.get(opt, _SERVER_USES["adam"]))
    out = {k: v for k, v in alg.items() if k not in ("name", "clip_grad", *unused)}
    if out.get("server_lr", 0) is None:
        if opt in DEFAULT_SERVER_LR:
            out["server_lr"] = f"{DEFAULT_SERVER_LR[opt]:g} (the optimizer's default)"
        else:
            del out["server_lr"]
    return out


def _value(values: Counter[str]) -> str:
    return " / ".join(v for v, _ in values.most_common())  # runs of one method that differ: each value


def _text(x: Any) -> str:
    return "none" if x is None else _num(x)  # null, as the config file has it


def method_lines(runs: Mapping[str, Iterable[Config]]) -> list[str]:
    """Each method's own settings (its configs' ``algorithm`` section): the two settings
    of every algorithm (its weighting and its server optimizer) stated once with the value
    most methods have; then per method its own settings (a name such as mu or alpha means
    something else in each method) and where it differs from the first, with its
    algorithm's name where the label is not it."""
    per = {label: [_get(c, "algorithm", {}) or {} for c in cfgs] for label, cfgs in runs.items()}
    per = {label: algs for label, algs in per.items() if algs}
    if not per:
        return []
    texts = {label: {k: Counter(_text(_own(a).get(k)) for a in algs) for k in sorted({k for a in algs for k in _own(a)})}
             for label, algs in per.items()}
    having = Counter(k for t in texts.values() for k in t)
    common = {}
    for k in sorted(k for k, n in having.items() if n > 1 and k in ("weighting", "server_opt")):
        common[k] = Counter(_value(t[k]) for t in texts.values() if k in t).most_common(1)[0][0]
    parts = []
    for label in sorted(per):
        names = sorted({str(a.get("name")) for a in per[label]})
        own = [f"{k} {_value(v)}" for k, v in texts[label].items() if k not in common or _value(v) != common[k]]
        named = label if names == [label.lower()] else f"{label} ({', '.join(names)})"
        if own or named != label:
            parts.append(f"{named}: {', '.join(own)}" if own else named)
    head = ("every method that has them: " + ", ".join(f"{k} {v}" for k, v in common.items())
            + (", unless named" if parts else "")) if common else ""
    body = "; ".join(x for x in [head, *parts] if x)
    return [f"Methods' settings, read from the same configs (their algorithm section): {body}."] if body else []


def setting(runs: Mapping[str, Iterable[Config]], dotted: str, label: str | None = None) -> str:
    """One setting as the runs have it (of method ``label``, or of every method), for a
    page's prose. Raises ValueError where the runs hold different values or none."""
    cfgs = [c for lab, cs in runs.items() if label is None or lab == label for c in cs]
    if not cfgs:
        raise ValueError(f"{dotted}: no run" + (f" of {label}" if label else "") + " to read it from")
    missing = object()
    found = [_get(c, dotted, missing) for c in cfgs]
    values = {_text(v) for v in found if v is not missing}
    if len(values) != 1 or missing in found:
        raise ValueError(f"{dotted}" + (f" of {label}" if label else "") + " is not one value over the runs: "
                         + ", ".join(sorted(values) + (["absent"] if missing in found else [])))
    return values.pop()
