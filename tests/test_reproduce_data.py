"""`protofl reproduce --data paper | substitute`: the substitute runs keep their folders, the
paper variants are the papers' settings, the table file's paper_data (and splits) are
checked, the default rule, the two variants' pages never share a folder, Digit-5, and one
table at scale smoke on the paper's data, fetched from an HTTP server on 127.0.0.1 that
serves a small CIFAR-10 tarball in its published format (no other network)."""
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from protofl.cli import main
from protofl.config import ConfigError, load_config
from protofl.data.build import build_federated, datasets_read
from protofl.data.catalog import CATALOG
from protofl.data.dataset import Dataset
from protofl.data.datasets import DIGIT5, pool_digit5, to_image_shape
from protofl.reproduce import all_specs, collect, default_data, execute, get_spec, plan
from protofl.reproduce.render import index_text, markdown_page, read_summary
from protofl.reproduce.run import claim_out, parts_value
from protofl.reproduce.spec import load_spec, Metric

sys.path.insert(0, str(Path(__file__).parent))
from test_fetch import cifar10_tarball, Server, source_for  # noqa: E402  (the local server and tiny files)
from test_reproduce import write_spec  # noqa: E402  (a toy table on the digits)


# ---------------------------------------------------------------------------------------
# the substitute runs keep their names; the paper variants are the papers' settings
# ---------------------------------------------------------------------------------------
# sha256 (first 12 hex) of every substitute run folder of a table at a scale, one per line,
# as they were before the paper variants existed: a change would rename the folders of
# finished runs, which `protofl reproduce` then could not find again
SUBSTITUTE_RUNS = {
    "fedgela-table4/cpu": "a8b82a41cd01", "fedgela-table4/paper": "235003a27337",
    "fedgela-table5/cpu": "4ccb37caec25", "fedgela-table5/paper": "974cffda937a",
    "fednh-spiral/cpu": "70a25bed28e0", "fednh-spiral/paper": "70a25bed28e0",
    "fednh-table1/cpu": "f63cd5991f73", "fednh-table1/paper": "02cb6e7c74ad",
    # fedproto-table1's scale paper runs 200 rounds since 2026-11-26, as the authors' script
    # runs MNIST (the paper gives no count); no run of that scale had been made
    "fedproto-table1/cpu": "97803d3d7a1d", "fedproto-table1/paper": "a93c513af967",
    "mpfedcl-table5-domains/cpu": "cd2a128dbc28", "mpfedcl-table5-domains/paper": "14b49bccde92",
    # mpfedcl-table6's FedAvg runs Table VI's 110 rounds at scale cpu too since 2026-11-26
    # (its 100 had come from reusing an earlier benchmark's runs); cpu and paper are one plan
    "mpfedcl-table6/cpu": "9f5a55baeee6", "mpfedcl-table6/paper": "9f5a55baeee6",
    # ReBaFL's own rows were renamed on 2026-11-26, when prototype_memory's default became
    # false (the paper's and the authors' code's); the baselines' folders are unchanged
    "rebafl-table1/cpu": "7a4077e07f7f", "rebafl-table1/paper": "b7ae84c5c315",
}


@pytest.fixture(scope="module")
def specs():
    return all_specs()


@pytest.fixture(scope="module")
def paper_plans(specs):
    """Every table's paper variant planned at every scale (builds and validates each config)."""
    return {(name, scale): plan(spec.variant("paper"), scale) for name, spec in specs.items()
            for scale in ("smoke", "cpu", "paper")}


def test_substitute_runs_keep_their_folders(specs):
    first = {}
    for key, digest in SUBSTITUTE_RUNS.items():
        name, scale = key.split("/")
        assert specs[name].variant("substitute") is specs[name]  # the file as read
        p = plan(specs[name], scale)
        names = [str(r.dir.relative_to(p.out)) for sp in p.settings for r in sp.runs]
        assert hashlib.sha256("\n".join(names).encode()).hexdigest()[:12] == digest, key
        assert p.out == Path("runs") / "reproduce" / name / scale
        first[key] = names[0]
    assert first["fednh-table1/cpu"] == "dir0.3/Local-s0-a3ae46cf"
    assert first["mpfedcl-table5-domains/cpu"] == "domains/Local-s0-77702a5c"


def test_the_paper_variants_are_the_papers_settings(specs, paper_plans):
    def settings_of(name: str, scale: str = "paper") -> dict:
        return {sp.setting.id: sp for sp in paper_plans[(name, scale)].settings}

    nh = settings_of("fednh-table1")
    assert list(nh) == [f"{d}-dir{b}" for d in ("cifar10", "cifar100", "tinyimagenet") for b in ("0.3", "1.0")]
    c = nh["cifar10-dir0.3"].cfg
    assert (c.data.name, c.model.name, c.data.augment) == ("cifar10", "conv2cifar", {"crop": 4, "flip": True})
    assert (c.rounds, c.partition.num_clients, c.participation.fraction, c.training.epochs, c.training.batch_size) \
        == (200, 100, 0.1, 5, 64)
    assert (c.training.lr, c.training.momentum, c.training.lr_decay, c.training.weight_decay) == (0.01, 0.9, 0.99, 1e-5)
    t = nh["tinyimagenet-dir1.0"].cfg
    assert (t.model.name, t.training.weight_decay, t.partition.params["beta"]) == ("resnet18_gn", 1e-3, 1.0)
    assert nh["cifar100-dir0.3"].setting.paper == "cifar100-dir0.3"
    assert set(settings_of("fednh-table1", "cpu")) == {"cifar10-dir0.3"}
    assert paper_plans[("fednh-table1", "cpu")].out == Path("runs/reproduce/fednh-table1/paper-data/cpu")

    g4 = settings_of("fedgela-table4")  # each column the mean over its three splits
    assert set(g4) == {f"{d}-{p}" for d in ("svhn", "cifar10", "cifar100") for p in ("full", "partial")}
    betas = {sid: [pt.cfg.partition.params["beta"] for pt in sp.parts] for sid, sp in g4.items()}
    assert betas["cifar10-full"] == [10000, 0.5, 0.1] and betas["svhn-partial"] == [10000, 0.5, 0.2]
    rounds = {sid: sp.cfg.rounds for sid, sp in g4.items()}
    assert rounds == {"svhn-full": 50, "svhn-partial": 100, "cifar10-full": 50, "cifar10-partial": 100,
                      "cifar100-full": 100, "cifar100-partial": 200}
    for sid, sp in g4.items():
        c = sp.cfg
        assert (c.model.name, c.model.params["norm"]) == ("resnet18", "batch")
        assert c.model.params["proj_dim"] == (512 if sid.startswith("cifar100") else 84)
        assert c.data.augment == ({"crop": 4, "flip": True} if sid.startswith("cifar100") else {})
        full = sid.endswith("full")
        assert (c.partition.num_clients, c.participation.fraction) == ((10, 1.0) if full else (50, 0.2))
        assert (c.training.epochs, c.training.batch_size, c.training.weight_decay) == (10, 100, 1e-4)
    assert specs["fedgela-table4"].variant("paper").runs("paper") == 6 * 3 * 3 * 3
    assert "Fed-ISIC2019" in specs["fedgela-table4"].variant("paper").left_out

    g5 = settings_of("fedgela-table5")
    assert {sid: (sp.cfg.data.name, sp.cfg.partition.num_clients) for sid, sp in g5.items()} == {
        "cifar10-p10c2": ("cifar10", 10), "cifar10-p50c2": ("cifar10", 50), "svhn-p10c2": ("svhn", 10),
        "svhn-p50c2": ("svhn", 50)}
    assert {(sp.cfg.model.name, sp.cfg.model.params["proj_dim"]) for sp in g5.values()} == {("resnet18", 84)}

    rb = settings_of("rebafl-table1")
    assert {sid: (sp.cfg.data.name, sp.cfg.model.name, sp.cfg.training.lr) for sid, sp in rb.items()} == {
        "fmnist-m20": ("fmnist", "cnn_fmnist", 0.01), "fmnist-m50": ("fmnist", "cnn_fmnist", 0.01),
        "cifar10-m20": ("cifar10", "cnn_cifar", 0.02), "cifar10-m50": ("cifar10", "cnn_cifar", 0.02)}
    # the Fashion-MNIST columns are the substitute's own runs (the same configs, in the paper variant's folder)
    sub = {r.dir.name for r in plan(specs["rebafl-table1"], "paper").settings[0].runs}
    assert {r.dir.name for r in rb["fmnist-m20"].runs} == sub

    m6 = settings_of("mpfedcl-table6")
    d5 = {r.label: r.cfg for r in m6["digit5"].runs if r.seed == 0}
    assert (d5["FedAvg"].data.name, d5["FedAvg"].data.train_size, d5["FedAvg"].partition.params["beta"]) == \
        ("digit5", None, 0.05)
    assert d5["MP-FedCL"].algorithm.params["k"] == 4 and "k" not in d5["SP-FedCL"].algorithm.params
    assert {r.cfg.algorithm.params["k"] for r in m6["mnist"].runs if r.label == "MP-FedCL"} == {2}
    assert (d5["FedAvg"].model.name, d5["FedAvg"].model.params["proj_dim"]) == ("resnet18", 256)
    assert "Office-10" in specs["mpfedcl-table6"].variant("paper").left_out

    m5 = settings_of("mpfedcl-table5-domains")["digit5"].cfg
    assert datasets_read(m5) == list(DIGIT5) and datasets_read(settings_of("mpfedcl-table6")["digit5"].cfg) == \
        list(DIGIT5)
    assert m5.features.params["sources"] == list(DIGIT5) and m5.features.params["shape"] == [3, 32, 32]
    assert m5.partition.num_clients == 5
    assert [m.key for m in specs["mpfedcl-table5-domains"].variant("paper").metrics][:5] == \
        ["pa:mnist", "pa:svhn", "pa:usps", "pa:synthdigits", "pa:mnistm"]
    # the tables on the paper's data already: one variant, the same runs, the same folder
    for name in ("fedproto-table1", "fednh-spiral"):
        spec = specs[name]
        assert not spec.has_paper_data and spec.variant("paper") is spec and spec.runs_on == "paper"
        assert default_data(spec, "smoke") == ("paper", "")


def test_every_paper_variant_plans(specs, paper_plans):
    for name, spec in specs.items():
        paper = spec.variant("paper")
        if spec.has_paper_data:
            assert paper.data == "paper" and paper.substitute is None and paper.variant("substitute") is spec
        for scale in ("smoke", "cpu", "paper"):
            p = paper_plans[(name, scale)]
            assert p.num_runs == paper.runs(scale) > 0
            dirs = [r.dir for sp in p.settings for r in sp.runs]
            assert len(set(dirs)) == len(dirs)
    assert datasets_read(plan(specs["mpfedcl-table5-domains"], "smoke").settings[0].cfg) == \
        ["mnist", "femnist", "digits"]


# ---------------------------------------------------------------------------------------
# the table file: paper_data and splits
# ---------------------------------------------------------------------------------------
PAPER_DATA = {"dataset": "digits, wider", "title": "a toy table on the paper's data", "left_out": "column X",
              "config": {"model.hidden": [24]},
              "scales": {"smoke": {"config": {"rounds": 3}, "notes": "three rounds"}},
              "claims": {"c1": {"scope": "the paper's scope"}},
              "metrics": [{"id": "gm", "label": "GM"}]}


def test_paper_data_replaces_keys_merges_config_and_scales(tmp_path):
    spec = load_spec(write_spec(tmp_path, substitute="digits for digits", paper_data=PAPER_DATA))
    paper = spec.variant("paper")
    assert (spec.data, paper.data, spec.has_paper_data, paper.has_paper_data) == ("substitute", "paper", True, True)
    assert paper.substitute is None and paper.dataset == "digits, wider" and paper.left_out == "column X"
    assert paper.title == "a toy table on the paper's data" and spec.title == "a toy table"
    # config: the file's, then paper_data's on top
    assert paper.config == {**spec.config, "model.hidden": [24]}
    # scales: each key given replaces that key; the others (seeds) are the file's
    assert paper.scales["smoke"].config == {"rounds": 3} and paper.scales["smoke"].seeds == [0, 1]
    assert paper.scales["smoke"].notes == "three rounds" and paper.scales["cpu"] == spec.scales["cpu"]
    assert [c.scope for c in paper.claims] == ["the paper's scope", ""]
    assert [m.id for m in paper.metrics] == ["gm"] and [m.id for m in spec.metrics] == ["gm", "pa"]
    assert plan(paper, "smoke", out=tmp_path / "o").settings[0].cfg.model.params["hidden"] == [24]
    assert "Data: a substitute (`--data substitute`): digits for digits. `--data paper` runs the paper's: " \
           "digits, wider." == spec.data_text()
    assert paper.data_text() == "Data: the paper's own (`--data paper`)."


@pytest.mark.parametrize("change, key", [
    ({"substitute": "X for Y"}, "toy.yaml: paper_data"),
    ({"paper_data": {**PAPER_DATA, "colour": 1}}, "paper_data.colour"),
    ({"paper_data": {"title": "t"}}, "paper_data.dataset"),
    ({"paper_data": {**PAPER_DATA, "claims": {"nope": {"scope": "s"}}}}, "paper_data.claims"),
    ({"paper_data": {**PAPER_DATA, "claims": {"c1": {"kind": "best"}}}}, "paper_data.claims.c1.kind"),
    ({"paper_data": {**PAPER_DATA, "scales": {"huge": {}}}}, "paper_data.scales"),
    ({"paper_data": {**PAPER_DATA, "settings": [{"id": "s1", "label": "x", "paper": "nocol"}]}},
     r"toy.yaml \(paper_data\): settings\[0\].paper"),
    ({"settings": [{"id": "s1", "label": "x", "splits": [{"id": "a", "label": "A"}]}]}, r"settings\[0\].splits"),
    ({"settings": [{"id": "s1", "label": "x", "splits": [{"id": "a", "label": "A"}, {"id": "a", "label": "B"}]}]},
     r"settings\[0\].splits"),
    ({"settings": [{"id": "s1", "label": "x", "splits": [{"id": "../a", "label": "A"}, {"id": "b", "label": "B"}]}]},
     r"settings\[0\].splits\[0\].id"),
])
def test_a_bad_paper_data_or_split_names_the_key(tmp_path, change, key):
    with pytest.raises(ConfigError, match=key):
        load_spec(write_spec(tmp_path, **change))


def test_a_cell_over_splits_is_the_mean_of_the_split_runs(tmp_path):
    rows = [[{"round": 1, "gm": 0.5}, {"round": 2, "gm": 0.6}], [{"round": 2, "gm": 0.9}]]
    assert parts_value(rows, Metric("gm", "gm", "GM")) == pytest.approx(75.0)  # (60 + 90) / 2
    assert parts_value(rows[:1], Metric("gm", "gm", "GM")) == pytest.approx(60.0)
    assert parts_value(rows + [[{"round": 2}]], Metric("gm", "gm", "GM")) is None  # one split lacks it

    splits = [{"id": "iid", "label": "IID", "config": {"partition.name": "iid"}},
              {"id": "dir", "label": "Dir(0.5)", "config": {"partition.name": "dirichlet", "partition.beta": 0.5}}]
    spec = load_spec(write_spec(tmp_path, settings=[{"id": "s1", "label": "two splits", "paper": "col",
                                                     "splits": splits}],
                                scales={"smoke": {"seeds": [0], "config": {"rounds": 2}}, "cpu": {"seeds": [0, 1, 2]},
                                        "paper": {"seeds": [0, 1, 2]}}))
    assert spec.runs("smoke") == 3 * 2
    p = plan(spec, "smoke", out=tmp_path / "out", overrides=["execution.workers=0"])
    assert execute(p, jobs=1, log=lambda m: None, methods=["FedAvg", "FedProx"]) == []
    res = collect(p)
    for label in ("FedAvg", "FedProx"):  # each seed's value: the mean of the two splits' runs
        runs = [r for r in p.settings[0].runs if r.label == label]
        assert [r.dir.parent.name for r in runs] == ["iid", "dir"]
        finals = [[json.loads(line)["gm"] for line in (r.dir / "metrics.jsonl").read_text().splitlines()
                   if '"gm"' in line][-1] for r in runs]
        assert res.explore["s1"][label]["gm"][0] == pytest.approx(100 * sum(finals) / 2)
    assert "s1 / iid / Local / seed 0" in res.missing and "s1 / dir / Local / seed 0" in res.missing
    md = markdown_page(res, date="D", mach="M")
    assert "two splits: each cell (and each seed's value in table.csv) is the mean over the splits IID, Dir(0.5)" in md


# ---------------------------------------------------------------------------------------
# the default rule and the folders
# ---------------------------------------------------------------------------------------
def test_default_is_the_papers_data_where_it_is_present(tmp_path):
    spec = get_spec("fednh-table1")
    root = tmp_path / "data"
    data, why = default_data(spec, "smoke", [f"data.root={root}"])
    assert data == "substitute" and "\n" not in why
    assert why.startswith("protofl: fednh-table1 runs on the substitute data (Fashion-MNIST")
    assert f"cifar10 is not under {root}" in why and "`protofl data fetch cifar10`" in why and "--data paper" in why
    # scale paper reads CIFAR-100 and Tiny-ImageNet too: every one must be there
    assert "cifar10, cifar100, tinyimagenet are not under" in default_data(spec, "paper", [f"data.root={root}"])[1]
    (root / "cifar-10-batches-py").mkdir(parents=True)  # a hand-placed copy counts, as in `protofl data list`
    (root / "cifar-10-batches-py" / "test_batch").write_bytes(b"")
    assert default_data(spec, "smoke", [f"data.root={root}"]) == ("paper", "")
    assert default_data(spec, "paper", [f"data.root={root}"])[0] == "substitute"
    # a layout the catalog does not list but the loader reads (the batches right in <root>/cifar10/)
    other = tmp_path / "other" / "cifar10"
    other.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(cifar10_tarball(n=2))) as tf:
        for m in tf.getmembers():
            (other / Path(m.name).name).write_bytes(tf.extractfile(m).read())
    assert default_data(spec, "smoke", [f"data.root={other.parent}"]) == ("paper", "")
    # an override the paper's config does not take: the substitute, and why (a toy whose
    # paper data is the spiral, present always: the digits loader's option is not the spiral's)
    toy = load_spec(write_spec(tmp_path, substitute="digits for the spiral",
                               paper_data={"dataset": "the spiral", "config": {"data.name": "spiral"}}))
    assert default_data(toy, "smoke") == ("paper", "")
    data, why = default_data(toy, "smoke", ["data.test_fraction=0.3"])
    assert data == "substitute" and "\n" not in why
    assert why.startswith("protofl: toy runs on the substitute data: with --data paper, ") and "test_fraction" in why


def test_the_two_variants_never_share_a_folder(tmp_path):
    sub = plan(get_spec("fednh-table1"), "smoke", overrides=[f"output.dir={tmp_path}"])
    paper = plan(get_spec("fednh-table1", "paper"), "smoke", overrides=[f"output.dir={tmp_path}"])
    assert sub.out == tmp_path / "reproduce" / "fednh-table1" / "smoke"
    assert paper.out == tmp_path / "reproduce" / "fednh-table1" / "paper-data" / "smoke"
    claim_out(paper)
    assert json.loads((paper.out / "reproduce.json").read_text()) == {"table": "fednh-table1", "data": "paper"}
    claim_out(paper)  # the same table on the same data: fine
    mixed = plan(get_spec("fednh-table1"), "smoke", out=paper.out)
    with pytest.raises(ConfigError, match="holds fednh-table1 on the paper data; fednh-table1 on the substitute "
                                          "data needs a folder of its own"):
        claim_out(mixed)
    # a folder with a page from before pages named their data holds the substitute's
    old = tmp_path / "old"
    old.mkdir()
    (old / "table.md").write_text('# t\n<!-- protofl-reproduce {"table": "fednh-table1", "claims": []} -->\n')
    with pytest.raises(ConfigError, match="holds fednh-table1 on the substitute data"):
        claim_out(plan(get_spec("fednh-table1", "paper"), "smoke", out=old))
    claim_out(plan(get_spec("fednh-table1"), "smoke", out=old))


# ---------------------------------------------------------------------------------------
# Digit-5
# ---------------------------------------------------------------------------------------
def test_images_brought_to_one_shape_by_hand():
    x = torch.tensor([[[[0, 255], [0, 255]]]], dtype=torch.uint8)  # (1, 1, 2, 2): dark left, bright right
    y = to_image_shape(x, (3, 4, 4))
    # bilinear, align_corners=False: output column j samples x = (j + 0.5) / 2 - 0.5, clamped to
    # [0, 1]: 0, 0.25, 0.75, 1 -> 0, 63.75, 191.25, 255; grey replicated to three channels
    assert y.shape == (1, 3, 4, 4) and y[0, :, 2].tolist() == [[0, 64, 191, 255]] * 3
    rgb = torch.tensor([100, 200, 50], dtype=torch.uint8).view(1, 3, 1, 1).expand(1, 3, 8, 8).contiguous()
    assert to_image_shape(rgb, (1, 8, 8)).unique().tolist() == [153]  # 0.299*100 + 0.587*200 + 0.114*50
    assert to_image_shape(rgb, (3, 8, 8)) is rgb  # already the shape: untouched
    with pytest.raises(ValueError, match="1 or 3 channels"):
        to_image_shape(rgb, (2, 8, 8))


def fake(name, n_train, n_test, shape, first_label=0):
    g = torch.Generator().manual_seed(len(name))
    def split(n):
        return (torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8),
                (torch.arange(n) + first_label) % 10)
    (a, b), (c, d) = split(n_train), split(n_test)
    return Dataset(name, a, b, c, d, 10, info={"source": f"/{name}"})


def test_digit5_pools_the_five_domains_in_one_shape():
    parts = [fake("mnist", 12, 6, (1, 28, 28)), fake("svhn", 10, 5, (3, 32, 32), 1), fake("usps", 8, 4, (1, 16, 16), 2),
             fake("synthdigits", 9, 7, (3, 32, 32), 3), fake("mnistm", 11, 5, (3, 28, 28), 4)]
    d = pool_digit5(parts, seed=0)
    # as many from each as the smallest has (usps: 8 training, 4 test), in the order of the parts
    assert d.x_train.shape == (40, 3, 32, 32) and d.x_test.shape == (20, 3, 32, 32) and d.x_train.dtype == torch.uint8
    assert d.info["domains"] == list(DIGIT5) and (d.info["train_per_domain"], d.info["test_per_domain"]) == (8, 4)
    assert torch.equal(d.y_train[16:24], parts[2].y_train)  # usps: all of it, in order
    assert set(d.y_train[:8].tolist()) <= set(parts[0].y_train.tolist())
    assert torch.equal(d.x_train[16:24, 0], to_image_shape(parts[2].x_train, (3, 32, 32))[:, 0])
    assert len(d.mean) == 3 and torch.equal(pool_digit5(parts, seed=0).x_train, d.x_train)
    assert not torch.equal(pool_digit5(parts, seed=1).x_train[:8], d.x_train[:8])  # a seeded draw per domain
    assert pool_digit5(parts, 0, train_per_domain=5).x_train.shape[0] == 25
    with pytest.raises(ValueError, match=r"train_per_domain=9 exceeds the smallest domain \(usps: 8 samples\)"):
        pool_digit5(parts, 0, train_per_domain=9)


def test_domains_of_different_shapes_need_one_shape(monkeypatch):
    from protofl.data import features

    monkeypatch.setitem(features.DOMAIN_SOURCES, "mnist", lambda root, seed, **kw: (
        lambda d: (d.x_train, d.y_train, d.x_test, d.y_test))(fake("mnist", 12, 6, (1, 28, 28))))
    monkeypatch.setitem(features.DOMAIN_SOURCES, "svhn", lambda root, seed, **kw: (
        lambda d: (d.x_train, d.y_train, d.x_test, d.y_test))(fake("svhn", 10, 8, (3, 32, 32))))
    base = ["features.name=domains", "features.sources=[mnist,svhn]", "partition.name=iid", "partition.num_clients=2"]
    with pytest.raises(ConfigError, match=r"differ in shape \(mnist \[1, 28, 28\], svhn \[3, 32, 32\]\); give "
                                          r"features.shape"):
        build_federated(load_config(None, base))
    fed = build_federated(load_config(None, base + ["features.shape=[3,32,32]"]))
    assert fed.dataset.x_train.shape == (20, 3, 32, 32) and len(fed.dataset.mean) == 3
    assert set(fed.test_groups) == {"mnist", "svhn"} and fed.feature_group_names == ["mnist", "svhn"]
    with pytest.raises(ConfigError, match="shape must be"):
        build_federated(load_config(None, base + ["features.shape=[2,32,32]"]))


# ---------------------------------------------------------------------------------------
# one table at scale smoke on the paper's data, fetched from 127.0.0.1
# ---------------------------------------------------------------------------------------
def test_a_table_on_the_papers_data_fetched_from_a_local_server(tmp_path, monkeypatch, capsys):
    server = Server()
    try:
        monkeypatch.setitem(CATALOG, "cifar10", source_for("cifar10", server,
                                                           {"cifar-10-python.tar.gz": cifar10_tarball(n=20)}))
        path = "/pub/cifar10/cifar-10-python.tar.gz"
        # 100 training and 20 test images: 4 clients, 2 per round, two rounds, FedAvg and FedNH
        args = ["reproduce", "fednh-table1", "--scale", "smoke", "--data-dir", str(tmp_path / "data"),
                f"output.dir={tmp_path / 'runs'}", "execution.workers=0", "data.train_size=null",
                "partition.num_clients=4", "partition.min_size=5", "participation.fraction=0.5"]
        out = tmp_path / "runs" / "reproduce" / "fednh-table1" / "paper-data" / "smoke"
        # offline: the catalog's one-line error, nothing fetched, no page
        monkeypatch.setenv("PROTOFL_OFFLINE", "1")
        assert main(args + ["--data", "paper", "--methods", "FedAvg,FedNH"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "PROTOFL_OFFLINE=1" in err and "place the files by hand" in err
        assert server.requests == [] and not (out / "table.md").exists()
        # no --data: the substitute, and one line that says how to get the paper's data
        assert main(args + ["--dry-run"]) == 0
        cap = capsys.readouterr()
        assert "runs on the substitute data" in cap.err and "data: substitute" in cap.out
        # online: fetched once, verified, then the runs and the page
        monkeypatch.delenv("PROTOFL_OFFLINE")
        assert main(args + ["--data", "paper", "--methods", "FedAvg,FedNH", "--jobs", "1"]) == 0
        cap = capsys.readouterr()
        assert server.count(path) == 1 and "protofl: fetching cifar10" in cap.err
        md = (out / "table.md").read_text()
        assert md.startswith("# FedNH Table 1: FedAvg, FedNH and the PFL baselines on CIFAR-10, CIFAR-100 and "
                             "Tiny-ImageNet\n")
        assert "scale `smoke`. Data: the paper's own (`--data paper`)." in md
        assert "protofl reproduce fednh-table1 --scale smoke --data paper " in md
        summary = read_summary(out / "table.md")
        assert summary["data"] == "paper" and summary["scale"] == "smoke"
        res = collect(plan(get_spec("fednh-table1", "paper"), "smoke", out=out,
                           overrides=args[6:] + [f"data.root={tmp_path / 'data'}"]))
        ran = res.explore["cifar10-dir0.3"]
        assert set(ran) == {"FedAvg", "FedNH"} and all(v is not None for v in ran["FedNH"]["gm"].values())
        run = next(r for r in res.plan.settings[0].runs if r.label == "FedNH")
        saved = yaml.safe_load((run.dir / "config.yaml").read_text())
        assert (saved["data"]["name"], saved["model"]["name"], saved["data"]["augment"]) == \
            ("cifar10", "conv2cifar", {"crop": 4, "flip": True})
        # present now: the default is the paper's data, silently; the substitute may not use this folder
        assert main(args + ["--dry-run"]) == 0
        cap = capsys.readouterr()
        assert cap.err == "" and "data: paper" in cap.out
        assert main(args + ["--data", "substitute", "--out", str(out), "--no-run"]) == 2
        assert "holds fednh-table1 on the paper data" in capsys.readouterr().err
        # the index names each page's data and the tables whose paper-data page is still to come
        pages = tmp_path / "pages"
        pages.mkdir()
        (pages / "fednh-table1.paper-data.md").write_text(md)
        text = index_text(pages, all_specs(), tmp_path)
        assert "| [fednh-table1.paper-data](pages/fednh-table1.paper-data.md) | FedNH Table 1" in text
        assert "| `paper` | `smoke`: 0, incomplete |" in text
        assert "No page on the paper's data (`--data paper`) yet" not in text  # the others have no page at all
        assert server.count(path) == 1  # nothing fetched again
    finally:
        server.close()
