"""A config's federated data: the dataset, its label-skew partition, then its feature skew.

Above both halves of the split: :mod:`protofl.data.federated` (the container and the
partition call) and :mod:`protofl.data.features` (the feature-skew scenarios, which
build on it).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError
from .dataset import Dataset
from .datasets import load_configured
from .features import make_scenario
from .federated import FederatedData, make_partition
from .partition import client_groups, local_test_indices


def build_federated(cfg, dataset: Optional[Dataset] = None) -> FederatedData:
    """Load the dataset and split it as the config says, then apply the feature skew.

    ``dataset`` replaces the configured loader's output (e.g. a subset built by a script).
    """
    scenario = make_scenario(cfg.features.name, cfg.features.params)
    if scenario is not None and scenario.builds_dataset and cfg.data.train_size is not None:
        raise ConfigError("data.train_size", cfg.data.train_size,
                          f"the {cfg.features.name!r} scenario builds its own training pools; use its own size "
                          "options (features.*)")
    if scenario is None:
        return _build_label_skew(cfg, dataset)
    fed = None if scenario.builds_dataset else _build_label_skew(cfg, dataset)
    try:
        return scenario.build(cfg, dataset) if fed is None else scenario.apply(fed, cfg.seed)
    except ValueError as e:  # an impossible request (e.g. rotating token data) is bad input
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"features ({cfg.features.name})", cfg.features.params, str(e)) from None


def datasets_read(cfg) -> list[str]:
    """The registered datasets a config's runs read, a composite one (``digit5``) as its
    parts: what must be under the data root (or be fetched) before they start."""
    from .datasets import dataset_parts

    scenario = make_scenario(cfg.features.name, cfg.features.params)
    names = scenario.datasets(cfg) if scenario is not None and scenario.builds_dataset else [cfg.data.name]
    out: list[str] = []
    for n in names:
        for part in dataset_parts(n):
            if part not in out:
                out.append(part)
    return out


SUBSET_TAG = 2000  # mixed into the seed of the subset draw (the tag of the earlier MP-FedCL script)


def train_subset(ds: Dataset, n: int, seed: int) -> Dataset:
    """``ds`` with a uniformly random subset of ``n`` training samples (sorted indices,
    drawn with ``SeedSequence([seed, SUBSET_TAG])``); the test split is kept whole.
    The partition then splits the subset, and the local test sets follow its labels."""
    if n > len(ds.y_train):
        raise ConfigError("data.train_size", n, f"{ds.name} has only {len(ds.y_train)} training samples")
    rng = np.random.default_rng(np.random.SeedSequence([seed, SUBSET_TAG]))
    keep = torch.from_numpy(np.sort(rng.choice(len(ds.y_train), size=n, replace=False)))
    return replace(ds, x_train=ds.x_train[keep].clone(), y_train=ds.y_train[keep].clone(),
                   users_train=None, users_test=None, user_names=None)


def _build_label_skew(cfg, dataset: Optional[Dataset] = None) -> FederatedData:
    ds = dataset if dataset is not None else load_configured(cfg)
    if cfg.data.train_size is not None:
        if cfg.partition.name == "natural":
            raise ConfigError("data.train_size", cfg.data.train_size,
                              "the natural partition uses every writer's samples; a random subset would split them")
        ds = train_subset(ds, cfg.data.train_size, cfg.seed)
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
