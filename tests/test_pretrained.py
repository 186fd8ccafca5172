"""model.pretrained: weights the test saves itself load back, before the method adapts the
model; a file that does not fit is one line, exit 2, nothing written; the fingerprint."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from protofl.api import check_task
from protofl.cli import main
from protofl.config import ConfigError, load_config
from protofl.engine.task import Task
from protofl.models import build_model
from protofl.models.pretrained import load_pretrained
from protofl.models.split import split_classifier

from conftest import DIGITS


def _equal(a: dict, b: dict, keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


def test_whole_model_weights_load_back_exactly(tmp_path):
    torch.manual_seed(0)
    saved = build_model("resnet18", (3, 32, 32), 10)  # BatchNorm: buffers too
    with torch.no_grad():  # weights (and BatchNorm statistics) no fresh model has
        for t in saved.state_dict().values():
            t.add_(0.5) if t.is_floating_point() else t.add_(7)
    torch.save(saved.state_dict(), tmp_path / "w.pt")
    torch.manual_seed(1)
    model = build_model("resnet18", (3, 32, 32), 10, pretrained=str(tmp_path / "w.pt"))
    want, got = saved.state_dict(), model.state_dict()
    assert list(got) == list(want) and _equal(got, want, want)  # BatchNorm's statistics and counters too


def test_body_weights_load_into_the_body_and_the_head_stays_as_built(tmp_path):
    torch.manual_seed(0)
    encoder = build_model("mlp_mnist", (1, 28, 28), 10)
    torch.save(encoder.body.state_dict(), tmp_path / "body.pt")  # MP-FedCL's pretrained encoder
    torch.manual_seed(5)
    fresh = build_model("mlp_mnist", (1, 28, 28), 4)
    torch.manual_seed(5)
    model = build_model("mlp_mnist", (1, 28, 28), 4, pretrained=str(tmp_path / "body.pt"))
    assert _equal(model.body.state_dict(), encoder.body.state_dict(), encoder.body.state_dict())
    assert torch.equal(model.head.weight, fresh.head.weight)  # another number of classes: its own head
    # a file of body.* keys only (the whole model less its head) loads the same way
    torch.save({k: v for k, v in encoder.state_dict().items() if k.startswith("body.")}, tmp_path / "b2.pt")
    again = build_model("mlp_mnist", (1, 28, 28), 4, pretrained=str(tmp_path / "b2.pt"))
    assert _equal(again.body.state_dict(), encoder.body.state_dict(), encoder.body.state_dict())


def test_a_split_network_takes_its_own_state_dict(tmp_path):
    def net():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(1))

    class Classifier(nn.Module):  # torchvision's layout: the last Linear in classifier[-1]
        def __init__(self):
            super().__init__()
            self.features = net()
            self.classifier = nn.Sequential(nn.Dropout(0.1), nn.Linear(4, 6))

        def forward(self, x):
            return self.classifier(self.features(x))

    torch.manual_seed(0)
    original = Classifier()
    torch.save(original.state_dict(), tmp_path / "tv.pt")  # keys features.*, classifier.1.*
    model = load_pretrained(split_classifier(Classifier(), 6), tmp_path / "tv.pt")
    assert torch.equal(model.head.weight, original.classifier[1].weight)
    assert torch.equal(model.body.features[0].weight, original.features[0].weight)


@pytest.mark.parametrize("write,match", [
    (None, "no such file"),
    (lambda p: p.mkdir(), "is a folder, not a file of weights"),
    (lambda p: (torch.save({"w": torch.zeros(64)}, p), p.write_bytes(p.read_bytes()[:200])),
     "cannot be read as weights"),  # a file cut short
    (lambda p: torch.save([torch.zeros(2)], p), "expected a state dict .* got a list"),
    (lambda p: torch.save({"model": {"w": torch.zeros(2)}}, p), "expected a state dict .* got a mapping with keys model"),
    (lambda p: torch.save(nn.Linear(2, 2), p),  # a pickled module: code, refused
     r"holds a pickled torch.nn.modules.linear.Linear, not only tensors \(torch.load with weights_only=True"),
])
def test_a_file_that_is_not_weights(tmp_path, write, match):
    path = tmp_path / "w.pt"
    if write is not None:
        write(path)
    with pytest.raises(ConfigError, match=f"model.pretrained='{path}': {match}") as info:
        build_model("mlp", (4,), 3, pretrained=str(path))
    assert "\n" not in str(info.value)


def test_weights_that_do_not_fit_name_the_first_key_and_both_shapes(tmp_path):
    torch.manual_seed(0)
    torch.save(build_model("mlp", (4,), 3, hidden=[16]).state_dict(), tmp_path / "w.pt")
    path = str(tmp_path / "w.pt")
    torch.manual_seed(0)
    fresh = build_model("mlp", (4,), 3, hidden=[8]).state_dict()
    torch.manual_seed(0)
    model = build_model("mlp", (4,), 3, hidden=[8])
    with pytest.raises(ConfigError, match=r"'body.1.weight' has shape \(16, 4\) in the file but \(8, 4\) in the model"):
        load_pretrained(model, path)
    assert _equal(model.state_dict(), fresh, fresh)  # nothing copied, not even the keys that fit
    with pytest.raises(ConfigError, match=r"'head.weight' has shape \(3, 64\) in the file but \(5, 64\) .*save "
                                          r"model.body.state_dict\(\)"):
        build_model("mlp", (4,), 5, pretrained=path, hidden=[16])
    body = build_model("mlp", (4,), 3).body.state_dict()
    torch.save(body, tmp_path / "b.pt")
    with pytest.raises(ConfigError, match="holds '1.weight', which the model has no place for"):  # into an LSTM
        build_model("lstm_shakespeare", (80,), 80, pretrained=str(tmp_path / "b.pt"))
    torch.save({k: v for k, v in body.items() if k != "3.bias"}, tmp_path / "less.pt")
    with pytest.raises(ConfigError, match="has no tensor for 'body.3.bias' .3 tensors in the file"):
        build_model("mlp", (4,), 3, pretrained=str(tmp_path / "less.pt"))
    torch.save(build_model("mlp", (4,), 3, hidden=[16]).body.state_dict(), tmp_path / "deep.pt")
    with pytest.raises(ConfigError, match="holds '3.weight', which the model has no place for"):
        build_model("mlp", (4,), 3, pretrained=str(tmp_path / "deep.pt"), hidden=[])  # one layer fewer


def test_a_run_starts_from_the_file_and_the_method_adapts_the_model_after_loading(digits_cfg, tmp_path):
    torch.manual_seed(0)
    saved = build_model("mlp", (64,), 10, hidden=[128], feature_dim=64)
    torch.save(saved.state_dict(), tmp_path / "w.pt")
    for method in ("fedavg", "fednh"):
        cfg = digits_cfg(f"model.pretrained={tmp_path / 'w.pt'}", f"algorithm.name={method}")
        task = Task.build(cfg)
        model, init = task.models("cpu").live(task.arch(0))
        want = saved.state_dict()
        assert _equal(init, want, [k for k in want if k.startswith("body.")])
        if method == "fedavg":
            assert _equal(init, want, ["head.weight", "head.bias"])
        else:  # FedNH replaces the head by its fixed prototypes after the weights are in
            assert init["head.weight"].shape == want["head.weight"].shape
            assert not torch.equal(init["head.weight"], want["head.weight"]) and "head.bias" not in init


def test_the_cli_runs_with_pretrained_weights_and_bad_files_exit_2_with_nothing_written(tmp_path, capsys):
    torch.manual_seed(0)
    torch.save(build_model("mlp", (64,), 10, hidden=[128], feature_dim=64).state_dict(), tmp_path / "w.pt")
    torch.save(build_model("mlp", (64,), 10, hidden=[32], feature_dim=64).state_dict(), tmp_path / "small.pt")
    out = tmp_path / "runs"
    base = ["run", str(DIGITS), "rounds=1", "training.epochs=1", f"output.dir={out}", "--quiet"]
    assert main(base + [f"model.pretrained={tmp_path / 'w.pt'}"]) == 0
    (run,) = out.iterdir()
    assert f"pretrained: {tmp_path / 'w.pt'}" in (run / "config.yaml").read_text()
    capsys.readouterr()
    for bad, match in ((tmp_path / "missing.pt", "no such file"),
                       (tmp_path / "small.pt", "'body.1.weight' has shape (32, 64) in the file but (128, 64)")):
        assert main(base + [f"model.pretrained={bad}", f"output.dir={tmp_path / 'bad'}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err and f"model.pretrained='{bad}'" in err
        assert not (tmp_path / "bad").exists()


def test_per_client_architectures_must_all_take_the_file(digits_cfg, tmp_path):
    torch.save(build_model("mlp", (64,), 10, hidden=[32]).body.state_dict(), tmp_path / "b.pt")
    cfg = digits_cfg("algorithm.name=fedproto", "model.per_client.hidden=[[32],[48]]",
                     f"model.pretrained={tmp_path / 'b.pt'}")
    # client 0's architecture takes it, the second one's does not: found before the run starts
    with pytest.raises(ConfigError, match=r"'1.weight' has shape \(32, 64\) in the file but \(48, 64\)"):
        check_task(cfg)


def test_pretrained_is_left_out_of_the_fingerprint_when_unset_and_enters_it_when_set():
    cfg = load_config(DIGITS)
    assert cfg.model.pretrained is None and "pretrained" not in cfg.to_dict()["model"]
    assert "pretrained" not in cfg.to_yaml()
    a = cfg.replace(**{"model.pretrained": "a.pt"})
    b = cfg.replace(**{"model.pretrained": "b.pt"})
    assert len({cfg.fingerprint(), a.fingerprint(), b.fingerprint()}) == 3
    assert a.to_dict()["model"]["pretrained"] == "a.pt"
    assert a.replace().fingerprint() == a.fingerprint()  # through the saved form and back
    assert cfg.replace(**{"model.pretrained": None}).fingerprint() == cfg.fingerprint()
