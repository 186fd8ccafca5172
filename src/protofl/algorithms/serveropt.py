"""Server optimizers: what the server of a method with one global model does with the
round's aggregate. One implementation for every :class:`~protofl.algorithms.base.GlobalModel`
method (``algorithm.server_opt``); the registered ``fedavgm``, ``fedadam``, ``fedyogi`` and
``fedadagrad`` (``fedopt.py``) are FedAvg with one of them.

FedAvgM: Hsu, Qi & Brown, 2019, "Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification" (arXiv:1909.06335), section 3. FedAdagrad, FedYogi,
FedAdam: Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar & McMahan, ICLR 2021,
"Adaptive Federated Optimization", Algorithm 2. Round t, after the method's aggregation
gave x_bar (FedAvg: the weighted average of the replies; FedDyn: its corrected mean;
SCAFFOLD: x_t + mean Delta y; FedNova: its normalized average):

    Delta_t = x_bar - x_t                       (Algorithm 2's Delta_t, minus the pseudo-gradient)
    none:     x_{t+1} = x_bar                   (the method's own server step, unchanged)
    avgm:     m_t = beta m_{t-1} + Delta_t;                    x_{t+1} = x_t + eta m_t
    adagrad:  m_t = beta_1 m_{t-1} + (1 - beta_1) Delta_t;     v_t = v_{t-1} + Delta_t^2
    yogi:     m_t as adagrad;  v_t = v_{t-1} - (1 - beta_2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
    adam:     m_t as adagrad;  v_t = beta_2 v_{t-1} + (1 - beta_2) Delta_t^2
              (adagrad, yogi, adam)  x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)
    m_{-1} = 0,  v_{-1} = tau^2   (Algorithm 2 asks v_{-1} >= tau^2)

avgm is Hsu et al.'s v <- beta v + Delta w, w <- w - eta v with Delta w = -Delta_t: with
beta = 0 and eta = 1 it is FedAvg. Settings (``algorithm.<key>``, on every GlobalModel method):

* ``server_opt``: none (default) | avgm | adam | yogi | adagrad;
* ``server_lr`` (eta): null = the optimizer's default in :data:`DEFAULT_SERVER_LR`;
* ``server_momentum`` (beta of avgm, beta_1 of the adaptive ones), default 0.9;
* ``server_beta2`` (beta_2 of adam and yogi), default 0.999;
* ``server_tau`` (tau, the adaptivity / epsilon of the adaptive ones), default 1e-3.

Where the defaults come from: the authors' released hyper-parameter notes
(google-research/federated, optimization/docs/hyperparameters.md) give FedAvgM's momentum
0.9, beta_1 = 0.9 and beta_2 = 0.999 ("set by default to 0.9 and 0.999"), and recommend
tau = 1e-3; eta is the value their tuning found best most often over their six tasks
(1 for FedAvgM, 10^-2 for FedAdam and FedYogi, 10^-1 for FedAdagrad, tied there with
10^-1.5; on EMNIST characters, the task closest to ours: 10^-0.5, 10^-2.5, 10^-2.5,
10^-1). beta_1 = 0.9 applies to adagrad too, as Algorithm 2 prints FedAdagrad with m_t;
the authors' code runs Keras' Adagrad, which has no momentum (beta_1 = 0: set
``server_momentum: 0`` for that). Tune eta and tau for a new task, as the paper does.

Choices where the papers are silent:
* The optimizer moves the model's parameters only. Buffers (BatchNorm's running statistics,
  its integer counters) take x_bar's value: a momentum or adaptive step could push a
  running variance below zero. (The paper's models use GroupNorm, not BatchNorm.)
* Entries no reply carries (a fixed head, FedNH's prototypes, a personal head) keep their
  value and get no optimizer state.
* A round where nobody arrived leaves x_t, m and v as they are (no step with Delta = 0).
* m and v are part of the server state (``WeightsState.server_opt_state``): checkpointed
  and restored with it, so a resumed run continues bit-identically.

Deviations from the authors' code: Algorithm 2 has no bias correction and starts from
v_{-1} >= tau^2; the authors' TensorFlow code runs the Keras Adam and their own Yogi, both
with bias correction, and Keras' Adagrad, without momentum, and starts Adagrad's and Yogi's
accumulators at 0. Here is Algorithm 2 as printed. fluke's FedOpt
adds m_t to the step (x + m + eta m / (sqrt v + tau)) and starts v at random values below
tau^2; neither is followed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Optional

import torch

from ..errors import require

ServerOpt = Literal["none", "avgm", "adam", "yogi", "adagrad"]
SERVER_OPTS = ("none", "avgm", "adam", "yogi", "adagrad")
# eta when server_lr is null (see the module docstring for where they come from)
DEFAULT_SERVER_LR = {"avgm": 1.0, "adam": 1e-2, "yogi": 1e-2, "adagrad": 1e-1}


@dataclass(kw_only=True)
class ServerOptHyper:
    """The server-optimizer settings every GlobalModel method's ``Hyper`` includes (a base
    class of it). Keyword-only, so that a method's own fields keep their positions."""

    server_opt: ServerOpt = "none"
    server_lr: Optional[float] = None  # eta; None: DEFAULT_SERVER_LR[server_opt]
    server_momentum: float = 0.9  # beta (avgm) / beta_1 (adam, yogi, adagrad)
    server_beta2: float = 0.999  # beta_2 (adam, yogi)
    server_tau: float = 1e-3  # tau (adam, yogi, adagrad)

    def __post_init__(self) -> None:  # checked however the Hyper is made; methods' validate() stays theirs
        section = "algorithm"
        require(self.server_opt in SERVER_OPTS, f"{section}.server_opt", self.server_opt,
                f"must be one of {', '.join(SERVER_OPTS)}")
        require(self.server_lr is None or self.server_lr > 0, f"{section}.server_lr", self.server_lr,
                "must be > 0 (or null: the optimizer's default)")
        require(0 <= self.server_momentum < 1, f"{section}.server_momentum", self.server_momentum,
                "must be in [0, 1)")
        require(0 <= self.server_beta2 < 1, f"{section}.server_beta2", self.server_beta2, "must be in [0, 1)")
        require(0 < self.server_tau <= 1e18, f"{section}.server_tau", self.server_tau,
                "must be > 0 and at most 1e18 (v starts at tau^2, a float32)")

    @property
    def eta(self) -> float:
        """The server learning rate in effect."""
        return self.server_lr if self.server_lr is not None else DEFAULT_SERVER_LR.get(self.server_opt, 1.0)


# the (algorithm, key, default) of these settings: at their defaults they stay out of a
# config's fingerprint (config/schema.py), so the run folders of earlier runs keep their names
SERVER_OPT_DEFAULTS = tuple((f.name, f.default) for f in ServerOptHyper.__dataclass_fields__.values())


def server_step(hp: ServerOptHyper, x: Mapping[str, torch.Tensor], x_bar: Mapping[str, torch.Tensor],
                moments: Optional[Mapping[str, Mapping[str, torch.Tensor]]],
                params: frozenset[str]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """One step of ``hp.server_opt`` (not "none") from x_t (``x``, the full state dict) and the
    round's aggregate ``x_bar`` (the entries the replies carried). ``moments``: {"m": {...},
    "v": {...}} from the last step (None before the first); ``params``: the names of the model's
    parameters (the only entries the optimizer moves). Returns x_{t+1} (every entry of ``x``)
    and the new moments."""
    opt, eta = hp.server_opt, hp.eta
    m_prev = (moments or {}).get("m", {})
    v_prev = (moments or {}).get("v", {})
    out = dict(x)
    m_new: dict[str, torch.Tensor] = {}
    v_new: dict[str, torch.Tensor] = {}
    for k, target in x_bar.items():
        if k not in params or not target.is_floating_point():
            out[k] = target  # buffers: x_bar's value
            continue
        w = x[k]
        delta = target.to(w.dtype) - w  # Delta_t
        m = m_prev.get(k)
        if opt == "avgm":
            m = delta.clone() if m is None else m * hp.server_momentum + delta
            out[k] = w + eta * m
            m_new[k] = m
            continue
        b1 = hp.server_momentum
        m = (1 - b1) * delta if m is None else b1 * m + (1 - b1) * delta
        v = v_prev.get(k)
        if v is None:
            v = torch.full_like(w, hp.server_tau ** 2)  # v_{-1} = tau^2
        d2 = delta * delta
        if opt == "adagrad":
            v = v + d2
        elif opt == "yogi":
            v = v - (1 - hp.server_beta2) * d2 * torch.sign(v - d2)
        elif opt == "adam":
            v = hp.server_beta2 * v + (1 - hp.server_beta2) * d2
        else:
            raise ValueError(f"unknown server optimizer {opt!r}; expected one of {', '.join(SERVER_OPTS)}")
        out[k] = w + eta * m / (v.sqrt() + hp.server_tau)
        m_new[k], v_new[k] = m, v
    return out, ({"m": m_new, "v": v_new} if v_new else {"m": m_new})
