"""torchvision:<name> models: the automatic body/head split, name resolution, weights only
from torch's hub cache (never downloaded), bad input in one line.

torchvision is an optional extra (not in `all`), so the split is tested on modules built the
way torchvision builds its classifiers (our ResNet-18 under an ``fc``, a ``classifier``
Sequential, ViT's ``heads.head``, ...), and the glue to torchvision on a stand-in module
with torchvision's public API (``list_models``, ``get_model``, ``get_model_weights``,
weights enums whose builder calls ``weights.get_state_dict(progress=..., check_hash=True)``).
The tests at the end use torchvision itself and are skipped where it is not installed.
"""
from __future__ import annotations

import enum
import hashlib
import sys
import types
from collections import OrderedDict

import pytest
import torch
from torch import nn

from protofl.cli import main
from protofl.config import ConfigError, load_config
from protofl.models import MODELS, FLModel, build_model
from protofl.models.split import find_head, split_classifier

from conftest import DIGITS


# ---------------------------------------------------------------------------------------
# the split, on modules with torchvision's structure
# ---------------------------------------------------------------------------------------

class ResNetLike(nn.Module):
    """torchvision's ResNet layout: features, then ``fc`` (here our own ResNet-18's body)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = build_model("resnet18", (3, 32, 32), 2).body
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


class Trunk(nn.Module):
    """A small conv trunk and a torchvision-style ``classifier``/``head``/``heads`` at the end."""

    def __init__(self, **tail: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.tail_names = list(tail)
        for k, m in tail.items():
            setattr(self, k, m)

    def forward(self, x):
        x = self.stem(x)
        for k in self.tail_names:
            x = getattr(self, k)(x)
        return x


LAYOUTS = {  # name: (network, dotted name of its final Linear, feature_dim)
    "resnet (fc)": (lambda: ResNetLike(7), "fc", 512),
    "densenet (classifier)": (lambda: Trunk(flat=nn.Flatten(1), classifier=nn.Linear(8, 7)), "classifier", 8),
    "mobilenet (classifier[-1])": (lambda: Trunk(flat=nn.Flatten(1), classifier=nn.Sequential(
        nn.Dropout(0.2), nn.Linear(8, 7))), "classifier.1", 8),
    "convnext (classifier[-1])": (lambda: Trunk(classifier=nn.Sequential(
        nn.Flatten(1), nn.LayerNorm(8), nn.Linear(8, 7))), "classifier.2", 8),
    "swin (head)": (lambda: Trunk(flat=nn.Flatten(1), head=nn.Linear(8, 7)), "head", 8),
    "vit (heads.head)": (lambda: Trunk(flat=nn.Flatten(1), heads=nn.Sequential(OrderedDict(
        pre_logits=nn.Linear(8, 6), act=nn.Tanh(), head=nn.Linear(6, 7)))), "heads.head", 6),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_finds_the_final_linear_and_keeps_the_network_function(layout):
    make, path, dim = LAYOUTS[layout]
    torch.manual_seed(0)
    net = make().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = net(x)
    keys = list(net.state_dict())
    name, linear = find_head(net)
    assert name == path and isinstance(linear, nn.Linear)
    model = split_classifier(net, 7)  # as many classes as the network had: its own Linear is the head
    assert isinstance(model, FLModel) and model.head is linear and model.body is net
    assert model.feature_dim == dim and model.source_head == path
    with torch.no_grad():
        h = model.body(x)
        assert h.shape == (2, dim)
        assert torch.equal(model(x), ref) and torch.equal(model.head(h), ref)
    # the body's keys are the network's, less its head's
    assert list(model.body.state_dict()) == [k for k in keys if not k.startswith(path + ".")]


def test_split_with_other_classes_gives_a_fresh_head_with_the_same_bias_setting():
    net = Trunk(flat=nn.Flatten(1), classifier=nn.Sequential(nn.Tanh(), nn.Linear(8, 1000, bias=False)))
    model = split_classifier(net, 10)  # MaxViT's last Linear has no bias
    assert model.head.in_features == 8 and model.head.out_features == 10 and model.head.bias is None
    assert model.num_classes == 10 and model.body.classifier[1].__class__ is nn.Flatten
    biased = split_classifier(ResNetLike(1000), 10)
    assert biased.head.out_features == 10 and biased.head.bias is not None


@pytest.mark.parametrize("net,found", [
    (Trunk(classifier=nn.Sequential(nn.Dropout(), nn.Conv2d(8, 7, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))),
     "classifier ends in AdaptiveAvgPool2d"),  # SqueezeNet's
    (Trunk(fc=nn.Identity()), "fc is a Identity"),
    (Trunk(out=nn.Linear(8, 7)), "cannot be split"),
])
def test_a_network_without_a_final_linear_under_the_known_names_is_refused(net, found):
    with pytest.raises(ValueError, match=found) as info:
        split_classifier(net, 7)
    assert "fc, classifier, classifier[-1], head or heads[-1]" in str(info.value)


# ---------------------------------------------------------------------------------------
# the glue to torchvision, on a stand-in with its public API
# ---------------------------------------------------------------------------------------

class Tiny(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 4, in_channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


class StandInWeightsEnum(enum.Enum):
    """torchvision's WeightsEnum: a member carries its url and meta; get_state_dict downloads."""

    @property
    def url(self):
        return self.value[0]

    @property
    def meta(self):
        return {"categories": [f"c{i}" for i in range(self.value[1])]}

    def get_state_dict(self, *args, **kwargs):
        raise AssertionError("torchvision would download the weights here")

    def __repr__(self):
        return f"{type(self).__name__}.{self.name}"


def stand_in_torchvision(url: str) -> types.ModuleType:
    weights = StandInWeightsEnum("Tiny_Weights", [("IMAGENET1K_V1", (url, 5)), ("DEFAULT", (url, 5))])

    def tiny(*, weights=None, progress=True, **kwargs):  # as torchvision's _resnet does
        if weights is not None:
            kwargs["num_classes"] = len(weights.meta["categories"])
        model = Tiny(**kwargs)
        if weights is not None:
            model.load_state_dict(weights.get_state_dict(progress=progress, check_hash=True))
        return model

    builders = {"tiny": tiny}
    models = types.ModuleType("torchvision.models")
    models.list_models = lambda module=None: sorted(builders)
    models.get_model = lambda name, **config: builders[name](**config)
    models.get_model_weights = lambda name: weights
    tv = types.ModuleType("torchvision")
    tv.models = models
    return tv


@pytest.fixture
def torchvision(tmp_path, monkeypatch):
    """The stand-in as ``torchvision``; weights whose hash-named file the test writes into a
    fresh torch hub cache (TORCH_HOME) with ``publish``."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    torch.manual_seed(1)
    published = {k: v.clone() for k, v in Tiny(num_classes=5).state_dict().items()}
    blob = tmp_path / "blob.pth"
    torch.save(published, blob)
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    name = f"tiny-{digest[:8]}.pth"
    tv = stand_in_torchvision(f"https://download.example.org/models/{name}")
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", tv.models)
    cache = tmp_path / "torch" / "hub" / "checkpoints"

    def publish(data: bytes | None = None):
        cache.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(blob.read_bytes() if data is None else data)
        return cache / name

    return types.SimpleNamespace(module=tv, published=published, publish=publish, file=cache / name)


def test_a_torchvision_model_by_name_is_split_and_takes_its_own_parameters(torchvision):
    torch.manual_seed(0)
    model = build_model("torchvision:tiny", (3, 16, 16), 10, width=6)
    assert model.feature_dim == 6 and model.head.out_features == 10 and model.source_head == "fc"
    assert model.head.in_features == 6 and isinstance(model.body.fc, nn.Flatten)
    with torch.no_grad():
        assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    assert "torchvision:tiny" in MODELS and "torchvision:tinny" not in MODELS
    cfg = load_config(DIGITS, ["model.name=torchvision:tiny", "model.in_channels=1"])
    assert cfg.model.params == {"weights": None, "in_channels": 1}  # passed on to torchvision


def test_torchvision_weights_come_from_the_hub_cache_and_are_never_downloaded(torchvision):
    weights = torchvision.module.models.get_model_weights("tiny")
    with pytest.raises(ConfigError, match="not in torch's hub cache") as info:
        build_model("torchvision:tiny", (3, 16, 16), 10, weights="IMAGENET1K_V1")
    msg = str(info.value)
    assert "https://download.example.org/models/tiny-" in msg and str(torchvision.file) in msg and "\n" not in msg
    torchvision.publish()
    for name in ("IMAGENET1K_V1", "DEFAULT", "Tiny_Weights.IMAGENET1K_V1"):
        model = build_model("torchvision:tiny", (3, 16, 16), 10, weights=name)
        body = model.body.state_dict()
        assert all(torch.equal(body[k], torchvision.published[k]) for k in ("conv.weight", "conv.bias"))
        assert model.head.out_features == 10  # 5 categories in the weights, 10 classes here: a fresh head
    same = build_model("torchvision:tiny", (3, 16, 16), 5, weights="DEFAULT")  # the weights' own classes
    assert torch.equal(same.head.weight, torchvision.published["fc.weight"])
    with pytest.raises(AssertionError, match="would download"):  # the stand-in's method is back
        weights.IMAGENET1K_V1.get_state_dict(progress=False)


def test_bad_torchvision_weights_are_one_line_errors(torchvision):
    with pytest.raises(ConfigError, match="has the weights IMAGENET1K_V1, DEFAULT"):
        build_model("torchvision:tiny", (3, 16, 16), 10, weights="IMAGENET21K")
    torchvision.publish(b"not the published bytes")
    with pytest.raises(ConfigError, match="is not the published file of Tiny_Weights.IMAGENET1K_V1") as info:
        build_model("torchvision:tiny", (3, 16, 16), 10, weights="IMAGENET1K_V1")
    assert "download https://download.example.org/models/tiny-" in str(info.value)


def test_bad_torchvision_parameters_and_inputs(torchvision):
    with pytest.raises(ConfigError, match=r"torchvision's tiny refuses these parameters: TypeError: .*depth"):
        build_model("torchvision:tiny", (3, 16, 16), 10, depth=3)
    with pytest.raises(ConfigError, match="model.num_classes=4: set by protofl"):
        load_config(DIGITS, ["model.name=torchvision:tiny", "model.num_classes=4"])
    with pytest.raises(ConfigError, match="model.progress=True: protofl never downloads"):
        build_model("torchvision:tiny", (3, 16, 16), 10, progress=True)
    with pytest.raises(ValueError, match=r"torchvision's tiny cannot take inputs of shape \(1, 16, 16\)"):
        build_model("torchvision:tiny", (1, 16, 16), 10)


def test_unknown_torchvision_names_exit_2_with_close_matches(torchvision, tmp_path, capsys):
    with pytest.raises(ConfigError, match="torchvision has no classification model 'tiney'; close matches: tiny"):
        load_config(DIGITS, ["model.name=torchvision:tiney"])
    out = tmp_path / "runs"
    assert main(["run", str(DIGITS), "model.name=torchvision:tiney", f"output.dir={out}", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "close matches: tiny" in err
    assert not out.exists()  # nothing written


def test_a_run_with_a_torchvision_model(torchvision, tmp_path, capsys):
    args = ["run", str(DIGITS), "model.name=torchvision:tiny", "model.in_channels=1", "rounds=1",
            "training.epochs=1", f"output.dir={tmp_path}", "--quiet"]
    assert main(args) == 0
    assert main(args[:3] + ["model.in_channels=3"] + args[4:]) == 2  # 3 channels on 1-channel digits
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchvision's tiny cannot take inputs of shape (1, 8, 8)" in err


def test_without_torchvision_the_error_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision fails
    monkeypatch.delitem(sys.modules, "torchvision.models", raising=False)
    assert main(["run", str(DIGITS), "model.name=torchvision:resnet18", f"output.dir={tmp_path}", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "model.name='torchvision:resnet18': needs torchvision: install the torchvision build of your torch" in err
    assert "torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu" in err  # the CPU build's pair


def test_protofl_list_shows_how_to_name_a_torchvision_model(capsys):
    assert main(["list"]) == 0
    (models,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("models:")]
    assert "resnet18, resnet18_gn" in models and "torchvision:<name>" in models and "e.g. torchvision:resnet18" in models


# ---------------------------------------------------------------------------------------
# torchvision itself (the `torchvision` extra; skipped without it)
# ---------------------------------------------------------------------------------------

def _real_torchvision():
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a build that does not match torch
        pytest.skip("torchvision is not installed (the `torchvision` extra, outside `all`)")


@pytest.mark.parametrize("name,dim,path", [("resnet18", 512, "fc"), ("mobilenet_v3_small", 1024, "classifier.3"),
                                           ("efficientnet_b0", 1280, "classifier.1"),
                                           ("densenet121", 1024, "classifier")])
def test_real_torchvision_models_split(name, dim, path):
    _real_torchvision()
    torch.manual_seed(0)
    model = build_model(f"torchvision:{name}", (3, 32, 32), 10)
    assert model.feature_dim == dim and model.source_head == path and model.head.out_features == 10
    model.eval()
    with torch.no_grad():
        assert model.body(torch.randn(2, 3, 32, 32)).shape == (2, dim)


def test_real_torchvision_unknown_name_and_uncached_weights(tmp_path, monkeypatch):
    _real_torchvision()
    with pytest.raises(ConfigError, match="close matches: resnet18"):
        load_config(DIGITS, ["model.name=torchvision:resnet19"])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"ResNet18_Weights.IMAGENET1K_V1 is not in torch's hub cache"):
        build_model("torchvision:resnet18", (3, 32, 32), 10, weights="IMAGENET1K_V1")
    assert not any(tmp_path.rglob("*.pth"))  # nothing downloaded
