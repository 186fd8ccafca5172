"""Split a whole classifier network into protofl's body and head (:class:`FLModel`).

An image classifier written the torchvision way ends in one ``nn.Linear`` that maps the
pooled features to class scores, kept under a known attribute:

* ``fc``: ResNet, ResNeXt, Wide ResNet, RegNet, GoogLeNet, Inception v3, ShuffleNet v2;
* ``classifier``: DenseNet; the last module of a ``classifier`` Sequential
  (``classifier[-1]``): AlexNet, VGG, MobileNet v2/v3, EfficientNet (v1, v2), MNASNet,
  ConvNeXt, MaxViT;
* ``head``: Swin; the last module of a ``heads`` Sequential (``heads.head``): ViT.

That layer becomes the head; in the network it is replaced by ``Flatten(1)``, which passes
the (B, D) features it received unchanged (and flattens a (B, D, 1, 1) map), so the
network itself is the body: ``body(x) -> (B, D)``, ``feature_dim = D`` (the Linear's
``in_features``). The body's state-dict keys are the network's own, less the head's.
Whatever the network does before its last Linear stays in the body (MobileNet's and
VGG's dropout act on the features in training mode).
"""
from __future__ import annotations

from torch import nn

from .base import FLModel

HEAD_ATTRIBUTES = ("fc", "classifier", "head", "heads")  # searched in this order


def find_head(net: nn.Module) -> tuple[str, nn.Linear]:
    """The dotted name (``fc``, ``classifier.6``, ``heads.head``) and the module of ``net``'s
    final Linear layer; a ValueError saying what was found otherwise."""
    seen = []
    for attr in HEAD_ATTRIBUTES:
        m = net._modules.get(attr)
        if m is None:
            continue
        if isinstance(m, nn.Linear):
            return attr, m
        if isinstance(m, nn.Sequential) and len(m):
            last = next(reversed(m._modules))
            if isinstance(m[-1], nn.Linear):
                return f"{attr}.{last}", m[-1]
            seen.append(f"{attr} ends in {type(m[-1]).__name__}")
        else:
            seen.append(f"{attr} is a {type(m).__name__}")
    found = f" ({'; '.join(seen)})" if seen else ""
    raise ValueError(f"{type(net).__name__} has no final nn.Linear under fc, classifier, classifier[-1], head or "
                     f"heads[-1]{found}, so it cannot be split into body and head")


def split_classifier(net: nn.Module, num_classes: int, is_conv: bool = True) -> FLModel:
    """``net`` as an :class:`FLModel`: its final Linear is the head (a fresh
    ``Linear(in_features, num_classes)``, with a bias if it had one, when its number of
    outputs differs), the rest the body. ``net`` is changed in place and becomes the body."""
    path, linear = find_head(net)
    if linear.out_features == num_classes:
        head = linear
    else:
        head = nn.Linear(linear.in_features, num_classes, bias=linear.bias is not None)
    parent, _, name = path.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, name, nn.Flatten(1))
    return FLModel(net, head, linear.in_features, num_classes, is_conv=is_conv, source_head=path)
