"""A config's federated data: the dataset, its label-skew partition, then its feature skew.

Above both halves of the split: :mod:`protofl.data.federated` (the container and the
partition call) and :mod:`protofl.data.features` (the feature-skew scenarios, which
build on it).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError
from .dataset import Dataset
from .datasets import load_dataset
from .features import make_scenario
from .federated import FederatedData, make_partition
from .partition import client_groups, local_test_indices


def build_federated(cfg, dataset: Optional[Dataset] = None) -> FederatedData:
    """Load the dataset and split it as the config says, then apply the feature skew.

    ``dataset`` replaces the configured loader's output (e.g. a subset built by a script).
    """
    scenario = make_scenario(cfg.features.name, cfg.features.params)
    if scenario is None:
        return _build_label_skew(cfg, dataset)
    fed = None if scenario.builds_dataset else _build_label_skew(cfg, dataset)
    try:
        return scenario.build(cfg, dataset) if fed is None else scenario.apply(fed, cfg.seed)
    except ValueError as e:  # an impossible request (e.g. rotating token data) is bad input
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"features ({cfg.features.name})", cfg.features.params, str(e)) from None


def _build_label_skew(cfg, dataset: Optional[Dataset] = None) -> FederatedData:
    ds = dataset if dataset is not None else load_dataset(cfg.data.name, cfg.data.root, seed=cfg.seed,
                                                          **cfg.data.params)
    K = cfg.partition.num_clients
    parts = make_partition(cfg.partition.name, ds.train_labels, K, cfg.seed, cfg.partition.params, ds)
    if cfg.partition.name == "natural" and ds.users_test is not None:
        tests = [np.asarray(ds.users_test[k], dtype=np.int64) for k in range(len(parts))]
    else:
        tests = local_test_indices(parts, ds.train_labels, ds.test_labels, ds.num_classes, cfg.seed,
                                   fraction=cfg.eval.local_test_fraction)
    groups = None
    if "groups" in cfg.partition.params:
        groups = client_groups(cfg.partition.params["groups"])
    return FederatedData(ds, parts, tests, groups)
