"""execution.conv_as_matmul: a stack step's convolutions as matrix products of the weights
with the input's patches (engine/stack_kernels.py). The product is the convolution (by
hand and against F.conv2d, values and gradients), the mode rewrites the convolutions it is
asked to and no others, and a batched run with it trains what the run without it trains."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from protofl.config import ConfigError
from protofl.engine import stack_kernels
from protofl.engine.stack_kernels import StackKernels, conv2d_as_matmul
from protofl.models import MODELS
from protofl.models.base import FLModel

from test_gpu_execution import assert_close_runs, cfg_for, executor_of


def test_a_one_channel_convolution_by_hand():
    # x = [[1, 2], [3, 4]], a 2x2 kernel [[1, 0], [0, -1]] and bias 0.5, no padding: one
    # output, 1*1 + 2*0 + 3*0 + 4*(-1) + 0.5 = -2.5; with padding 1 the 3x3 map of the
    # kernel sliding over the zero-bordered input
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    w = torch.tensor([[[[1.0, 0.0], [0.0, -1.0]]]])
    b = torch.tensor([0.5])
    assert conv2d_as_matmul(x, w, b).tolist() == [[[[-2.5]]]]
    padded = conv2d_as_matmul(x, w, b, padding=1)
    assert padded.tolist() == [[[[-0.5, -1.5, 0.5], [-2.5, -2.5, 2.5], [0.5, 3.5, 4.5]]]]


@pytest.mark.parametrize("stride,padding,dilation,bias,channels", [
    (1, 0, 1, True, 1), (2, 1, 1, False, 1), ((1, 2), (2, 0), 1, True, 3), (1, 2, 2, True, 2)])
def test_the_product_is_the_convolution_with_its_gradients(stride, padding, dilation, bias, channels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, channels, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, channels, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    ours = conv2d_as_matmul(x, w, b, stride, padding, dilation)
    ref = F.conv2d(x, w, b, stride, padding, dilation)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    inputs = [t for t in (x, w, b) if t is not None]
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for a, r in zip(torch.autograd.grad(ours, inputs, up), torch.autograd.grad(ref, inputs, up)):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2), nn.ReLU(),
                         nn.Conv2d(6, 6, 1, groups=2), nn.Flatten(), nn.LazyLinear(3)).double()


@pytest.mark.parametrize("which,rewritten", [("off", 0), ("one_channel", 1), ("all", 2)])
def test_the_mode_rewrites_what_it_is_asked_to_under_vmap_and_grad(which, rewritten):
    """one_channel: the 1-input-channel convolution; all: every convolution with groups 1 (the
    grouped one is never rewritten). A vmapped step over 3 slots computes what it computes
    without the mode."""
    net = _net()
    net(torch.zeros(1, 1, 8, 8, dtype=torch.float64))  # the lazy layer's shape
    g = torch.Generator().manual_seed(1)
    params = {k: v.detach() + 0.1 * torch.randn(3, *v.shape, generator=g, dtype=v.dtype)
              for k, v in net.named_parameters()}
    x = torch.randn(3, 5, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (3, 5), generator=g)

    def loss(p, x, y):
        return F.cross_entropy(functional_call(net, p, (x,)), y)

    step = vmap(grad_and_value(loss))
    grads, value = step(params, x, y)
    mode = StackKernels(which)
    with mode:
        grads2, value2 = step(params, x, y)
    assert mode.rewritten == rewritten
    torch.testing.assert_close(value2, value, rtol=0, atol=1e-12)
    for k in grads:
        torch.testing.assert_close(grads2[k], grads[k], rtol=0, atol=1e-12, msg=k)


def test_per_sample_gradients_under_two_vmaps_are_unchanged():
    """DP-SGD's step: the gradient of every sample of every slot, a vmap over the samples
    inside the vmap over the slots, with every convolution rewritten."""
    net = _net()
    net(torch.zeros(1, 1, 8, 8, dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    params = {k: v.detach() + 0.1 * torch.randn(2, *v.shape, generator=g, dtype=v.dtype)
              for k, v in net.named_parameters()}
    x = torch.randn(2, 4, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 4), generator=g)

    def loss(p, x, y):  # one sample
        return F.cross_entropy(functional_call(net, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    step = vmap(vmap(grad_and_value(loss), in_dims=(None, 0, 0)))
    grads, value = step(params, x, y)
    mode = StackKernels("all")
    with mode:
        grads2, value2 = step(params, x, y)
    assert mode.rewritten == 2 and grads["0.weight"].shape == (2, 4, 4, 1, 3, 3)
    torch.testing.assert_close(value2, value, rtol=0, atol=1e-12)
    for k in grads:
        torch.testing.assert_close(grads2[k], grads[k], rtol=0, atol=1e-12, msg=k)


def test_a_string_padding_and_other_calls_pass_through():
    mode = StackKernels("all")
    x, w = torch.randn(1, 1, 5, 5), torch.randn(2, 1, 3, 3)
    with mode:
        same = F.conv2d(x, w, padding="same")
        total = torch.add(x, 1.0).sum()
    assert mode.rewritten == 0
    torch.testing.assert_close(same, F.conv2d(x, w, padding="same"))
    torch.testing.assert_close(total, (x + 1.0).sum())


def test_an_unknown_choice_is_refused_by_the_mode_and_the_config(tmp_path):
    with pytest.raises(ValueError, match="one_channel"):
        StackKernels("depthwise")
    with pytest.raises(ConfigError, match="conv_as_matmul"):
        cfg_for(tmp_path, "execution.conv_as_matmul=depthwise")
    assert [cfg_for(tmp_path, f"execution.conv_as_matmul={v}").execution.stack_kernels
            for v in ("false", "one_channel", "true")] == ["off", "one_channel", "all"]


def _tiny_cnn(input_shape, num_classes):
    """A 1-channel convolution, a 4-channel one and no BatchNorm, on 8x8 digits."""
    body = nn.Sequential(nn.Conv2d(input_shape[0], 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(6 * 3 * 3, 16), nn.ReLU())
    return FLModel(body, nn.Linear(16, num_classes), 16, num_classes, is_conv=True)


@pytest.mark.parametrize("method", ["fedavg", "fednh"])
def test_a_batched_run_with_stack_kernels_trains_what_it_trains_without(tmp_path, monkeypatch, method):
    """Padded stacks (a GPU's default) and grouped ones: each choice within float rounding of
    the run without the rewrite, and the run's summary names it. Only the training steps'
    convolutions are rewritten: their batches hold at most training.batch_size (24) rows,
    where FedNH's features pass and the evaluation forward a client's or the test set's
    samples in batches of up to 256."""
    monkeypatch.setitem(MODELS._items, "tiny_cnn", _tiny_cnn)
    calls, rows = [], []  # the weights' input channels and the batch rows of every convolution rewritten
    real = stack_kernels.conv2d_as_matmul
    monkeypatch.setattr(stack_kernels, "conv2d_as_matmul",
                        lambda x, w, *a: calls.append(w.shape[1]) or rows.append(x.shape[0]) or real(x, w, *a))
    cfg = cfg_for(tmp_path, "model.name=tiny_cnn", f"algorithm.name={method}", "training.lr=0.02").replace(
        **{"execution.executor": "batched"})
    for pad in (True, False):
        base = cfg.replace(**{"execution.pad_batches": pad})
        off, _ = executor_of(base, tmp_path / f"off-{pad}")
        assert "conv_as_matmul" not in off.summary["execution"] and not calls
        for value, which, channels in (("one_channel", "one_channel", {1}), (True, "all", {1, 4})):
            on, _ = executor_of(base.replace(**{"execution.conv_as_matmul": value}), tmp_path / f"{which}-{pad}")
            assert on.summary["execution"]["conv_as_matmul"] == which and on.summary["execution"]["padded"] is pad
            assert set(calls) == channels  # the training steps' convolutions went through the product
            assert max(rows) <= 24  # and only theirs
            calls.clear()
            rows.clear()
            assert_close_runs(off, on)


def test_with_batchnorm_the_grouped_stack_rewrites_too(tmp_path, monkeypatch):
    """A conv + BatchNorm model (grouped stacks, never padded): its one-channel convolution
    rewritten, the run within float rounding of the run without it."""
    from test_gpu_execution import _tiny_bn_cnn

    monkeypatch.setitem(MODELS._items, "tiny_bn_cnn", _tiny_bn_cnn)
    cfg = cfg_for(tmp_path, "model.name=tiny_bn_cnn", "training.lr=0.01", "training.weight_decay=0.001",
                  "training.clip_grad=1.0").replace(**{"execution.executor": "batched", "execution.pad_batches": True})
    off, _ = executor_of(cfg, tmp_path / "off")
    on, _ = executor_of(cfg.replace(**{"execution.conv_as_matmul": "one_channel"}), tmp_path / "on")
    assert on.summary["execution"]["padded"] is False and on.summary["execution"]["conv_as_matmul"] == "one_channel"
    assert_close_runs(off, on)
