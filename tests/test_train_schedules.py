"""The clients' optimizers and learning-rate schedules against torch's own.

Every optimizer of ``training.optimizer`` steps rows of parameters (one row per client,
engine/train.py ``optimizer_step``: both executors use it); each row must follow
``torch.optim``'s optimizer of that name on the same gradients, step for step. Every
``training.schedule`` must give the lr that ``torch.optim.lr_scheduler`` gives when
stepped once after each round."""
import math

import pytest
import torch

from protofl.config import ConfigError, load_config
from protofl.engine.train import TrainSettings, optimizer_state, optimizer_step, reset_rows, round_lr

from conftest import DIGITS

STEPS = 50

OPTIMIZERS = {  # name: (protofl's settings, torch's optimizer on the same settings)
    "sgd": (dict(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "sgd momentum, weight decay": (dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
                                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "adam": (dict(lr=0.01, optimizer="adam", weight_decay=1e-3),
             lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-3)),
    "adamw": (dict(lr=0.01, optimizer="adamw", weight_decay=1e-2, betas=(0.8, 0.99), eps=1e-6),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=1e-2, betas=(0.8, 0.99), eps=1e-6)),
    "rmsprop": (dict(lr=0.01, optimizer="rmsprop"), lambda p: torch.optim.RMSprop(p, lr=0.01)),
    "rmsprop momentum, weight decay": (
        dict(lr=0.01, optimizer="rmsprop", momentum=0.5, weight_decay=1e-3, alpha=0.9, eps=1e-6),
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, weight_decay=1e-3, alpha=0.9, eps=1e-6)),
    "adagrad": (dict(lr=0.1, optimizer="adagrad", eps=1e-10), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "adagrad weight decay": (dict(lr=0.1, optimizer="adagrad", weight_decay=1e-2, eps=1e-10),
                             lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=1e-2)),
}


@pytest.mark.parametrize("lr_tensor", [False, True], ids=["lr float", "lr tensor"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_equals_torchs_step_for_step(name, lr_tensor):
    """Also with the learning rate given as a 0-d tensor (the compiled step's input)."""
    ours, theirs = OPTIMIZERS[name]
    s = TrainSettings(**ours)
    lr = torch.tensor(s.lr, dtype=torch.float64) if lr_tensor else None
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (4,)]
    rows = 3  # three clients side by side; the third joins late (its state starts at zero)
    start = [torch.randn(rows, *sh, generator=g, dtype=torch.float64) for sh in shapes]
    params = [t.clone() for t in start]
    state = optimizer_state(s, params)
    refs = [[torch.nn.Parameter(t[r].clone()) for t in start] for r in range(rows)]
    opts = [theirs(ps) for ps in refs]
    for step in range(STEPS):
        grads = [torch.randn(rows, *sh, generator=g, dtype=torch.float64) for sh in shapes]
        if step == 20:  # a new client enters row 2: its parameters and a fresh optimizer
            reset_rows(state, 2)
            for t, p in zip(params, refs[2]):
                p.data.copy_(t[2])
            opts[2] = theirs(refs[2])
        assert optimizer_step(params, grads, state, s, lr) is None  # no clipping: no norms
        for r in range(rows):
            for p, gr in zip(refs[r], grads):
                p.grad = gr[r].clone()
            opts[r].step()
        for r in range(rows):
            for t, p in zip(params, refs[r]):
                torch.testing.assert_close(t[r], p.data, rtol=1e-12, atol=1e-12, msg=f"{name}, step {step}, row {r}")


def test_gradient_clipping_equals_clip_grad_norm():
    """The step clips each row as clip_grad_norm_ clips that client's gradients, and returns
    the norms it clipped by (clip_grad_norm_'s return value)."""
    s = TrainSettings(lr=0.1, clip_grad=0.5, optimizer="rmsprop")
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 3, 2, generator=g, dtype=torch.float64)]
    params = [t.clone() for t in start]
    state = optimizer_state(s, params)
    refs = [[torch.nn.Parameter(t[r].clone()) for t in start] for r in range(2)]
    opts = [torch.optim.RMSprop(ps, lr=0.1) for ps in refs]
    for _ in range(10):
        grads = [3 * torch.randn(t.shape, generator=g, dtype=torch.float64) for t in start]
        norms = optimizer_step(params, grads, state, s)
        for r in range(2):
            for p, gr in zip(refs[r], grads):
                p.grad = gr[r].clone()
            total = torch.nn.utils.clip_grad_norm_(refs[r], 0.5)
            assert norms is not None and norms[r].item() == total.item() > 0.5  # (clipped: 3x unit normals)
            opts[r].step()
    for r in range(2):
        for t, p in zip(params, refs[r]):
            torch.testing.assert_close(t[r], p.data, rtol=1e-12, atol=1e-12)


def _training(*overrides):
    return load_config(DIGITS, list(overrides)).training


def _torch_lrs(make, rounds, lr):
    """The lr of each round: torch's scheduler stepped once after each round."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(rounds):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


S = torch.optim.lr_scheduler
SCHEDULES = {  # name: (overrides, torch's scheduler)
    "constant": ([], lambda o: S.ExponentialLR(o, gamma=1.0)),
    "exponential": (["training.lr_decay=0.9"], lambda o: S.ExponentialLR(o, gamma=0.9)),
    # a milestone names the first round at the lower lr: torch's milestone one epoch earlier
    "multi-step": (["training.schedule=step", "training.milestones=[5, 12, 20]", "training.lr_decay=0.5"],
                   lambda o: S.MultiStepLR(o, milestones=[4, 11, 19], gamma=0.5)),
    "step": (["training.schedule=step", "training.step_size=7", "training.lr_decay=0.3"],
             lambda o: S.StepLR(o, step_size=7, gamma=0.3)),
    "cosine": (["training.schedule=cosine", "training.min_lr=0.001"],
               lambda o: S.CosineAnnealingLR(o, T_max=30, eta_min=0.001)),
    "warm-up, then cosine": (
        ["training.schedule=cosine", "training.min_lr=0.001", "training.warmup_rounds=5", "training.warmup_factor=0.2"],
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.2, total_iters=5),
                                     S.CosineAnnealingLR(o, T_max=25, eta_min=0.001)], milestones=[5])),
    "warm-up, then step": (
        ["training.schedule=step", "training.step_size=4", "training.lr_decay=0.5", "training.warmup_rounds=3"],
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=3), S.StepLR(o, 4, 0.5)],
                                 milestones=[3])),
    "warm-up alone": (["training.warmup_rounds=10", "training.warmup_factor=0.5"],
                      lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.5, total_iters=10),
                                                   S.ExponentialLR(o, gamma=1.0)], milestones=[10])),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_equals_torchs_scheduler_stepped_once_a_round(name):
    overrides, make = SCHEDULES[name]
    rounds = 30
    tc = _training("training.lr=0.1", *overrides)
    ours = [round_lr(tc, r, rounds) for r in range(1, rounds + 1)]
    theirs = _torch_lrs(make, rounds, 0.1)
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(ours, theirs)), \
        list(zip(ours, theirs))


@pytest.mark.parametrize("bad, fragment", [
    (["training.schedule=step"], "milestone rounds or a step_size"),
    (["training.schedule=step", "training.milestones=[3]", "training.step_size=2"], "one of the two"),
    (["training.schedule=step", "training.step_size=0"], "step_size"),
    (["training.warmup_rounds=-1"], "warmup_rounds"),
    (["training.warmup_factor=0"], "warmup_factor"),
    (["training.optimizer=rmsprop", "training.alpha=1.0"], "training.alpha"),
    (["training.optimizer=adagrad", "training.momentum=0.9"], "training.momentum"),
    (["training.optimizer=lbfgs"], "training.optimizer"),
])
def test_bad_optimizer_and_schedule_settings_are_one_line(bad, fragment):
    with pytest.raises(ConfigError) as e:
        _training(*bad)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("optimizer", [["training.optimizer=rmsprop", "training.momentum=0.5"],
                                       ["training.optimizer=adagrad", "training.momentum=0", "training.eps=1e-10"]])
def test_rmsprop_and_adagrad_give_the_same_run_on_both_executors(digits_cfg, tmp_path, optimizer):
    from protofl.api import run

    cfg = digits_cfg("rounds=2", "partition.num_clients=4", "partition.beta=0.2", "training.batch_size=24",
                     "participation.fraction=1.0", "training.lr=0.01", "training.weight_decay=1e-3",
                     "eval.final_all_clients=false", "training.schedule=cosine", "training.warmup_rounds=1",
                     *optimizer)
    seq = run(cfg.replace(**{"execution.executor": "sequential"}), run_dir=tmp_path / "seq")
    bat = run(cfg.replace(**{"execution.executor": "batched"}), run_dir=tmp_path / "bat")
    assert bat.summary["execution"]["executor"] == "batched"
    for k, a in seq.server_state.weights.items():
        torch.testing.assert_close(bat.server_state.weights[k], a, atol=1e-5, rtol=1e-4, msg=k)
    assert [r["lr"] for r in seq.rows] == [round_lr(cfg.training, r, 2) for r in (1, 2)] == [0.001, 0.01]
