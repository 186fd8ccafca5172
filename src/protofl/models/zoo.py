"""The model zoo. Each builder: ``(input_shape, num_classes, **kwargs) -> FLModel``."""
from __future__ import annotations

import math
from typing import Any, Callable, Literal, Optional, Sequence

from torch import nn

from ..registry import Registry
from . import torchvision_models
from .base import FLModel
from .pretrained import load_pretrained

MODELS: Registry = Registry("model", "protofl.models")
MODELS.add_prefix(torchvision_models.PREFIX, torchvision_models.resolve, torchvision_models.USAGE)


def build_model(name: str, input_shape: Sequence[int], num_classes: int, pretrained: Optional[str] = None,
                **kwargs) -> FLModel:
    """The registered model ``name`` for these inputs and classes; ``pretrained``: a file of
    weights (``model.pretrained``) loaded into it before any method adapts it."""
    model = MODELS.get(name)(tuple(input_shape), int(num_classes), **kwargs)
    if pretrained is not None:
        load_pretrained(model, pretrained)
    return model


@MODELS.register("mlp")
def mlp(input_shape, num_classes, hidden: Sequence[int] = (128,), feature_dim: int = 64) -> FLModel:
    """Generic MLP: flatten -> hidden layers (ReLU) -> feature_dim (ReLU) -> linear head."""
    d_in = math.prod(input_shape)
    layers: list[nn.Module] = [nn.Flatten()]
    for h in list(hidden) + [feature_dim]:
        layers += [nn.Linear(d_in, h), nn.ReLU()]
        d_in = h
    return FLModel(nn.Sequential(*layers), nn.Linear(feature_dim, num_classes), feature_dim, num_classes)


# ---------------------------------------------------------------------------------------
# helpers: input-shape checks and flatten sizes for conv stacks
# ---------------------------------------------------------------------------------------

def _image_shape(name: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    """``input_shape`` as ``(C, H, W)``; a ValueError naming the model otherwise."""
    shape = tuple(input_shape)
    if len(shape) != 3 or any(int(s) != s or s < 1 for s in shape):
        raise ValueError(f"model {name!r} needs an image input_shape (C, H, W); got {shape}")
    return int(shape[0]), int(shape[1]), int(shape[2])


def pair(v: Any) -> tuple[int, int]:
    """A 2-d convolution or pooling argument (an int, or a tuple or list of two) as (height, width)."""
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _spatial_out(n: int, layers: Sequence[nn.Module], axis: int) -> int:
    """Size along one spatial axis (0 = H, 1 = W) after ``layers``; 0 when some layer
    would get an empty or too small input. Only Conv2d / MaxPool2d / AvgPool2d change it."""
    for m in layers:
        if isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            k = pair(m.kernel_size)[axis]
            s = pair(m.stride if m.stride is not None else m.kernel_size)[axis]
            if m.padding == "same":  # a conv with padding="same" keeps the size
                continue
            p = 0 if m.padding == "valid" else pair(m.padding)[axis]
            d = pair(getattr(m, "dilation", 1))[axis]
            if getattr(m, "ceil_mode", False):
                n = -((n + 2 * p - d * (k - 1) - 1) // -s) + 1
            else:
                n = (n + 2 * p - d * (k - 1) - 1) // s + 1
            if n < 1:
                return 0
    return n


def _flat_dim(name: str, input_shape: Sequence[int], layers: Sequence[nn.Module],
              out_channels: int) -> int:
    """Flattened size after the conv/pool stack ``layers``; a ValueError that names the
    model, the input shape and the smallest input it accepts when the input is too small."""
    _, h, w = _image_shape(name, input_shape)
    h_out, w_out = _spatial_out(h, layers, 0), _spatial_out(w, layers, 1)
    if h_out < 1 or w_out < 1:
        min_h = next(n for n in range(1, 1 << 16) if _spatial_out(n, layers, 0) >= 1)
        min_w = next(n for n in range(1, 1 << 16) if _spatial_out(n, layers, 1) >= 1)
        raise ValueError(
            f"model {name!r} needs inputs of at least {min_h}x{min_w} pixels (H x W); "
            f"input_shape {tuple(input_shape)} is too small"
        )
    return out_channels * h_out * w_out


def _positive(name: str, **values: int) -> None:
    for key, v in values.items():
        if int(v) != v or v < 1:
            raise ValueError(f"model {name!r}: {key} must be a positive integer; got {v!r}")


# ---------------------------------------------------------------------------------------
# small CNNs
# ---------------------------------------------------------------------------------------

@MODELS.register("conv2cifar")
def conv2cifar(input_shape: tuple, num_classes: int) -> FLModel:
    """FedNH's Conv2Cifar (FedNH paper, Listing 1).

    body: Conv2d(C, 64, 5) -> ReLU -> MaxPool2d(2) -> Conv2d(64, 64, 5) -> ReLU ->
    MaxPool2d(2) -> Flatten (1600 for 3x32x32) -> Linear(., 384) -> ReLU ->
    Linear(384, 192) -> ReLU; feature_dim 192.
    head: Linear(192, num_classes, bias=False). Needs at least 16x16 inputs.
    """
    c = _image_shape("conv2cifar", input_shape)[0]
    convs = [nn.Conv2d(c, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(64, 64, 5), nn.ReLU(), nn.MaxPool2d(2)]
    flat = _flat_dim("conv2cifar", input_shape, convs, 64)
    body = nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 384), nn.ReLU(),
                         nn.Linear(384, 192), nn.ReLU())
    return FLModel(body, nn.Linear(192, num_classes, bias=False), 192, num_classes, is_conv=True)


@MODELS.register("cnn_fmnist")
def cnn_fmnist(input_shape: tuple, num_classes: int) -> FLModel:
    """ReBaFL's CNN for (Fashion-)MNIST.

    body: Conv2d(C, 16, 5, padding=2) -> ReLU -> MaxPool2d(2) ->
    Conv2d(16, 32, 5, padding=2) -> ReLU -> MaxPool2d(2) -> Flatten (32*7*7 = 1568 for
    1x28x28, 2048 for 32x32) -> Linear(., 128) -> ReLU; feature_dim 128.
    head: Linear(128, num_classes). The "same" padding keeps the conv sizes simple; the
    only size limit is the two pools (at least 4x4 inputs).
    """
    c = _image_shape("cnn_fmnist", input_shape)[0]
    convs = [nn.Conv2d(c, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)]
    flat = _flat_dim("cnn_fmnist", input_shape, convs, 32)
    body = nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 128), nn.ReLU())
    return FLModel(body, nn.Linear(128, num_classes), 128, num_classes, is_conv=True)


@MODELS.register("cnn_cifar")
def cnn_cifar(input_shape: tuple, num_classes: int) -> FLModel:
    """ReBaFL's CNN for CIFAR: ``cnn_fmnist`` plus a third conv block.

    body: Conv2d(C, 16, 5, padding=2) -> ReLU -> MaxPool2d(2) ->
    Conv2d(16, 32, 5, padding=2) -> ReLU -> MaxPool2d(2) ->
    Conv2d(32, 64, 3, padding=1) -> ReLU -> MaxPool2d(2) -> Flatten (64*4*4 = 1024 for
    3x32x32) -> Linear(., 128) -> ReLU; feature_dim 128.
    head: Linear(128, num_classes). Needs at least 8x8 inputs (three pools).
    """
    c = _image_shape("cnn_cifar", input_shape)[0]
    convs = [nn.Conv2d(c, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    flat = _flat_dim("cnn_cifar", input_shape, convs, 64)
    body = nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 128), nn.ReLU())
    return FLModel(body, nn.Linear(128, num_classes), 128, num_classes, is_conv=True)


@MODELS.register("cnn_mnist")
def cnn_mnist(input_shape: tuple, num_classes: int, channels: int = 20,
              dropout: float = 0.5) -> FLModel:
    """FedProto's CNNMnist (the authors' lib/models/models.py); ``channels`` is the second
    conv's width (their ``out_channels``, 20 by default), which their model-heterogeneous
    runs set to 18 / 20 / 22 while every client keeps feature_dim 50.

    body: Conv2d(C, 10, 5) -> MaxPool2d(2) -> ReLU -> Conv2d(10, channels, 5) ->
    Dropout2d(dropout) -> MaxPool2d(2) -> ReLU -> Flatten (16 * channels for 1x28x28,
    their int(320 / 20 * out_channels)) -> Linear(., 50) -> ReLU; feature_dim 50.
    head: Linear(50, num_classes). 21,840 parameters for 1x28x28 and 10 classes (the paper
    says about 21.5 thousand).

    The original also applies ``F.dropout(p=0.5)`` to the 50-d features before fc2 (its
    prototypes are the features *before* that dropout). That dropout is left out: it would
    sit between body and head, which methods replace or fix. ``dropout=0`` also removes the
    Dropout2d. Needs at least 16x16 inputs. (Until 2026-11-26 ``channels`` widened the
    first conv and the second had 20 channels: 27,100 parameters.)
    """
    _positive("cnn_mnist", channels=channels)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model 'cnn_mnist': dropout must be in [0, 1); got {dropout!r}")
    c = _image_shape("cnn_mnist", input_shape)[0]
    convs = [nn.Conv2d(c, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
             nn.Conv2d(10, channels, 5), nn.Dropout2d(dropout), nn.MaxPool2d(2), nn.ReLU()]
    flat = _flat_dim("cnn_mnist", input_shape, convs, channels)
    body = nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 50), nn.ReLU())
    return FLModel(body, nn.Linear(50, num_classes), 50, num_classes, is_conv=True)


@MODELS.register("simple_cnn")
def simple_cnn(input_shape: tuple, num_classes: int) -> FLModel:
    """The classic small CNN (PyTorch CIFAR tutorial / FedLab SimpleCNN).

    body: Conv2d(C, 6, 5) -> ReLU -> MaxPool2d(2) -> Conv2d(6, 16, 5) -> ReLU ->
    MaxPool2d(2) -> Flatten (400 for 32x32, 256 for 28x28) -> Linear(., 120) -> ReLU ->
    Linear(120, 84) -> ReLU; feature_dim 84.
    head: Linear(84, num_classes). Needs at least 16x16 inputs.
    """
    c = _image_shape("simple_cnn", input_shape)[0]
    convs = [nn.Conv2d(c, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)]
    flat = _flat_dim("simple_cnn", input_shape, convs, 16)
    body = nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 120), nn.ReLU(),
                         nn.Linear(120, 84), nn.ReLU())
    return FLModel(body, nn.Linear(84, num_classes), 84, num_classes, is_conv=True)


@MODELS.register("lenet5")
def lenet5(input_shape: tuple, num_classes: int) -> FLModel:
    """LeNet-5 with BatchNorm (44,470 parameters for 1x28x28 and 10 classes).

    body: Conv2d(C, 6, 5) -> BatchNorm2d(6) -> ReLU -> MaxPool2d(2) -> Conv2d(6, 16, 5) ->
    BatchNorm2d(16) -> ReLU -> MaxPool2d(2) -> Flatten (256 for 28x28, 400 for 32x32) ->
    Linear(., 120) -> ReLU -> Linear(120, 84) -> ReLU; feature_dim 84.
    head: Linear(84, num_classes). All layers have biases. Needs at least 16x16 inputs.
    """
    c = _image_shape("lenet5", input_shape)[0]
    convs = [nn.Conv2d(c, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)]
    flat = _flat_dim("lenet5", input_shape, convs, 16)
    body = nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 120), nn.ReLU(),
                         nn.Linear(120, 84), nn.ReLU())
    return FLModel(body, nn.Linear(84, num_classes), 84, num_classes, is_conv=True,
                   channels_last=False)  # measured: BatchNorm + 1-channel input train 8 % slower in NHWC


@MODELS.register("fedavg_cnn")
def fedavg_cnn(input_shape: tuple, num_classes: int) -> FLModel:
    """The MNIST CNN of McMahan et al. 2017 as in PFLlib's FedAvgCNN (582,026 parameters
    for 1x28x28 and 10 classes).

    body: Conv2d(C, 32, 5) -> ReLU -> MaxPool2d(2) -> Conv2d(32, 64, 5) -> ReLU ->
    MaxPool2d(2) -> Flatten (1024 for 28x28, 1600 for 32x32) -> Linear(., 512) -> ReLU;
    feature_dim 512.
    head: Linear(512, num_classes). Needs at least 16x16 inputs.
    """
    c = _image_shape("fedavg_cnn", input_shape)[0]
    convs = [nn.Conv2d(c, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2)]
    flat = _flat_dim("fedavg_cnn", input_shape, convs, 64)
    body = nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 512), nn.ReLU())
    return FLModel(body, nn.Linear(512, num_classes), 512, num_classes, is_conv=True)


# ---------------------------------------------------------------------------------------
# ResNet-18 for 32x32 inputs, with BatchNorm or GroupNorm
# ---------------------------------------------------------------------------------------

NORMS = ("batch", "group")


class _BasicBlock(nn.Module):
    """conv3x3 -> norm -> ReLU -> conv3x3 -> norm, plus the shortcut (identity, or a 1x1
    conv + norm where the shape changes), then ReLU.

    The norm layers are named ``gn1``/``gn2`` (GroupNorm) or ``bn1``/``bn2`` (BatchNorm):
    ``resnet18_gn``'s state-dict keys, and so its checkpoints, stay as they were.
    """

    def __init__(self, in_planes: int, planes: int, stride: int, norm: Callable[[int], nn.Module],
                 tag: str) -> None:
        super().__init__()
        self.norms = (f"{tag}1", f"{tag}2")
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.add_module(self.norms[0], norm(planes))
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.add_module(self.norms[1], norm(planes))
        self.relu = nn.ReLU()
        if stride != 1 or in_planes != planes:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), norm(planes))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        n1, n2 = (getattr(self, n) for n in self.norms)
        out = self.relu(n1(self.conv1(x)))
        out = n2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


@MODELS.register("resnet18")
def resnet18(input_shape: tuple, num_classes: int, norm: Literal["batch", "group"] = "batch",
             groups: int = 2, proj_dim: Optional[int] = None) -> FLModel:
    """ResNet-18 for 32x32 inputs (the "CIFAR stem"), as the FL papers train it on CIFAR-10/100
    and SVHN.

    body: Conv2d(C, 64, 3, padding=1, bias=False) -> norm -> ReLU (no max-pool) ->
    4 stages of 2 BasicBlocks, widths 64/128/256/512, strides 1/2/2/2 (1x1 conv + norm
    shortcut where the shape changes) -> AdaptiveAvgPool2d(1) -> Flatten; feature_dim 512.
    With ``proj_dim``: then Linear(512, proj_dim) (no activation); feature_dim proj_dim.
    head: Linear(feature_dim, num_classes). Any in_channels and any spatial size work.

    ``norm``: ``batch`` (BatchNorm2d; its running statistics are buffers, averaged like the
    weights) or ``group`` (GroupNorm(``groups``, C); FedNH's appendix replaces every
    BatchNorm by GroupNorm with 2 groups, following Lin et al. 2020: ``resnet18_gn``).

    FedGELA (section 5 and Appendix C) uses "ResNet18 (modified by 32x32 input)" with BatchNorm
    (its code's ResNetCifar10: torchvision's ResNet-18 with this 3x3 stride-1 stem and no
    max-pool), followed by "one layer of FC as the projection layer (the hidden size is 84
    for SVHN and CIFAR10 and 512 for CIFAR100)" and the classifier: ``norm: batch,
    proj_dim: 84``. Deviations: the convolutions keep PyTorch's default initialization
    (torchvision and FedGELA's code draw them from kaiming_normal_(fan_out)); FedGELA's code
    projects with two FC layers (512 -> 512, ReLU, 512 -> out) where the paper says one, and
    we follow the paper.
    """
    if norm not in NORMS:
        raise ValueError(f"model 'resnet18': norm must be one of {', '.join(NORMS)}; got {norm!r}")
    _positive("resnet18", groups=groups)
    if proj_dim is not None:
        _positive("resnet18", proj_dim=proj_dim)
    c = _image_shape("resnet18", input_shape)[0]
    make: Callable[[int], nn.Module]
    if norm == "group":
        for width in (64, 128, 256, 512):
            if width % groups:
                raise ValueError(f"model 'resnet18': groups must divide every width (64, 128, 256, 512); "
                                 f"got {groups}")
        make, tag = (lambda ch: nn.GroupNorm(groups, ch)), "gn"
    else:
        make, tag = nn.BatchNorm2d, "bn"
    layers: list[nn.Module] = [nn.Conv2d(c, 64, 3, padding=1, bias=False), make(64), nn.ReLU()]
    in_planes = 64
    for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_BasicBlock(in_planes, planes, stride, make, tag), _BasicBlock(planes, planes, 1, make, tag)]
        in_planes = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    feature_dim = 512
    if proj_dim is not None:
        layers.append(nn.Linear(512, proj_dim))
        feature_dim = proj_dim
    return FLModel(nn.Sequential(*layers), nn.Linear(feature_dim, num_classes), feature_dim, num_classes,
                   is_conv=True)


@MODELS.register("resnet18_gn")
def resnet18_gn(input_shape: tuple, num_classes: int) -> FLModel:
    """``resnet18`` with ``norm: group`` (GroupNorm(2, C) for every BatchNorm), FedNH's
    ResNet-18 for Tiny-ImageNet. The same weights for the same seed as ``resnet18`` with
    ``norm: group``; kept as a name of its own (without parameters) so that the configs
    and run folders that name it keep their fingerprints.
    """
    _image_shape("resnet18_gn", input_shape)
    return resnet18(input_shape, num_classes, norm="group", groups=2)


# ---------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------

@MODELS.register("mlp_mnist")
def mlp_mnist(input_shape: tuple, num_classes: int) -> FLModel:
    """MP-FedCL's MLP: an encoder plus one MLP layer form the body.

    body: Flatten -> Linear(prod(input_shape) = 784 for MNIST, 512) -> ReLU ->
    Linear(512, 512) -> ReLU -> Linear(512, 256) -> ReLU; feature_dim 256.
    head: Linear(256, num_classes). The paper's Table III prints ReLU beside that last layer
    too; a ReLU on the logits would clip every negative logit to zero, so it is read as a
    misprint and left out.
    """
    d_in = math.prod(input_shape)
    _positive("mlp_mnist", input_size=d_in)
    body = nn.Sequential(nn.Flatten(), nn.Linear(d_in, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU())
    return FLModel(body, nn.Linear(256, num_classes), 256, num_classes)


@MODELS.register("mlp2d")
def mlp2d(input_shape: tuple, num_classes: int, feature_dim: int = 2) -> FLModel:
    """FedNH's motivating example for the 2-D spiral data.

    body (5 fully connected layers): Flatten -> Linear(prod(input_shape), 128) -> ReLU ->
    Linear(128, 128) -> ReLU -> Linear(128, 128) -> ReLU -> Linear(128, 64) -> ReLU ->
    Linear(64, feature_dim); feature_dim 2 by default. The last layer has no ReLU, so the
    features can point anywhere in the plane (what the prototype plots show).
    head: Linear(feature_dim, num_classes, bias=False).
    """
    d_in = math.prod(input_shape)
    _positive("mlp2d", input_size=d_in, feature_dim=feature_dim)
    body = nn.Sequential(nn.Flatten(), nn.Linear(d_in, 128), nn.ReLU(),
                         nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, feature_dim))
    return FLModel(body, nn.Linear(feature_dim, num_classes, bias=False), feature_dim,
                   num_classes)


# ---------------------------------------------------------------------------------------
# LSTM
# ---------------------------------------------------------------------------------------

class _LSTMBody(nn.Module):
    """int64 tokens (B, T) -> Embedding -> LSTM (batch_first) -> last step's output."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True)

    def forward(self, x):
        out, _ = self.lstm(self.embedding(x))
        return out[:, -1, :]


@MODELS.register("lstm_shakespeare")
def lstm_shakespeare(input_shape: tuple, num_classes: int, vocab_size: int = 80,
                     embed_dim: int = 8, hidden: int = 256, num_layers: int = 2) -> FLModel:
    """The Shakespeare next-character LSTM (McMahan et al. 2017 / LEAF).

    input: int64 tokens, input_shape (seq_len,) = (80,).
    body: Embedding(vocab_size=80, 8) -> LSTM(8, 256, num_layers=2, batch_first=True) ->
    output of the last time step; feature_dim 256 (``hidden``).
    head: Linear(256, num_classes).
    """
    shape = tuple(input_shape)
    if len(shape) != 1 or int(shape[0]) != shape[0] or shape[0] < 1:
        raise ValueError(f"model 'lstm_shakespeare' needs a token input_shape (seq_len,); "
                         f"got {shape}")
    _positive("lstm_shakespeare", vocab_size=vocab_size, embed_dim=embed_dim, hidden=hidden,
              num_layers=num_layers)
    body = _LSTMBody(vocab_size, embed_dim, hidden, num_layers)
    return FLModel(body, nn.Linear(hidden, num_classes), hidden, num_classes)
