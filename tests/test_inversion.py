"""protofl.nn.inversion: the prototype-inversion probe on hand-computed cases."""
import pytest
import torch
from torch import nn

from protofl.nn.inversion import invert_features, total_variation


def test_total_variation_is_the_mean_squared_neighbour_difference():
    x = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]],    # two horizontal steps of 1, no vertical: 2 / 4
                      [[[0.0, 0.0], [3.0, 3.0]]]])   # two vertical steps of 3: 18 / 4
    assert total_variation(x).tolist() == pytest.approx([0.5, 4.5])


def test_a_linear_feature_map_is_inverted_exactly():
    W = torch.tensor([[2.0, 0.0], [1.0, 1.0]])  # invertible: x* = W^-1 p
    f = lambda x: x @ W.T  # noqa: E731
    target = torch.tensor([[2.0, 0.0], [4.0, 5.0]])  # x* = (1, -1) and (2, 3)
    x = invert_features(f, target, torch.zeros(2, 2), steps=3000, lr=0.02)
    assert x.flatten().tolist() == pytest.approx([1.0, -1.0, 2.0, 3.0], abs=1e-3)


def test_the_inputs_range_binds_the_search():
    W = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    # x0 <= 0.5; then (2 x0 - 2)^2 + (x0 + x1)^2 is least at x0 = 0.5, x1 = -0.5
    x = invert_features(lambda x: x @ W.T, torch.tensor([[2.0, 0.0]]), torch.zeros(1, 2),
                        steps=3000, lr=0.02, high=0.5)
    assert x.flatten().tolist() == pytest.approx([0.5, -0.5], abs=1e-3)


def test_the_feature_map_is_left_as_it_was():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 3))
    body.train()
    body[2].weight.requires_grad_(False)  # a frozen part stays frozen, the rest trainable
    before = {k: v.clone() for k, v in body.state_dict().items()}
    target = torch.randn(2, 3)
    x = invert_features(body, target, torch.zeros(2, 1, 4, 4), steps=50, lr=0.05, tv=0.1, modules=(body,))
    assert x.shape == (2, 1, 4, 4) and not x.requires_grad
    assert all(torch.equal(before[k], v) for k, v in body.state_dict().items())
    assert body.training and body[0].weight.requires_grad and not body[2].weight.requires_grad
    assert body[0].weight.grad is None  # no gradient left on the model
    loss0 = ((body(torch.zeros(2, 1, 4, 4)) - target) ** 2).sum()
    assert ((body(x) - target) ** 2).sum() < loss0  # the search moved towards the targets


@pytest.mark.parametrize("kw", [{"steps": -1}, {"lr": 0.0}, {"tv": -1.0}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="invert_features"):
        invert_features(lambda x: x, torch.zeros(1, 2), torch.zeros(1, 2), **kw)


def test_targets_and_starts_must_pair():
    with pytest.raises(ValueError, match="2 targets for 1 starts"):
        invert_features(lambda x: x, torch.zeros(2, 2), torch.zeros(1, 2))
