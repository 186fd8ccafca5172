"""CCVR: the clients' class statistics, the server's pooled Gaussians and the virtual
features by hand; the calibration on a toy; training that is FedAvg's bit for bit; resume
of the calibrated state (CCVR's and SphereFed's)."""
import numpy as np
import pytest
import torch

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.ccvr import CCVR, CCVRHyper, class_statistics, global_gaussians, virtual_features
from protofl.messages import Record


def test_class_statistics_by_hand():
    z = torch.tensor([[0.0, 0.0], [5.0, 1.0], [2.0, 2.0]])
    y = torch.tensor([0, 1, 0])
    mu, cov, n = class_statistics(z, y, 3)
    assert torch.equal(n, torch.tensor([2, 1, 0]))
    assert torch.allclose(mu, torch.tensor([[1.0, 1.0], [5.0, 1.0], [0.0, 0.0]]))
    # class 0: deviations (-1, -1), (1, 1); unbiased: sum / (2 - 1)
    assert torch.allclose(cov[0], torch.tensor([[2.0, 2.0], [2.0, 2.0]]))
    assert torch.equal(cov[1], torch.zeros(2, 2)) and torch.equal(cov[2], torch.zeros(2, 2))  # < 2 samples


def test_pooled_gaussian_by_hand():
    # one class, 1-d: client A holds {0, 2} (mean 1, unbiased var 2), client B holds {4}
    mu = torch.tensor([[[1.0]], [[4.0]]])  # (K, C, d)
    cov = torch.tensor([[[[2.0]]], [[[0.0]]]])  # (K, C, d, d)
    n = torch.tensor([[2], [1]])
    mean, Sigma, N = global_gaussians(mu, cov, n)
    # mu = (2 * 1 + 1 * 4) / 3 = 2; Sigma = 1/2 * 2 + 2/2 * 1 + 1/2 * 16 - 3/2 * 4 = 4,
    # the unbiased variance of {0, 2, 4}
    assert N.tolist() == [3] and torch.allclose(mean, torch.tensor([[2.0]], dtype=torch.float64))
    assert torch.allclose(Sigma, torch.tensor([[[4.0]]], dtype=torch.float64))


def test_pooled_gaussian_equals_the_covariance_of_the_pooled_samples():
    g = torch.Generator().manual_seed(0)
    C, d = 3, 4
    y_parts = [torch.tensor([0, 0, 0, 1, 2, 2]), torch.tensor([0, 2]), torch.tensor([1, 1, 1, 1, 0])]
    z_parts = [torch.randn(len(y), d, generator=g, dtype=torch.float64) + 3 * y.unsqueeze(1) for y in y_parts]
    stats = [class_statistics(z, y, C) for z, y in zip(z_parts, y_parts)]
    mean, Sigma, N = global_gaussians(*(torch.stack(s) for s in zip(*stats)))
    z, y = torch.cat(z_parts), torch.cat(y_parts)
    for c in range(C):
        zc = z[y == c]
        assert N[c] == len(zc)
        assert torch.allclose(mean[c], zc.mean(0), atol=1e-12)
        assert torch.allclose(Sigma[c], torch.cov(zc.T), atol=1e-12)  # unbiased, over the union
    # a class with one sample in all: zero covariance; with none: zero mean too
    mean, Sigma, N = global_gaussians(torch.ones(2, 2, 3), torch.ones(2, 2, 3, 3), torch.tensor([[1, 0], [0, 0]]))
    assert N.tolist() == [1, 0] and float(Sigma.abs().sum()) == 0.0 and torch.equal(mean[1], torch.zeros(3, dtype=torch.float64))


def test_virtual_features_have_the_gaussian_covariance():
    mean = torch.tensor([[1.0, -2.0], [0.0, 0.0]])
    Sigma = torch.tensor([[[4.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])  # the second singular
    eye = torch.eye(2).expand(2, 2, 2)  # noise e = the unit vectors: (z - mean)^T (z - mean) = A A^T
    dev = virtual_features(mean, Sigma, eye) - mean.double().unsqueeze(1)
    assert torch.allclose(dev.transpose(1, 2) @ dev, Sigma.double(), atol=1e-12)
    # the singular one lies on its line z1 - mu1 = z2 - mu2, whatever the noise
    z = virtual_features(mean, Sigma, torch.randn(2, 50, 2, generator=torch.Generator().manual_seed(1)))
    assert torch.allclose(z[1, :, 0], z[1, :, 1], atol=1e-12)
    # many draws: the sample mean and covariance approach mean and Sigma
    Sig = torch.tensor([[[2.0, 0.6], [0.6, 1.0]]])
    z = virtual_features(mean[:1], Sig, torch.randn(1, 40000, 2, generator=torch.Generator().manual_seed(2)))[0]
    assert torch.allclose(z.mean(0), mean[0].double(), atol=0.03)
    assert torch.allclose(torch.cov(z.T), Sig[0].double(), atol=0.05)


def test_virtual_features_move_as_little_as_sigma_does():
    # two nearly equal eigenvalues: a 1e-9 change of Sigma turns its eigenvectors by 45
    # degrees; V diag(sqrt(lambda)) would move the draws by O(1), the symmetric root by ~1e-9
    R = torch.tensor([[1.0, -1.0], [1.0, 1.0]], dtype=torch.float64) / 2 ** 0.5
    S1 = torch.diag(torch.tensor([1.0, 1.0 + 1e-9], dtype=torch.float64))
    S2 = R @ torch.diag(torch.tensor([1.0, 1.0 + 2e-9], dtype=torch.float64)) @ R.T
    assert float((S1 - S2).abs().max()) < 2e-9
    e = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.6, -0.8]]], dtype=torch.float64)
    mean = torch.zeros(1, 2)
    a, b = virtual_features(mean, S1[None], e), virtual_features(mean, S2[None], e)
    assert float((a - b).abs().max()) < 1e-8
    assert torch.allclose(a[0], e[0], atol=1e-8)  # Sigma ~ I: the draws are the noise itself


class Server:
    device = torch.device("cpu")

    def rng(self, rnd, *keys):
        return np.random.default_rng(rnd)


def test_calibration_repairs_a_biased_classifier_and_keeps_absent_classes():
    C, d = 3, 2
    algo = CCVR(CCVRHyper(num_virtual=200, calibration_epochs=5, calibration_lr=0.5),
                TaskInfo(num_classes=C, num_clients=2, feature_dim=d, input_shape=(2,), seed=0, rounds=1))
    # class 0 around (3, 0), class 1 around (0, 3); no client holds class 2
    mu = torch.tensor([[[3.0, 0.0], [0.0, 3.0], [0.0, 0.0]]])
    cov = (0.1 * torch.eye(d)).expand(1, C, d, d).clone()
    replies = [Record(arrays={"mean": mu[0], "cov": cov[0], "counts": torch.tensor([50, 50, 0])})]
    # the biased classifier calls everything class 0
    w = {"head.weight": torch.tensor([[1.0, 1.0], [0.0, 0.0], [-1.0, 2.0]]), "head.bias": torch.tensor([5.0, 0.0, 0.3])}
    head = algo.calibrate(w, replies, 1, Server())
    logits = mu[0, :2] @ head["head.weight"][:2].T + head["head.bias"][:2]  # the two class means
    assert logits.argmax(1).tolist() == [0, 1]
    assert torch.equal(head["head.weight"][2], w["head.weight"][2]) and head["head.bias"][2] == w["head.bias"][2]
    assert torch.equal(algo.calibrate(w, replies, 1, Server())["head.weight"], head["head.weight"])  # seeded


def test_training_is_fedavg_bit_for_bit_and_gm_is_the_calibrated_received_model(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    runs = {}
    for name, rounds in (("fedavg", 1), ("fedavg", 2), ("ccvr", 2)):
        cfg = digits_cfg(f"algorithm.name={name}", f"rounds={rounds}", "eval.personal=false")
        runs[name, rounds] = Simulation(cfg, run_dir=tmp_path / f"{name}{rounds}").run()
    w2, w3 = runs["fedavg", 1].server_state.weights, runs["fedavg", 2].server_state.weights
    ccvr = runs["ccvr", 2].server_state
    assert all(torch.equal(w3[k], ccvr.weights[k]) for k in w3)  # training: FedAvg's
    # evaluated: w_2 (what round 2's clients received and described) with a new classifier
    heads = ("head.weight", "head.bias")
    assert all(torch.equal(w2[k], ccvr.calibrated[k]) for k in w2 if k not in heads)
    assert all(torch.equal(w2[k], ccvr.head[k]) and not torch.equal(w2[k], ccvr.calibrated[k]) for k in heads)
    row = runs["ccvr", 2].rows[-1]
    assert 0 <= row["gm"] <= 1 and 0 <= row["gm@uncalibrated"] <= 1


def test_bad_hyper_parameters_are_one_line_errors(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="num_virtual"):
        digits_cfg("algorithm.name=ccvr", "algorithm.num_virtual=0")
    with pytest.raises(ConfigError, match="calibration_lr"):
        digits_cfg("algorithm.name=ccvr", "algorithm.calibration_lr=0")


@pytest.mark.parametrize("name", ["ccvr", "spherefed"])
def test_resume_after_kill_is_bit_identical(name, digits_cfg, tmp_path):
    """The calibrated model and w_t's own head are server state: a resumed run evaluates
    the same numbers (``gm``, ``gm@uncalibrated``) as an uninterrupted one."""
    from conftest import kill_and_resume, strip_timing

    cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "output.checkpoint_every=1", "training.epochs=1",
                     "eval.personal=false")
    full, resumed = kill_and_resume(cfg, tmp_path, after=2)
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    assert "gm@uncalibrated" in full.rows[-1]


def test_a_reply_without_the_statistics_calibrate_reads_is_refused():
    """calibrate reads every reply's mean, cov and counts: a reply without one, or with a
    group in its place, is refused by check_reply (it raised KeyError on the server)."""
    C, d = 3, 2
    algo = CCVR(CCVRHyper(), TaskInfo(num_classes=C, num_clients=2, feature_dim=d, input_shape=(2,), seed=0, rounds=1))
    good = {"mean": torch.zeros(C, d), "cov": torch.zeros(C, d, d), "counts": torch.ones(C)}
    assert algo.check_reply(Record(arrays=good), Record()) is None
    assert "must carry" in algo.check_reply(Record(arrays={k: v for k, v in good.items() if k != "cov"}), Record())
    assert "must carry" in algo.check_reply(Record(arrays={**good, "mean": {"m": torch.zeros(C, d)}}), Record())
    assert "shape" in algo.check_reply(Record(arrays={**good, "counts": torch.ones(C + 1)}), Record())
