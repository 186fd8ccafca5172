"""FedReMa (Liang, Zhan, Liu, Zhang, Tan & Chen, ECAI 2024, "FedReMa: Improving Personalized
Federated Learning via Leveraging the Most Relevant Clients", arXiv:2411.01825).

A shared feature extractor (``model.body``, FedAvg over every arriving client) and a personal
linear classifier per client, which the server rebuilds every round from the classifiers of
the client's most relevant peers. Relevance is the similarity of the classifiers' soft
predictions (logits) on the same probe features; during the critical co-learning period
(CCP) the peers are chosen by maximum difference segmentation (MDS), after it from the
history of those choices:

    client i: (w_t^B, its classifier phi_i) -> E epochs of SGD on CE over both
              reply the body w_i^B and phi_i (and, with ``probe: prototypes``, its class means)
    server, over the round's K clients:
        w_{t+1}^B = sum_i n_i / n w_i^B                                        (FedAvg)
        p_j(r) = softmax(phi_j(r) / T) on probe features r
        S_ij = mean_r cos(p_i(r), p_j(r)),  S_ii = 1                            (similarity)
        in the CCP, for each i (MDS): sort S_i. ascending, s_(1) <= ... <= s_(K) = S_ii;
            m = argmax_{k < K-1} (s_(k+1) - s_(k))      (the largest gap below the top one)
            R_i = the clients above that gap (s_(m+1) .. s_(K): i and >= 1 peer)
            phi_i <- 1/|R_i| sum_{j in R_i} phi_j;   A_ij += 1 for j in R_i    (dependency map)
            g_t = mean_i (s_(m+1) - s_(m));  G = max_{t' <= t} g_t'
            the CCP ends for good once g_t < delta * G
        after the CCP:  phi_i <- sum_j A_ij phi_j / sum_j A_ij   (j over the round's clients)

The combined classifier is kept on the server and sent with client i's next message.

What it rests on: only the paper's abstract could be read (arXiv 2411.01825; no copy of
its method section, equations or algorithm box was reachable), so no equation numbers are
cited. The steps above are those of the authors' release (github.com/liangh68/FedReMa,
system/flcore/servers/serverReMa.py and clients/clientReMa.py, read for this module, a
PFLlib port), with its defaults: delta = 0.5 (``--delta``), the random probe
(``--sim_type 0``), plain CE training (``--training_type 0``). No other library (PFLlib,
FL-bench, fluke) implements it.

Choices and deviations:
* ``probe: random`` (the code's default): for each client i one probe r_i ~ U[0, 0.5)^d (the
  code's ``torch.rand_like(proto) * 0.5``) drawn by the server from its round stream;
  ``probe: prototypes`` (the code's ``--sim_type 1``): the probes are the round's global
  prototypes, the plain mean over the clients holding a class of their class means after
  training; the similarity is the mean over the classes held (the code divides by C,
  counting classes nobody holds as 0, which scales g_t by the share of classes held).
* One temperature T for every client's softmax (default 1). The random-probe code sharpens
  client i's own prediction with T = 0.5 and its peers' with T = 1 (its prototype probe
  uses 1 for both); an own/peer asymmetry we do not reproduce.
* The code combines classifiers with weights indexed by client id but zipped with the
  uploads in their (randomly permuted) arrival order, so it mixes other clients'
  classifiers than the ones MDS chose; here each weight goes to its client's classifier.
* MDS needs K >= 3 arrivals (the code fails below). With K <= 2 every arriving client is
  relevant (for K = 2: itself and its one peer, the code's minimum), and the round adds
  no g_t.
* After the CCP the code weighs all N clients' uploads by A (full participation); here
  the weights are renormalized over the round's clients; a client with no such count
  keeps its own classifier.
* ``model.head`` (the last linear layer) is the classifier; the code's CNN puts its two
  fully connected layers in the head. Training is the run's optimizer (the code: SGD,
  momentum 0.9, gradient norm clipped at 10).
* The personalized model is the client's model after local training, before the server
  combines classifiers (protofl's convention); the code evaluates the combined
  classifier on the next round's averaged body.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import require
from ..messages import Arrays, Record, expect_arrays, expect_shapes
from ..nn.prototypes import aggregate_prototypes, class_means
from .base import ClientContext, ClientResult, register, reply_weight, ServerContext, WeightsState
from .fedavg import FedAvgHyper
from .fedpac import head_problem, model_heads_only
from .fedper import FedPer

PROBES = ("random", "prototypes")


@dataclass
class FedReMaHyper(FedAvgHyper):
    delta: float = 0.5  # the CCP ends once g_t < delta * max g (the code's --delta)
    probe: str = "random"  # probe features: random (the code's sim_type 0) or prototypes (1)
    temperature: float = 1.0  # softmax temperature T of the predictions compared
    probe_scale: float = 0.5  # random probes ~ U[0, probe_scale)^d (the code's 0.5)

    def validate(self, section: str) -> None:
        require(0 < self.delta <= 1, f"{section}.delta", self.delta, "must be in (0, 1]")
        require(self.probe in PROBES, f"{section}.probe", self.probe, f"must be one of {', '.join(PROBES)}")
        require(self.temperature > 0, f"{section}.temperature", self.temperature, "must be > 0")
        require(self.probe_scale > 0, f"{section}.probe_scale", self.probe_scale, "must be > 0")


@dataclass
class FedReMaState(WeightsState):  # weights: the body (and the initial classifier)
    heads: dict[str, torch.Tensor]  # head entry -> (N, ...) each client's combined classifier
    combined: torch.Tensor  # (N,) bool: the client has one
    depend: torch.Tensor  # (N, N) A_ij: rounds in which MDS chose j for i
    peak: torch.Tensor  # () G, the largest g_t so far
    ccp: torch.Tensor  # () bool: still in the critical co-learning period


def logit_similarity(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """S (K, K) from the K classifiers' logits (K, M, C) on the same M probes:
    S_ij = mean_m cos(softmax(logits_im / T), softmax(logits_jm / T))."""
    p = F.normalize(torch.softmax(logits.double() / temperature, dim=-1), dim=-1)  # (K, M, C)
    return torch.einsum("imc,jmc->ijm", p, p).mean(-1)


def mds(s: torch.Tensor, i: int) -> tuple[list[int], Optional[float]]:
    """Maximum difference segmentation of client i's similarity row s (K,): the clients above the
    largest gap of the sorted row, the top gap (to i itself) excluded, and that gap; with K <= 2
    every client and no gap. i ranks last among ties (S_ii = 1 is the row's maximum)."""
    s = s.detach().double().cpu().numpy().copy()
    K = len(s)
    if K <= 2:
        return list(range(K)), None
    s[i] = 1.0
    order = np.lexsort((np.arange(K) == i, s))  # ascending s, i last among equals
    gaps = np.diff(s[order])[:-1]  # the K-2 gaps below the top one
    m = int(np.argmax(gaps))
    return sorted(int(j) for j in order[m + 1:]), float(gaps[m])


@register
class FedReMa(FedPer[FedReMaState]):
    name = "fedrema"
    Hyper = FedReMaHyper
    reply_arrays = ("head", "proto", "counts")  # besides the body

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedReMaState:
        w, N = ctx.init_weights(), self.info.num_clients
        heads = {k: torch.zeros(N, *v.shape, dtype=v.dtype) for k, v in self.personal_part(w).items()}
        return FedReMaState(w, heads, torch.zeros(N, dtype=torch.bool), torch.zeros(N, N, dtype=torch.float64),
                            torch.zeros((), dtype=torch.float64), torch.tensor(True))

    def configure_client(self, state: FedReMaState, rnd: int, cid: int, ctx: ServerContext) -> Optional[Record]:
        if not bool(state.combined[cid]):
            return None
        return Record(weights={k: v[cid] for k, v in state.heads.items()})

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        problem = head_problem(self, reply, sent)
        if problem or self.hp.probe != "prototypes":
            return problem
        C, d = self.info.num_classes, self.info.feature_dim
        return expect_arrays(reply, "proto", "counts") or expect_shapes(reply, proto=(C, d), counts=(C,))

    def probes(self, replies: list[tuple[int, Record]], rnd: int, ctx: ServerContext) -> list[torch.Tensor]:
        """The probe features (M, d) of each client's similarity row."""
        d = self.info.feature_dim
        if self.hp.probe == "prototypes":
            # check_reply: "proto" and "counts" are tensors
            glob, n = aggregate_prototypes([r.array("proto") for _, r in replies],
                                           [r.array("counts") for _, r in replies], "uniform")
            return [glob[n > 0].double()] * len(replies)
        return [torch.from_numpy(ctx.rng(rnd, "fedrema-probe", cid).uniform(0.0, self.hp.probe_scale, (1, d)))
                for cid, _ in replies]

    def aggregate(self, state: FedReMaState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedReMaState:
        replies = model_heads_only([(cid, r) for cid, r in replies if reply_weight(r, self.hp.weighting) > 0],
                                   state.heads, "FedReMa")
        if not replies:
            return state
        new = super().aggregate(state, rnd, replies, ctx)  # the body: FedAvg over the shared entries
        ids = [cid for cid, _ in replies]
        # check_reply: the group "head" (a dict of tensors)
        phis = {k: torch.stack([r.group("head")[k].detach().cpu().double()
                                for _, r in replies])
                for k in state.heads}  # entry -> (K, ...)
        W, b = phis["head.weight"], phis.get("head.bias")
        depend, ccp, peak = state.depend.clone(), bool(state.ccp), state.peak.clone()
        alpha = torch.zeros(len(ids), len(ids), dtype=torch.float64)  # row i: weights over the round's clients
        if ccp:
            gaps: list[float] = []
            for i, r in enumerate(self.probes(replies, rnd, ctx)):
                logits = torch.einsum("mj,kcj->kmc", r, W) + (0 if b is None else b.unsqueeze(1))  # (K, M, C)
                chosen, gap = mds(logit_similarity(logits, self.hp.temperature)[i], i)
                alpha[i, chosen] = 1.0 / len(chosen)
                depend[ids[i], [ids[j] for j in chosen]] += 1
                if gap is not None:
                    gaps.append(gap)
            if gaps:
                g = float(np.mean(gaps))
                peak = torch.maximum(peak, torch.tensor(g, dtype=torch.float64))
                ccp = not g < self.hp.delta * float(peak)
                ctx.log("rema_gap", g)
        else:
            alpha = depend[ids][:, ids].clone()
            alpha[alpha.sum(1) == 0] = torch.eye(len(ids), dtype=torch.float64)[alpha.sum(1) == 0]  # own classifier
            alpha /= alpha.sum(1, keepdim=True)
        ctx.log("rema_ccp", float(ccp))
        ctx.log("rema_peers", float((alpha > 0).sum(1).double().mean()))
        heads = {k: v.clone() for k, v in state.heads.items()}
        combined = state.combined.clone()
        for k, phi in phis.items():
            heads[k][ids] = torch.tensordot(alpha, phi, dims=1).to(heads[k].dtype)
        combined[ids] = True
        return dataclasses.replace(new, heads=heads, combined=combined, depend=depend, peak=peak,
                                   ccp=torch.tensor(ccp))

    # -- client ------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        assert state is not None  # client_init made it (the initial classifier)
        w = {**state.weights, **msg.weights}  # the body, and the combined classifier when the server sent one
        fitted = await ctx.fit(w)  # CE over body and classifier (FedPer's local update)
        w = fitted.weights
        arrays: Arrays = {"head": self.personal_part(w)}
        if self.hp.probe == "prototypes":
            _, y = ctx.data
            arrays["proto"], arrays["counts"] = class_means(await ctx.features(w), y, self.info.num_classes)
        return ClientResult(Record(weights=self.shared_part(w), arrays=arrays),
                            state=Record(weights=self.personal_part(w)), personal=ctx.shared_model(w))
