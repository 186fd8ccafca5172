"""What a prototype leaks: inverting class prototypes of a few samples, with and without DP.

A server that knows the feature map a client used (FedNH, MP-FedCL and ReBaFL send their
weights beside their prototypes; FedProto does not, so its rows assume an attacker who holds
the map anyway) receives the client's class prototype: the mean feature of
its n samples of a class. How much of those n images can it rebuild? The probe
(``protofl.nn.inversion.invert_features``: feature matching with a total-variation prior,
Mahendran & Vedaldi, CVPR 2015) inverts each prototype and compares the result with

* the mean image of the n samples behind the prototype ("own"), and
* the mean image of n other samples of the same class ("other"): what knowing the class
  alone would give.

The leak is the gap: corr(x^, own) - corr(x^, other) (Pearson correlation over pixels),
paired over the cases. The noisy rows release the prototype as ``privacy.mode: sample``
does (``protofl.nn.privacy.private_class_means``: features clipped to C, Gaussian noise on
the class's sum and count, from a secret SHAKE-256 stream) at the noise multiplier sigma
with which one such release spends epsilon at delta 1e-5 (dp-accounting's RDP accountant,
as the engine's). That epsilon is the release's alone: here the feature map was trained
on the victims without privacy, which no guarantee covers (``privacy.mode: sample``
trains it by DP-SGD and accounts for both); the rows measure what that noise hides from
this attack. A run releases once a round, so its sigma at the same total epsilon is
larger: one release is the attacker's best case.

Setting: Fashion-MNIST; cnn_fmnist trained centrally for one epoch on the training images
(SGD lr 0.01, momentum 0.9, batch 64; the "global model" the server knows); the victim's
samples drawn from those training images (the model was trained on them), the "other"
samples too. Two feature maps: FedProto's (the body's raw ReLU features, clip 5) and
FedNH's (unit-normalized features, clip 1). Per feature map, epsilon (none, 8, 1) and n
(1, 4, 16, 64): 10 classes x ``--trials`` draws.

    python benchmarks/privacy/inversion.py --data-dir DATA \
        --records benchmarks/privacy/records/inversion.jsonl.gz     # inversion.md, inversion.png
    python benchmarks/privacy/inversion.py --no-run \
        --records benchmarks/privacy/records/inversion.jsonl.gz     # both again, from the records alone

Results: ``inversion.md`` and ``inversion.png`` in --results (default this folder). The
page and the figure are made from the measurement's records alone (``render``): what was
measured and how (the settings, the machine and date, the command and its minutes), every
case's two correlations per feature map and epsilon, and the figure's images (8-bit grey
over the inputs' range). ``--records FILE`` writes them as one gzip file of JSON lines;
``--no-run --records FILE`` makes the page and the figure from that file, and a test
rebuilds the committed page from its committed records word for word.
"""
from __future__ import annotations

import argparse
import base64
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from harness import header, read_json_lines, shown_command, write_json_lines  # noqa: E402

DELTA = 1e-5
MAPS = {  # label: (features of the body's output, the feature clip C of the release)
    "FedProto (raw features, C = 5)": (lambda z: z, 5.0),
    "FedNH (unit features, C = 1)": (lambda z: F.normalize(z, dim=1), 1.0),
}


def sigma_for(epsilon: float, delta: float = DELTA) -> float:
    """The noise multiplier of one Gaussian release that spends ``epsilon`` at ``delta``."""
    from protofl.engine.privacy import Accountant, smallest_sigma

    acc = Accountant("rdp", delta)
    return smallest_sigma(lambda sigma: acc.epsilon({("gaussian", sigma): 1}), epsilon, rel=0.001)


def corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise Pearson correlation of (B, ...) a and b over their entries."""
    a, b = a.flatten(1), b.flatten(1)
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp(min=1e-12)


def train_body(ds, seed: int, epochs: int):
    from protofl.models.zoo import build_model

    torch.manual_seed(seed)
    model = build_model("cnn_fmnist", tuple(ds.x_train.shape[1:]), ds.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(ds.y_train), generator=g)
        for i in range(0, len(order), 64):
            idx = order[i:i + 64]
            opt.zero_grad()
            F.cross_entropy(model(ds.normalize(ds.x_train[idx])), ds.y_train[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(ds.normalize(ds.x_test)).argmax(1) == ds.y_test).float().mean().item()
    return model, acc


def measure(args: argparse.Namespace, command: str) -> list[dict]:
    """Train the feature map, release every case's prototype per feature map and epsilon,
    invert it, and return the records: one ``meta`` line, one ``release`` line per
    (feature map, epsilon) with every case's corr(x^, own) and corr(x^, other), and one
    ``figure`` line (FedNH's map, one case per class at the smallest n, trial 0)."""
    from protofl.data.datasets import load_dataset
    from protofl.engine.privacy import new_secret
    from protofl.nn.inversion import invert_features
    from protofl.nn.privacy import NoiseStream, private_class_means

    sizes = [int(s) for s in args.sizes.split(",")]
    epsilons = [math.inf] + [float(e) for e in args.epsilons.split(",")]
    t0 = time.perf_counter()
    torch.set_num_threads(1)

    ds = load_dataset("fmnist", args.data_dir, args.seed)
    model, test_acc = train_body(ds, args.seed, args.epochs)
    x_all = ds.normalize(ds.x_train)  # the victims: images the feature map was trained on
    low, high = float(x_all.min()), float(x_all.max())
    rng = np.random.default_rng(args.seed)
    by_class = [np.flatnonzero(ds.y_train.numpy() == c) for c in range(ds.num_classes)]
    # the cases: (size, class, trial) -> n own samples and n other samples of that class
    cases = [(n, c, t) for n in sizes for c in range(ds.num_classes) for t in range(args.trials)]
    own, other = [], []
    for n, c, _ in cases:
        pick = rng.choice(by_class[c], 2 * n, replace=False)
        own.append(torch.as_tensor(pick[:n]))
        other.append(torch.as_tensor(pick[n:]))
    own_mean = torch.stack([x_all[i].mean(0) for i in own])
    other_mean = torch.stack([x_all[i].mean(0) for i in other])
    groups = torch.cat([torch.full((len(i),), k) for k, i in enumerate(own)])
    samples = torch.cat(own)
    with torch.no_grad():
        z_raw = model.body(x_all[samples])

    releases, shown = [], {}
    for label, (feat, clip) in MAPS.items():
        z = feat(z_raw)
        for eps in epsilons:
            sigma = 0.0 if math.isinf(eps) else sigma_for(eps)
            gen = NoiseStream(new_secret(), ("inversion", label, eps))  # secret noise, as a client draws it
            protos, _ = private_class_means(z, groups, len(cases), clip if sigma else math.inf, sigma, gen)
            x_hat = invert_features(lambda x: feat(model.body(x)), protos, torch.zeros_like(own_mean),
                                    steps=args.steps, lr=args.lr, tv=args.tv, low=low, high=high,
                                    modules=(model,))
            shown[(label, eps)] = x_hat
            releases.append({"kind": "release", "map": label, "epsilon": None if math.isinf(eps) else eps,
                             "sigma": sigma, "own": corr(x_hat, own_mean).tolist(),
                             "other": corr(x_hat, other_mean).tolist()})
    nh = list(MAPS)[1]
    picks = [k for k, (n, _, t) in enumerate(cases) if n == min(sizes) and t == 0]
    rows = [("own", own_mean)] + [("x^, " + ("no DP" if math.isinf(e) else f"ε = {e:g}"), shown[(nh, e)])
                                  for e in epsilons]
    figure = {"kind": "figure", "map": nh, "n": min(sizes), "rows": [
        {"name": name, "images": [grey(imgs[k, 0], low, high) for k in picks]} for name, imgs in rows]}
    meta = {"kind": "meta", "measured": header().rstrip(), "command": command,
            "minutes": round((time.perf_counter() - t0) / 60, 1), "test_acc": test_acc,
            "classes": ds.num_classes, "cases": cases, "delta": DELTA,
            "settings": {k: getattr(args, k) for k in ("seed", "trials", "epochs", "steps", "lr", "tv")}}
    return [meta, *releases, figure]


def grey(img: torch.Tensor, low: float, high: float) -> dict:
    """One image as the figure shows it: 8-bit grey over [low, high], base64 of its bytes."""
    q = ((img.clamp(low, high) - low) / (high - low) * 255).round().to(torch.uint8).numpy()
    return {"shape": list(q.shape), "b64": base64.b64encode(q.tobytes()).decode()}


def ungrey(img: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(img["b64"]), dtype=np.uint8).reshape(img["shape"])


def read_records(path: Path) -> list[dict]:
    """The records of one measurement, checked: one meta line, one figure line, one release
    line per (feature map, epsilon) with a pair of correlations for every case."""
    def refuse(why: str) -> SystemExit:
        return SystemExit(f"{path}: not the records of inversion.py ({why})")

    try:
        records = read_json_lines(path)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        raise refuse(f"unreadable: {e}") from None
    if not all(isinstance(r, dict) for r in records):
        raise refuse("a line that is no mapping")
    kinds = [r.get("kind") for r in records]
    if kinds.count("meta") != 1 or kinds.count("figure") != 1 or "release" not in kinds:
        raise refuse("one meta, releases, one figure")
    meta = next(r for r in records if r["kind"] == "meta")
    missing = {"measured", "command", "minutes", "test_acc", "classes", "cases", "delta", "settings"} - set(meta)
    if missing:
        raise refuse(f"meta without {', '.join(sorted(missing))}")
    n = len(meta["cases"])
    if n != meta["settings"].get("trials", 0) * meta["classes"] * len({c[0] for c in meta["cases"]}):
        raise refuse(f"{n} cases for trials x classes x sizes")
    seen = set()
    for r in (r for r in records if r["kind"] == "release"):
        key = (r.get("map"), r.get("epsilon"))
        if key in seen or not (len(r.get("own", ())) == len(r.get("other", ())) == n) or "sigma" not in r:
            raise refuse(f"release {key}: repeated, or not a sigma and a pair of correlations for each of {n} cases")
        seen.add(key)
    for row in next(r for r in records if r["kind"] == "figure").get("rows", []):
        for img in row.get("images", []):
            if len(base64.b64decode(img["b64"])) != int(np.prod(img["shape"])):
                raise refuse("a figure image whose bytes do not fill its shape")
    return records


def render(records: list[dict], results: Path) -> str:
    """The page and the figure from the records alone; returns the page's text."""
    from protofl.report.plots import _plt, _save
    from protofl.report.tables import markdown
    from protofl.reproduce import stats

    meta = next(r for r in records if r["kind"] == "meta")
    figure = next(r for r in records if r["kind"] == "figure")
    cfg = meta["settings"]
    sizes = sorted({n for n, _, _ in meta["cases"]})
    head = ["features", "ε (one release)", "σ", "n", "corr(x^, own)", "corr(x^, other)", "leak: the gap",
            "gap > 0: p"]
    table = []
    for rel in (r for r in records if r["kind"] == "release"):
        r_own, r_other = np.array(rel["own"]), np.array(rel["other"])
        for n in sizes:
            rows = [k for k, case in enumerate(meta["cases"]) if case[0] == n]
            a, b = r_own[rows], r_other[rows]
            d = stats.paired((a - b).astype(np.float64))
            table.append([rel["map"], "none" if rel["epsilon"] is None else f"{rel['epsilon']:g}",
                          f"{rel['sigma']:.3g}", str(n),
                          f"{a.mean():.3f} ± {a.std(ddof=1):.3f}", f"{b.mean():.3f} ± {b.std(ddof=1):.3f}",
                          f"{d.mean:+.3f} (90 % CI {d.ci90[0]:+.3f} to {d.ci90[1]:+.3f})", f"{d.p_for:.2g}"])
    plt = _plt()
    rows = figure["rows"]
    fig, axes = plt.subplots(len(rows), len(rows[0]["images"]), figsize=(1.2 * len(rows[0]["images"]),
                                                                        1.3 * len(rows)), squeeze=False)
    for i, row in enumerate(rows):
        for j, img in enumerate(row["images"]):
            ax = axes[i][j]
            ax.imshow(ungrey(img), cmap="gray", vmin=0, vmax=255)
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(row["name"], fontsize=7)
    fig.suptitle(f"{figure['map']}: one sample's prototype inverted (n = {figure['n']})", fontsize=8)
    results.mkdir(parents=True, exist_ok=True)
    _save(fig, results / "inversion.png")
    return ("## What a prototype leaks: inversion with and without DP (Fashion-MNIST, cnn_fmnist)\n\n"
            + f"{meta['measured']} Written by `{meta['command']}` in {meta['minutes']:.1f} min. The feature map: "
              f"cnn_fmnist after {cfg['epochs']} central epoch(s), test accuracy {100 * meta['test_acc']:.2f} %. "
              f"Inversion: {cfg['steps']} Adam steps, lr {cfg['lr']:g}, TV weight {cfg['tv']:g}, from the mean "
              f"image; {cfg['trials']} draws x {meta['classes']} classes per row, seed {cfg['seed']}. The page "
              "and the figure are made from the measurement's records alone "
              "(`python benchmarks/privacy/inversion.py --no-run --records RECORDS` makes them again)."
            + "\n\n"
            + markdown(head, table)
            + "\nThe victims are training images of the feature map. own: the mean image of the n samples "
              "behind the prototype; other: of n other training samples of the same class. The gap (paired over "
              "the cases, one-sided t-test p) is what the prototype tells about its own samples beyond their "
              f"class. σ: the noise multiplier with which one release spends the ε (δ = {meta['delta']:g}), noise drawn "
              "from a secret key; the ε is the release's alone (this feature map was trained on the victims "
              "without privacy, which no guarantee covers: privacy.mode: sample trains it by DP-SGD and accounts "
              "for both). A run releases every round, so its σ at the same total ε is larger. Figure: "
              "inversion.png.\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA"), help="folder holding fashion-mnist/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=5, help="draws per class and size")
    p.add_argument("--sizes", default="1,4,16,64", help="samples behind a prototype")
    p.add_argument("--epsilons", default="8,1", help="one release's epsilon (besides no noise)")
    p.add_argument("--epochs", type=int, default=1, help="central training epochs of the feature map")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--tv", type=float, default=0.05, help="weight of the total-variation prior")
    p.add_argument("--results", default=str(HERE))
    p.add_argument("--records", help="gzip JSON lines of the measurement: written after it, or read with --no-run")
    p.add_argument("--no-run", action="store_true", help="make the page and the figure from --records alone")
    args = p.parse_args()
    if args.no_run:
        if not args.records:
            p.error("--no-run needs --records")
        records = read_records(Path(args.records))
    else:
        command = shown_command("benchmarks/privacy/inversion.py", sys.argv[1:],
                                {"--data-dir": "DATA", "--results": "RESULTS", "--records": "RECORDS"})
        records = measure(args, command)
        if args.records:
            write_json_lines(Path(args.records), records)
    text = render(records, Path(args.results))
    (Path(args.results) / "inversion.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
