"""FedTGP (Zhang, Liu, Hua & Cao, AAAI 2024, "FedTGP: Trainable Global Prototypes with
Adaptive-Margin-Enhanced Contrastive Learning for Data and Model Heterogeneity in Federated
Learning").

FedProto's clients (only prototypes travel, architectures may differ as long as the
feature dimension d is shared) with a server that *learns* the global prototypes instead
of averaging them:

    client i (FedProto's local step), given the global prototypes P_hat^c:
        minimize  CE(h_i(f_i(x)), y) + lambda * L_R(f_i(x), P_hat^y)
        reply its prototypes P_i^c = mean of f_i(x) over its samples of class c (after training)
    server, with the round's client prototypes {(P_i^c, c)}:
        Q^c = 1/|N_c| sum_{i in N_c} P_i^c                          (class "cluster" centres)
        delta = min( max_c min_{c' != c} ||Q^c - Q^{c'}||_2 , tau )           (adaptive margin)
        TGP: P_hat^c = W_2 ReLU(W_1 e^c + b_1) + b_2, e^c a trainable class embedding
        ``server_epochs`` epochs of SGD over minibatches of the pairs (P_i^c, c) on ACL:
          L = -log [ exp(-(||P_i^c - P_hat^c|| + delta))
                     / ( exp(-(||P_i^c - P_hat^c|| + delta)) + sum_{c' != c} exp(-||P_i^c - P_hat^{c'}||) ) ]
        send P_hat = TGP(every class)
    inference: FedProto's (nearest global prototype; ``@own``, ``@logits``)

What the equations rest on: the paper's text was not at hand (only its abstract and the
authors' slides, which state the margin-enhanced contrastive objective, "a margin
threshold" tau and the "maximum cluster margin"); the rest follows the authors' release
(github.com/TsingZ0/FedTGP, servertgp.py / clienttgp.py, read for this module), so no
equation numbers are cited.

Defaults (the authors' run script, system/run_me.sh): lambda = 10 (with the MSE form of
L_R, ``distance: mse``; a comment in their client says both follow FedProto's code),
tau = 100, 100 server epochs, server SGD lr 0.01 and minibatches of 10 prototypes (their
server reuses the clients' lr and batch size); the TGP's hidden width is d.

Choices and deviations:
* The TGP persists across rounds (server state); its SGD (no momentum) is re-created
  each round, as in the code. Its initialization comes from the run's seed, its
  minibatch order from the server's stream of the round.
* The code sends P_hat^c for every class, also those no client has ever uploaded (the
  untrained embedding's output); here only classes with at least one uploaded prototype
  so far get one (the others have none, as in FedProto: L_R = 0 for them).
* Fewer than two classes uploaded in a round: no other class to keep a margin from, so
  delta = 0 (the code's placeholder makes it tau).
* ||.|| is sqrt(max(squared distance, 1e-12)): the code's sqrt of the expanded square can
  go negative (nan) for coincident points.
* A round in which no arriving reply holds a prototype (clients without data, or
  ``privacy.mode: sample`` counts rounded to 0) leaves the TGP and the global
  prototypes as they were.

The local prototypes are FedProto's (class means over the whole training set after
training, eval mode), as in the authors' code (clienttgp.py's collect_protos, whose
loader drops the last partial batch), and so is inference, the nearest global prototype
over every class that has one (see fedproto.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require, require_size
from ..messages import Record
from ..nn.prototypes import aggregate_prototypes, prototype_rows
from .base import register, ServerContext
from .fedproto import dense, FedProto, ProtoState


@dataclass
class FedTGPHyper:
    lam: float = 10.0  # lambda: weight of L_R (the authors' run script)
    distance: Literal["mse", "sq_l2", "l2"] = "mse"  # L_R, as FedProto's (fedproto.py)
    tau: float = 100.0  # margin threshold
    server_epochs: int = 100
    server_lr: float = 0.01
    server_batch: int = 10  # client prototypes per server step
    hidden: Optional[int] = None  # TGP hidden width (None: the feature dimension d)

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")
        require(self.tau >= 0, f"{section}.tau", self.tau, "must be >= 0")
        require(self.server_epochs >= 0, f"{section}.server_epochs", self.server_epochs, "must be >= 0")
        require(self.server_lr > 0, f"{section}.server_lr", self.server_lr, "must be > 0")
        require_size(self, section, "server_batch", "hidden")


@dataclass
class TGPState(ProtoState):
    generator: dict[str, torch.Tensor]  # the TGP's state dict (class embeddings and the two linear layers)


class TrainablePrototypes(nn.Module):
    """The TGP: P_hat^c = W_2 ReLU(W_1 e^c + b_1) + b_2 for every class c at once, (C, d)."""

    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self) -> torch.Tensor:
        return cast(torch.Tensor, self.net(self.embedding.weight))


def adaptive_margin(centres: torch.Tensor, present: torch.Tensor, tau: float) -> float:
    """delta = min(max_c min_{c' != c} ||Q^c - Q^{c'}||, tau) over the classes ``present`` (C,)
    of the class centres Q (C, d); 0 with fewer than two present classes."""
    Q = centres[present].double()
    if len(Q) < 2:
        return 0.0
    D = torch.cdist(Q, Q, compute_mode="donot_use_mm_for_euclid_dist")
    D.fill_diagonal_(float("inf"))
    return min(float(D.min(1).values.max()), float(tau))


def acl_loss(protos: torch.Tensor, labels: torch.Tensor, generated: torch.Tensor, delta: float) -> torch.Tensor:
    """ACL on a batch: the mean over the client prototypes ``protos`` (n, d) of class
    ``labels`` (n,) of CE(-(||P - P_hat^c|| + delta 1[c = y])_c, y); ``generated`` (C, d)."""
    sq = ((protos.unsqueeze(1) - generated.unsqueeze(0)) ** 2).sum(2)  # (n, C)
    dist = torch.sqrt(sq.clamp(min=1e-12)) + delta * F.one_hot(labels, generated.shape[0]).to(sq.dtype)
    return F.cross_entropy(-dist, labels)


@register
class FedTGP(FedProto[TGPState]):
    name = "fedtgp"
    Hyper = FedTGPHyper

    def tgp(self) -> TrainablePrototypes:
        d = self.info.feature_dim
        return TrainablePrototypes(self.info.num_classes, d, self.hp.hidden or d)

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> TGPState:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(ctx.rng(0, "fedtgp-init").integers(2**62)))
            gen = {k: v.to(ctx.device) for k, v in self.tgp().state_dict().items()}
        base = super().server_init(ctx)
        return TGPState(base.protos, base.counts, gen)

    def aggregate(self, state: TGPState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> TGPState:
        if not replies:
            return state
        C, d, dev = self.info.num_classes, self.info.feature_dim, ctx.device
        tables, table_counts = zip(*(dense(r, C, d) for _, r in replies))
        # the round's client prototypes P_i^c and their classes c
        P, y = prototype_rows(list(tables), list(table_counts))
        P, y = P.to(dev), y.to(dev)
        centres, n = aggregate_prototypes(list(tables), list(table_counts), "uniform")  # Q^c
        delta = adaptive_margin(centres, n > 0, self.hp.tau)
        ctx.log("tgp_margin", delta)
        if len(y) == 0:  # no arriving reply holds a class (empty clients, noisy counts rounded to 0)
            return state  # no pair to train the TGP on: it and the global prototypes stay

        gen = self.tgp().to(dev)
        gen.load_state_dict(state.generator)
        opt = torch.optim.SGD(gen.parameters(), lr=self.hp.server_lr)
        g = torch.Generator()
        g.manual_seed(int(ctx.rng(rnd, "fedtgp").integers(2**62)))
        B = self.hp.server_batch
        for _ in range(self.hp.server_epochs):
            order = torch.randperm(len(y), generator=g).to(dev)
            for s in range(0, len(y), B):
                idx = order[s:s + B]
                loss = acl_loss(P[idx], y[idx], gen(), delta)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        if self.hp.server_epochs > 0:
            ctx.log("tgp_loss", float(loss.detach()))
        with torch.no_grad():
            generated = gen().detach().cpu()
        # a class has a global prototype once any client uploaded one (its latest count kept)
        counts = torch.where(n > 0, n, state.counts)
        protos = torch.where((counts > 0).unsqueeze(1), generated, torch.zeros_like(generated))
        return TGPState(protos, counts, {k: v.detach().clone() for k, v in gen.state_dict().items()})
