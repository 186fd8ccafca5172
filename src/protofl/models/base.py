"""Every model is a body (feature extractor) plus a head (classifier).

Methods replace, fix or bypass the head (FedNH's fixed prototypes, FedGELA's ETF,
FedProto's nearest-prototype inference), so the split is part of the interface:

* ``model.body(x)``   -> (B, feature_dim) features
* ``model.head(h)``   -> (B, num_classes) logits
* ``model(x)``        == ``model.head(model.body(x))``
"""
from __future__ import annotations

import torch
from torch import nn


class FLModel(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Module, feature_dim: int, num_classes: int,
                 is_conv: bool = False, channels_last: bool | None = None,
                 source_head: str | None = None) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.feature_dim = int(feature_dim)
        self.num_classes = int(num_classes)
        self.is_conv = bool(is_conv)
        # a model split out of another network (torchvision's): where the head sat there
        # (e.g. "fc", "classifier.6"), so that that network's own state dict loads as
        # pretrained weights (protofl.models.pretrained)
        self.source_head = source_head
        # whether `execution.channels_last: auto` turns channels_last on: measured per model
        # (benchmarks/timing.md); conv models gain 1.1-1.8x, LeNet-5's BatchNorm trains slower
        self.channels_last = self.is_conv if channels_last is None else bool(channels_last)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
