"""One round's metrics row (a line of ``metrics.jsonl``; every key in docs/metrics.md).

:class:`RoundMetrics` is filled as the round goes -- what the clients did, what the server
logged, the global model's evaluation (possibly a handle to an evaluation still running in
a worker, ``execution.overlap_eval``), the personalized models' -- and :meth:`row` puts the
row together once that evaluation is in. It owns the derived numbers: the learning rate,
the bytes moved, the clustering's purity, the weight diversity, the class geometry and GA.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence, TYPE_CHECKING

import numpy as np

from .. import metrics as M
from ..algorithms.base import weight_diversity
from ..messages import Record

if TYPE_CHECKING:
    import torch

    from .client import ClientOutput


class RoundMetrics:
    def __init__(self, rnd: int, lr: float, evaluating: bool) -> None:
        self.rnd, self.evaluating = rnd, evaluating
        self._row: dict[str, Any] = {"round": rnd, "lr": lr}
        self._gm: Any = {}  # the global model's metrics: a dict, or a handle with result()
        self._after: dict[str, Any] = {}  # geometry and the personalized models, after GM
        self._final: dict[str, Any] = {}
        self.train_s = self.eval_s = self.wall_s = self.cpu_s = 0.0

    # -- the round, as it happens ------------------------------------------------------------
    def clients(self, selected: int, messages: Sequence[Record], replies: Sequence[Record],
                outputs: Sequence[ClientOutput], lost: int, rejected: dict[int, str], private: bool = False,
                client_level: bool = False) -> None:
        """What the round's clients did: who was asked, whose reply counts, the training loss
        (weighted by the samples each trained on) and the bytes each way.

        Under differential privacy (``private``) the training loss and sample count are left
        out (computed from the records without noise); under client-level DP
        (``client_level``) the rejected replies too (the server judged the updates before
        their noise: which were rejected, and why, is not private)."""
        n = [o.train.get("samples", 0) for o in outputs]
        row = self._row
        row.update(selected=selected, arrived=len(replies), lost=lost)
        if not client_level:
            row["rejected"] = len(rejected)
        if not private:
            row["train_loss"] = (float(np.average([o.train.get("loss", 0.0) for o in outputs], weights=n))
                                 if sum(n) > 0 else float("nan"))
            row["train_samples"] = int(sum(n))
        row.update(bytes_down=int(sum(m.nbytes() for m in messages)), bytes_up=int(sum(r.nbytes() for r in replies)))
        if rejected and not client_level:
            row["rejected_reasons"] = [f"client {cid}: {why}" for cid, why in rejected.items()]

    def server(self, logs: dict[str, float], purity: Optional[float],
               local_models: Optional[list[dict[str, torch.Tensor]]]) -> None:
        """What the server logged while aggregating, the purity of its clustering of the
        clients, and the weight diversity of the local models that arrived (ReBaFL eq. 24)."""
        self._row.update(logs)
        if purity is not None:
            self._row["cluster_purity"] = purity
        if local_models:
            self._row["weight_diversity"] = weight_diversity(local_models)

    def global_model(self, gm: Any, class_vectors: Optional[torch.Tensor] = None, last: bool = False) -> None:
        """The global model's metrics (or the handle of their evaluation) and the geometry of
        the method's class vectors: ``proto_min_angle`` (degrees), in the last round ``proto_cos``."""
        self._gm = gm
        if class_vectors is not None:
            angle, cos = M.class_geometry(class_vectors.detach().float().cpu().numpy())
            if angle is not None:
                self._after["proto_min_angle"] = angle
            if last:
                self._after["proto_cos"] = cos

    def personal(self, evaluated: Sequence[tuple[int, dict[str, float]]], full_test: bool) -> None:
        """The personalized models of the clients that were evaluated: their summary and, on
        full evaluations, PA per client (the fairness plots)."""
        evals = [ev for _, ev in evaluated if ev]
        if evals:
            self._after.update(M.summarize_clients(evals))
            self._after["evaluated_clients"] = len(evals)
        if full_test:
            self._after["pa_clients"] = [[cid, ev["pa"]] for cid, ev in evaluated if "pa" in (ev or {})]

    def final(self, metrics: dict[str, Any]) -> None:
        """After the last round: every client's personalized model (``all_*``)."""
        self._final = metrics

    def row(self) -> dict[str, Any]:
        """The finished row; waits for a deferred evaluation (its wait counts as evaluation
        time). GA: the global model's GM, or without one the personalized models' mean
        accuracy on the global test set."""
        t, c = time.perf_counter(), time.process_time()
        gm = self._gm if isinstance(self._gm, dict) else self._gm.result()
        waited, spent = time.perf_counter() - t, time.process_time() - c
        row = {**self._row, **gm, **self._after}
        if self.evaluating:
            if "gm" in row:
                row["ga"] = row["gm"]
            elif "acc" in row:
                row["ga"] = row["acc"]
        row.update(self._final)
        row.update(train_s=self.train_s, eval_s=self.eval_s + waited, wall_s=self.wall_s + waited,
                   cpu_s=self.cpu_s + spent)
        return row
