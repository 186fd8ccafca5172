"""FedAwS: the spreadout regularizer by hand, the server's steps spread the classifier rows,
and everything else is FedAvg's."""
import math

import pytest
import torch

from protofl.algorithms.fedaws import spread_out, spreadout


def test_spreadout_by_hand():
    # identical rows: cos 1, d 0, each of the 2 ordered pairs (0.5 - 0)^2; mean over 2 x 2
    assert spreadout(torch.tensor([[1.0, 0.0], [2.0, 0.0]]), 0.5).item() == pytest.approx(2 * 0.25 / 4)
    # orthogonal rows: d = 1/2, at the margin: nothing to push
    assert spreadout(torch.tensor([[1.0, 0.0], [0.0, 3.0]]), 0.5).item() == 0.0
    # 45 degrees: d = (1 - 1/sqrt 2) / 2
    d = (1 - 1 / math.sqrt(2)) / 2
    assert spreadout(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), 0.5).item() == pytest.approx(2 * (0.5 - d) ** 2 / 4)
    # three rows, one pair apart: only the two close pairs count
    w = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert spreadout(w, 0.5).item() == pytest.approx(2 * 0.25 / 9)
    # another margin: orthogonal rows (d = 1/2) under nu = 0.8 give (0.3)^2 per ordered pair
    assert spreadout(torch.tensor([[1.0, 0.0], [0.0, 3.0]]), 0.8).item() == pytest.approx(2 * 0.3 ** 2 / 4)
    # the row norms do not matter
    torch.testing.assert_close(spreadout(w * torch.tensor([[2.0], [0.5], [7.0]]), 0.5), spreadout(w, 0.5))


def test_the_gradient_step_by_hand():
    # rows (1, 0) and (1, 1): cos = 1/sqrt 2. One plain SGD step (momentum 0) of lr 1: the
    # gradient of row 0 is 2 * 2 * (margin - d) * (-dd/dw_0) / 4, dd/dw_0 = -(1/2) dcos/dw_0, and
    # dcos/dw_0 at w_0 = (1, 0), w_1 = (1, 1): (u_1 - cos u_0) / |w_0| = (1/sqrt 2 - 1/sqrt 2, 1/sqrt 2)
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    d = (1 - 1 / math.sqrt(2)) / 2
    dcos = torch.tensor([0.0, 1 / math.sqrt(2)])
    grad0 = 2 * 2 * (0.5 - d) * (0.5 * dcos) / 4  # d(reg)/d(w_0); the step -grad0 lowers cos
    new, _ = spread_out(w, 0.5, 1, 1.0, 0.0)
    torch.testing.assert_close(new[0], w[0] - grad0)


def test_many_steps_spread_the_rows_past_the_margin():
    g = torch.Generator().manual_seed(0)
    w = torch.ones(4, 3) + 0.01 * torch.randn(4, 3, generator=g)  # nearly collapsed
    new, reg = spread_out(w, 0.5, 300, 0.5, 0.9)
    u = torch.nn.functional.normalize(new, dim=1)
    cos = (u @ u.T)[~torch.eye(4, dtype=torch.bool)]
    assert reg < 1e-4 < spreadout(w, 0.5).item() and cos.max() < 0.02  # every pair at cos <= 0
    same, reg0 = spread_out(w, 0.5, 0, 0.1, 0.9)
    assert torch.equal(same, w) and reg0 == pytest.approx(spreadout(w, 0.5).item())


def test_everything_but_the_classifier_rows_is_fedavg(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    runs = {}
    for name, steps in (("fedavg", 0), ("fedaws", 0), ("fedaws", 100)):
        cfg = digits_cfg(f"algorithm.name={name}", "rounds=1", "eval.personal=false",
                         *([f"algorithm.spread_steps={steps}"] if name == "fedaws" else []))
        runs[name, steps] = Simulation(cfg, run_dir=tmp_path / f"{name}{steps}").run()
    avg, none, aws = (runs[k].server_state.weights for k in (("fedavg", 0), ("fedaws", 0), ("fedaws", 100)))
    assert all(torch.equal(avg[k], none[k]) for k in avg)  # no step: FedAvg bit for bit
    assert all(torch.equal(avg[k], aws[k]) for k in avg if k != "head.weight")
    assert not torch.equal(avg["head.weight"], aws["head.weight"])
    row = runs["fedaws", 100].rows[-1]
    assert row["spreadout"] < spreadout(avg["head.weight"], 0.5).item()


def test_bad_hyper_parameters_are_one_line_errors(digits_cfg):
    from protofl.config import ConfigError

    for key, value in (("margin", 0), ("margin", 1.5), ("spread_steps", -1), ("spread_lr", 0),
                       ("spread_momentum", 1)):
        with pytest.raises(ConfigError, match=key):
            digits_cfg("algorithm.name=fedaws", f"algorithm.{key}={value}")
