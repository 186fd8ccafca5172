"""Convolutions of a stack as matrix products (``execution.conv_as_matmul``).

Under ``vmap`` a stack's convolution runs as one grouped convolution, one group per slot
(functorch's batching rule). A layer with one input channel per group (MNIST's first
convolution) then takes PyTorch's depthwise kernels, and cuDNN converts the layout of every
grouped convolution (NCHW to NHWC and back): on an H200 at 100 clients a round, 311 ms of a
round's 1.31 s of kernels are the first convolution's depthwise kernels and 87 ms the layout
conversions, and cuDNN runs the grouped convolution one group (one slot) at a time: a
kernel per client-step for each of its forward, input and weight gradients, 44,370 of the
round's 82,026 kernels with the conversions (benchmarks/timing.md, "NVIDIA H200, 2026-11-30").

A convolution is a matrix product of its weight with its input's patches (im2col): for an
input x (n, C, H, W) and a weight w (O, C, kh, kw),

    P = unfold(x)             (n, C kh kw, L), L = Ho Wo output positions
    y = w.view(O, C kh kw) P  (n, O, L), then the bias, then the view (n, O, Ho, Wo)

Under ``vmap`` the product becomes one batched matrix product over the slots (``bmm``),
and its backward the weight's gradient as another; the patches are a plain gather. Which
convolutions are rewritten (``conv_as_matmul``, and :class:`StackKernels`' name for it):

* ``false`` (``off``): none, the default;
* ``one_channel``: those with one input channel per group (the depthwise case above);
* ``true`` (``all``): every convolution with ``groups`` 1.

The rewrite is :class:`StackKernels`, a ``TorchFunctionMode`` that the batched executor
holds around a stack step's forward and backward (not around the features pass or the
evaluation). The sums run in another order than the convolution kernels', so results
change within float rounding, as between the executors. Whether it repays is a GPU
question that ``benchmarks/gpu.py --conv-as-matmul`` answers per setting; the CPU's
figures are in benchmarks/timing.md ("Convolutions as matrix products").
"""
from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..models.zoo import pair

Which = Literal["off", "one_channel", "all"]
WHICH: tuple[str, ...] = ("off", "one_channel", "all")


def conv2d_as_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int]] = 0,
                     dilation: Union[int, Sequence[int]] = 1) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation)`` (groups 1, zero padding) as
    the product of the weight with the input's patches; ``x`` is (n, C, H, W)."""
    s, p, d = pair(stride), pair(padding), pair(dilation)
    out_channels, _, kh, kw = weight.shape
    n, _, h, w = x.shape
    ho = (h + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    wo = (w + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    patches = F.unfold(x, (kh, kw), dilation=d, padding=p, stride=s)  # (n, C kh kw, L)
    y = torch.matmul(weight.reshape(out_channels, -1), patches)  # (n, O, L)
    if bias is not None:
        y = y + bias.view(out_channels, 1)
    return y.view(n, out_channels, ho, wo)


_CONV = (F.conv2d, torch.conv2d)
_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


class StackKernels(TorchFunctionMode):
    """Within it, the convolutions ``which`` selects run as :func:`conv2d_as_matmul`;
    every other call, and every convolution it does not select, runs as it would."""

    def __init__(self, which: Which) -> None:
        super().__init__()
        if which not in WHICH:
            raise ValueError(f"stack kernels: expected one of {', '.join(WHICH)}, got {which!r}")
        self.which = which
        self.rewritten = 0  # convolutions rewritten (per trace under vmap: per call of the step)

    def selects(self, x: torch.Tensor, weight: torch.Tensor, padding: Any, groups: int) -> bool:
        if self.which == "off" or groups != 1 or x.dim() != 4 or isinstance(padding, str):
            return False
        return self.which == "all" or weight.shape[1] == 1

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func in _CONV:
            a = dict(zip(_NAMES, args), **kwargs)
            a.setdefault("bias", None)
            a.setdefault("stride", 1)
            a.setdefault("padding", 0)
            a.setdefault("dilation", 1)
            if self.selects(a["input"], a["weight"], a["padding"], a.get("groups", 1)):
                self.rewritten += 1
                return conv2d_as_matmul(a["input"], a["weight"], a["bias"], a["stride"], a["padding"], a["dilation"])
        return func(*args, **kwargs)
