"""FedGH: the server trains the global header on the uploaded class representations; only
the header goes down and only prototypes go up."""
import pytest
import torch
from torch import nn

from protofl.algorithms.fedgh import train_header

from conftest import record_run


def test_train_header_fits_separable_representations_and_is_seeded():
    reps = torch.tensor([[2.0, 0.0], [1.5, 0.5], [0.0, 2.0], [0.5, 1.5]])
    labels = torch.tensor([0, 0, 1, 1])

    def trained(epochs, batch=2, seed=0):
        head = nn.Linear(2, 2)
        with torch.no_grad():
            head.weight.zero_()
            head.bias.zero_()
        loss = train_header(head, reps, labels, epochs, lr=0.5, batch=batch,
                            generator=torch.Generator().manual_seed(seed))
        return head, loss

    head, loss = trained(50)
    assert head(reps).argmax(1).tolist() == [0, 0, 1, 1] and loss < 0.1
    # one step on the whole batch by hand: zero logits, p = 1/2 for both classes; the
    # gradient of row 0 is mean_i (p_0 - 1[y_i = 0]) x_i = ((-1.5, 1.5)) / 4, of the bias 0
    head, _ = trained(1, batch=4)
    torch.testing.assert_close(head.weight, torch.tensor([[0.1875, -0.1875], [-0.1875, 0.1875]]))
    torch.testing.assert_close(head.bias, torch.zeros(2))
    a, _ = trained(3, seed=1)
    b, _ = trained(3, seed=1)
    assert torch.equal(a.weight, b.weight)  # the same generator, the same minibatch order
    untouched, loss = trained(0)
    assert loss is None and untouched.weight.abs().sum() == 0


def test_only_the_header_goes_down_and_only_prototypes_go_up(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedgh", "rounds=2", "algorithm.server_epochs=5")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    init = sim.server.init_weights()
    for rnd, cid, msg, reply, state in seen:
        assert set(msg.weights) == {"head.weight", "head.bias"} and not msg.arrays
        assert not reply.weights and set(reply.arrays) == {"protos", "classes", "counts"}
        assert "body.1.weight" in state.weights  # the extractor stays on the client
        if rnd == 1:
            assert torch.equal(msg.weights["head.weight"].cpu(), init["head.weight"].cpu())
    second = [msg for rnd, _, msg, _, _ in seen if rnd == 2]
    assert not torch.equal(second[0].weights["head.weight"].cpu(), init["head.weight"].cpu())  # trained by the server
    assert "header_loss" in res.rows[0] and "gm" not in res.rows[0]


def test_bad_hyper_parameter_is_a_config_error(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="server_lr"):
        digits_cfg("algorithm.name=fedgh", "algorithm.server_lr=0")
