"""A federated dataset: the full in-memory tensors plus per-client index arrays.

Batches are slices of these tensors; there is no DataLoader per client. The same
object (its tensors in shared memory) serves every worker process. ``data/build.py``
builds one from a config (label skew, then feature skew).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..errors import ConfigError
from .dataset import Dataset
from .partition import PARTITIONERS, class_counts


@dataclass
class FederatedData:
    dataset: Dataset
    train_idx: list[np.ndarray]  # per client, into the train split
    test_idx: list[np.ndarray]  # per client local test set, into the test split
    groups: Optional[np.ndarray] = None  # group id per client (clustered partitions)
    # feature skew (data/features.py): a load-time transform (x, cid, rnd, split) -> x of
    # the normalized slices of a client (train and local test; never the global test set),
    # a feature group per client with its name, and each group's block of the global test set
    transform: Optional[Callable] = None
    feature_groups: Optional[np.ndarray] = None
    feature_group_names: Optional[list[str]] = None
    test_groups: Optional[dict[str, np.ndarray]] = None

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    def class_counts(self) -> np.ndarray:
        """(K, C) training label counts per client."""
        return class_counts(self.train_idx, self.dataset.train_labels, self.num_classes)

    def share_memory_(self) -> "FederatedData":
        d = self.dataset
        for t in (d.x_train, d.y_train, d.x_test, d.y_test):
            t.share_memory_()
        return self


def make_partition(name: str, labels: np.ndarray, num_clients: int, seed: int, params: dict,
                   dataset: Optional[Dataset] = None) -> list[np.ndarray]:
    fn = PARTITIONERS.get(name)
    kwargs = dict(params)
    if "users" in inspect.signature(fn).parameters:  # natural (LEAF) split
        if dataset is None or dataset.users_train is None:
            raise ConfigError("partition.name", name, f"needs a dataset with natural users (femnist, shakespeare); "
                              f"{getattr(dataset, 'name', None)!r} has none")
        kwargs["users"] = dataset.users_train
    try:
        return fn(labels, num_clients, seed, **kwargs)
    except ValueError as e:  # an impossible request is bad input, not a crash
        raise ConfigError(f"partition ({name})", params, str(e)) from None
