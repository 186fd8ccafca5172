"""A module in eval mode for one block of code (dropout off, BatchNorm on its running
statistics), then back in the mode it was in."""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``module.eval()`` for the block, then ``module.train(was)`` with the mode it had
    (set on every submodule, as ``train`` does), also when the block raises."""
    was = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was)
