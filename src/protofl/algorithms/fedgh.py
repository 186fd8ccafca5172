"""FedGH (Yi, Wang, Liu, Yu & Zhao, ACM MM 2023, "FedGH: Heterogeneous Federated Learning
with Generalized Global Header").

Every client keeps its own feature extractor f_i (architectures may differ as long as the
feature dimension d is shared); all share one prediction header H (``model.head``), which
the server trains on the class-averaged representations the clients upload:

    server -> client i: the global header theta
    client i: model = f_i(omega_i) with its header set to theta;
              E epochs of SGD on CE(H(f_i(x); theta_i), y) over omega_i and theta_i
              R_i^s = mean of f_i(x) over its samples of class s (after training)
              reply {(R_i^s, s)} for the classes s it holds
    server:   ``server_epochs`` epochs of SGD over minibatches of the round's pairs (R_i^s, s):
              theta <- theta - eta_theta grad CE(H(R_i^s; theta), s)
    personalized model: the client's f_i with its header after local training

What it rests on: the paper's text was not at hand (only its abstract); the steps above
are those the abstract states (local training with the global header, class-averaged
representations uploaded, the header trained on them by the server) in the form of the
two implementations read for this module, PFLlib's and HtFLlib's (github.com/TsingZ0,
clientgh.py / servergh.py). No equation numbers are cited.

Defaults (HtFLlib's, the library of the FedTGP authors who compare with FedGH): 100
server epochs, server SGD lr 0.01 (no momentum, re-created each round), minibatches of
10 representations (their server reuses the clients' batch size). PFLlib runs one epoch
with lr 1.0 instead.

Choices:
* The header persists across rounds (server state) and starts from the run's initial
  head, the same on every client and the server. Minibatch order: the server's stream
  of the round.
* Representations are the class means over the whole training set after local training,
  in eval mode; both libraries take them after training in eval mode too, but over their
  training loader, which drops the last partial batch (``drop_last=True``).
* Family: prototype exchange (only class representations go up; the header is learned
  from them), like FedProto, whose client state and messages it shares.
* Messages are FedProto's sparse prototype arrays (``protos``, ``classes``, ``counts``);
  the header travels down as the ``head.*`` entries of ``weights``. No global model: the
  header alone has no feature extractor (GA = the mean of the personalized models).
* The personalized model is the client's model right after local training (protofl's
  convention); the libraries evaluate f_i with the next round's global header.

Under ``privacy.mode: sample`` the extractor trains by DP-SGD and the uploaded R_i^s and
counts are released privately (:func:`protofl.nn.privacy.release_class_means`, one release
a round): FedGH's whole upload is then private at the record level, and the server's
header is post-processing of it (docs/privacy.md).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require, require_size
from ..messages import Record
from ..nn.privacy import release_class_means
from ..nn.prototypes import prototype_rows
from .base import ClientContext, ClientResult, register, ServerContext
from .fedproto import dense, FedProto, sparse

HEAD = "head."  # the header's entries in the model's state dict


@dataclass
class FedGHHyper:
    server_epochs: int = 100
    server_lr: float = 0.01
    server_batch: int = 10  # representations per server step

    def validate(self, section: str) -> None:
        require(self.server_epochs >= 0, f"{section}.server_epochs", self.server_epochs, "must be >= 0")
        require(self.server_lr > 0, f"{section}.server_lr", self.server_lr, "must be > 0")
        require_size(self, section, "server_batch")


@dataclass
class HeaderState:
    header: dict[str, torch.Tensor]  # the global header's entries (``head.weight``, ``head.bias``, ...)


def train_header(head: torch.nn.Module, reps: torch.Tensor, labels: torch.Tensor, epochs: int, lr: float,
                 batch: int, generator: torch.Generator) -> Optional[float]:
    """The server's step: ``epochs`` passes of SGD on CE(head(R), s) over shuffled minibatches of
    the representations ``reps`` (n, d) and their classes ``labels`` (n,); trains ``head`` in
    place and returns the last minibatch loss (None without a step)."""
    opt = torch.optim.SGD(head.parameters(), lr=lr)
    loss = None
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator).to(labels.device)
        for s in range(0, len(labels), batch):
            idx = order[s:s + batch]
            loss = F.cross_entropy(head(reps[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return None if loss is None else float(loss.detach())


@register
class FedGH(FedProto[HeaderState]):
    name = "fedgh"
    Hyper = FedGHHyper

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> HeaderState:
        return HeaderState({k: v for k, v in ctx.init_weights().items() if k.startswith(HEAD)})

    def configure(self, state: HeaderState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.header)

    def aggregate(self, state: HeaderState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> HeaderState:
        if not replies:
            return state
        C, d, dev = self.info.num_classes, self.info.feature_dim, ctx.device
        tables = [dense(r, C, d) for _, r in replies]
        reps, labels = prototype_rows([p for p, _ in tables], [c for _, c in tables])
        reps, labels = reps.to(dev), labels.to(dev)  # the round's class representations R_i^s and classes s
        # a private copy: the shared model stays as it is
        head = copy.deepcopy(cast(nn.Module, ctx.shared_model().head)).to(dev)
        head.load_state_dict({k[len(HEAD):]: v for k, v in state.header.items()})
        g = torch.Generator()
        g.manual_seed(int(ctx.rng(rnd, "fedgh").integers(2**62)))
        loss = train_header(head, reps, labels, self.hp.server_epochs, self.hp.server_lr, self.hp.server_batch, g)
        if loss is not None:
            ctx.log("header_loss", loss)
        return HeaderState({HEAD + k: v.detach().clone() for k, v in head.state_dict().items()})

    def class_vectors(self, state: HeaderState) -> Optional[torch.Tensor]:
        return state.header.get(HEAD + "weight")  # the header's class rows (C, d) for a linear head

    # -- client ------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        C = self.info.num_classes
        _, y = ctx.data
        assert state is not None  # client_init made it (the client's own model)
        fitted = await ctx.fit({**state.weights, **msg.weights})  # own extractor, the global header
        z = await ctx.features(fitted.weights)
        protos, counts = release_class_means(ctx, z, y, C)  # R_i^s, after training (private under privacy.*)
        reply = Record(arrays=sparse(protos.detach().cpu(), counts.cpu()))
        return ClientResult(reply, state=Record(weights=fitted.weights), personal=ctx.shared_model(fitted.weights))
