"""Model zoo: shapes, body/head split, parameter counts, input-size checks."""
from __future__ import annotations

import copy

import pytest
import torch

from protofl.models import MODELS, FLModel, build_model, num_params

B, C = 3, 10

# canonical input shape(s) per model; every registered model must be listed here
INPUTS: dict[str, list[tuple[int, ...]]] = {
    "mlp": [(1, 28, 28)],
    "mlp_mnist": [(1, 28, 28)],
    "mlp2d": [(2,)],
    "lstm_shakespeare": [(80,)],
    "conv2cifar": [(3, 32, 32), (1, 28, 28)],
    "cnn_fmnist": [(1, 28, 28), (3, 32, 32)],
    "cnn_cifar": [(3, 32, 32), (1, 28, 28)],
    "cnn_mnist": [(1, 28, 28), (3, 32, 32)],
    "simple_cnn": [(3, 32, 32), (1, 28, 28)],
    "lenet5": [(1, 28, 28), (3, 32, 32)],
    "fedavg_cnn": [(1, 28, 28), (3, 32, 32)],
    "resnet18": [(3, 32, 32)],
    "resnet18_gn": [(3, 32, 32)],
}
CONV = sorted(n for n in INPUTS if n not in {"mlp", "mlp_mnist", "mlp2d", "lstm_shakespeare"})
CASES = [(n, s) for n in sorted(INPUTS) for s in INPUTS[n]]


def _input(name: str, shape: tuple[int, ...], batch: int = B) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "lstm_shakespeare":
        return torch.randint(0, 80, (batch, *shape), generator=g)
    return torch.randn(batch, *shape, generator=g)


def _batch(name: str) -> int:
    return 2 if name.startswith("resnet18") else B


def test_every_model_is_covered():
    assert sorted(MODELS.names()) == sorted(INPUTS)


IDS = [f"{n}-{'x'.join(map(str, s))}" for n, s in CASES]


@pytest.mark.parametrize("name,shape", CASES, ids=IDS)
def test_forward_body_head_backward(name, shape):
    torch.manual_seed(0)
    n_classes = 80 if name == "lstm_shakespeare" else C
    model = build_model(name, shape, n_classes)
    assert isinstance(model, FLModel)
    assert model.num_classes == n_classes
    assert model.is_conv == (name in CONV)
    x = _input(name, shape, _batch(name))

    model.eval()  # dropout off so that the two paths agree exactly
    with torch.no_grad():
        out = model(x)
        h = model.body(x)
        assert torch.equal(model.features(x), h)
        assert torch.equal(out, model.head(h))
    assert out.shape == (x.shape[0], n_classes)
    assert h.shape == (x.shape[0], model.feature_dim)

    model.train()
    model(x).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_exact_parameter_counts():
    assert num_params(build_model("fedavg_cnn", (1, 28, 28), 10)) == 582_026
    assert num_params(build_model("lenet5", (1, 28, 28), 10)) == 44_470


def test_conv2cifar_flatten_and_unbiased_head():
    model = build_model("conv2cifar", (3, 32, 32), 10)
    fc1 = [m for m in model.body if isinstance(m, torch.nn.Linear)][0]
    assert fc1.in_features == 1600 and fc1.out_features == 384
    assert model.feature_dim == 192
    assert isinstance(model.head, torch.nn.Linear) and model.head.bias is None


def test_mlp2d_features_are_unconstrained_and_head_unbiased():
    model = build_model("mlp2d", (2,), 5)
    assert model.feature_dim == 2 and model.head.bias is None
    assert isinstance(model.body[-1], torch.nn.Linear)  # no ReLU after the last layer
    assert build_model("mlp2d", (2,), 5, feature_dim=3).body(torch.randn(4, 2)).shape == (4, 3)


def test_cnn_mnist_heterogeneous_channels():
    counts = set()
    for ch in (18, 20, 22):
        model = build_model("cnn_mnist", (1, 28, 28), 10, channels=ch)
        assert model.feature_dim == 50
        model.eval()
        assert model.body(torch.randn(2, 1, 28, 28)).shape == (2, 50)
        assert model.head.in_features == 50
        counts.add(num_params(model))
    assert len(counts) == 3
    # the authors' CNNMnist: conv1 10 channels, conv2 `channels` wide, fc1 takes 320 / 20 * channels
    for ch in (18, 20, 22):
        model = build_model("cnn_mnist", (1, 28, 28), 10, channels=ch)
        conv1, conv2 = [m for m in model.body if isinstance(m, torch.nn.Conv2d)]
        fc1 = [m for m in model.body if isinstance(m, torch.nn.Linear)][0]
        assert (conv1.out_channels, conv2.in_channels, conv2.out_channels) == (10, 10, ch)
        assert fc1.in_features == 320 // 20 * ch
    # 260 + 5,020 + 16,050 + 510 = 21,840 parameters (the paper: about 21.5 thousand)
    assert num_params(build_model("cnn_mnist", (1, 28, 28), 10)) == 21_840


@pytest.mark.parametrize("name", ["conv2cifar", "cnn_mnist", "simple_cnn", "lenet5", "fedavg_cnn"])
def test_too_small_input_raises(name):
    with pytest.raises(ValueError, match=name) as info:
        build_model(name, (1, 8, 8), 10)
    assert "(1, 8, 8)" in str(info.value) and "16x16" in str(info.value)
    # the advertised minimum does work
    model = build_model(name, (1, 16, 16), 10).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 16, 16)).shape == (2, 10)


def test_cnn_cifar_minimum_and_bad_shapes():
    with pytest.raises(ValueError, match=r"cnn_cifar.*8x8"):
        build_model("cnn_cifar", (3, 7, 7), 10)
    with pytest.raises(ValueError, match="conv2cifar"):
        build_model("conv2cifar", (784,), 10)
    with pytest.raises(ValueError, match="lstm_shakespeare"):
        build_model("lstm_shakespeare", (1, 28, 28), 10)


@pytest.mark.parametrize("name,shape", [("conv2cifar", (3, 32, 32)), ("cnn_cifar", (3, 32, 32)),
                                        ("cnn_mnist", (1, 28, 28)), ("lenet5", (1, 28, 28)),
                                        ("fedavg_cnn", (1, 28, 28)), ("resnet18_gn", (3, 32, 32)),
                                        ("resnet18", (3, 32, 32))])
def test_channels_last_matches_default_format(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, C).eval()
    x = _input(name, shape, 2)
    cl_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x)
        out = cl_model(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_resnet18_batch_and_group_norm_and_the_standard_parameter_count():
    bn = build_model("resnet18", (3, 32, 32), 10)
    gn = build_model("resnet18", (3, 32, 32), 10, norm="group", groups=4)
    # 1 stem + 2 per block x 8 blocks + 3 shortcuts = 20 norm layers, none of the other kind
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in bn.modules()) == 20
    assert not any(isinstance(m, torch.nn.GroupNorm) for m in bn.modules())
    groups = [m for m in gn.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(groups) == 20 and {m.num_groups for m in groups} == {4}
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in gn.modules())
    # the CIFAR ResNet-18's 11,173,962 parameters (10 classes); GroupNorm's affine ones as many
    assert num_params(bn) == num_params(gn) == 11_173_962
    assert isinstance(bn.body[1], torch.nn.BatchNorm2d) and isinstance(bn.body[2], torch.nn.ReLU)
    assert bn.body[0].kernel_size == (3, 3) and bn.body[0].stride == (1, 1)  # the CIFAR stem
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in bn.modules())
    assert "body.3.bn1.running_mean" in bn.state_dict() and "body.3.gn1.weight" in gn.state_dict()
    # any input size: a 1x8x8 digit goes through the three stride-2 stages to a 1x1 map
    one = build_model("resnet18", (1, 8, 8), 10).eval()
    with torch.no_grad():
        assert one.body(torch.randn(2, 1, 8, 8)).shape == (2, 512)


def test_resnet18_gn_is_resnet18_with_group_norm_weight_for_weight():
    torch.manual_seed(3)
    named = build_model("resnet18_gn", (3, 32, 32), 10).state_dict()
    torch.manual_seed(3)
    group = build_model("resnet18", (3, 32, 32), 10, norm="group").state_dict()
    assert list(named) == list(group)  # resnet18_gn's keys (gn1, gn2, shortcut.1) as they were
    assert all(torch.equal(named[k], group[k]) for k in named)
    assert "body.17.shortcut.1.weight" not in named and "body.9.shortcut.1.weight" in named


def test_resnet18_projection_gives_signed_features_of_its_width():
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 10, proj_dim=84).eval()
    assert model.feature_dim == 84 and model.head.in_features == 84
    assert isinstance(model.body[-1], torch.nn.Linear)  # the FC projection, no activation after it
    with torch.no_grad():
        h = model.body(torch.randn(2, 3, 32, 32))
    assert h.shape == (2, 84) and (h < 0).any()
    assert num_params(model) == 11_173_962 - (512 * 10 + 10) + (512 * 84 + 84) + (84 * 10 + 10)


@pytest.mark.parametrize("kwargs,match", [({"norm": "layer"}, "norm must be one of batch, group"),
                                          ({"norm": "group", "groups": 3}, "groups must divide"),
                                          ({"groups": 0}, "groups must be a positive integer"),
                                          ({"proj_dim": 0}, "proj_dim must be a positive integer")])
def test_resnet18_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model("resnet18", (3, 32, 32), 10, **kwargs)
