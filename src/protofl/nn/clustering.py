"""Clustering of class embeddings into several prototypes (MP-FedCL and its variants,
FPL's cluster prototypes).

* :func:`kmeans` -- scikit-learn's ``KMeans`` (Lloyd's algorithm, greedy k-means++
  seeding, ``n_init`` restarts, the lowest inertia wins) on one thread. Its seed is drawn
  from the numpy ``Generator`` passed in, so a (round, client, class) stream makes it
  deterministic, and one thread makes it independent of the worker count. A set with
  fewer than ``k`` distinct points yields those distinct points as its centroids (fewer
  than ``k``).
* :func:`dbscan_centroids` -- scikit-learn's DBSCAN (the number of clusters is chosen by
  the data), returning the mean of each cluster.
* :func:`pad_groups` -- MP-FedCL eq. (10): every client's group of prototypes of a class
  is padded to the same size with the class's pool average.
* :func:`finch` -- FINCH (Sarfraz et al., CVPR 2019), the parameter-free hierarchy of
  first-neighbour partitions that FPL clusters the clients' prototypes of a class with
  (written here from the paper's clustering equation: the authors' reference code is
  licensed for academic use only).

Shapes: points (N, d), centroids (k', d), labels (N,).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # (k', d), k' = min(k, number of distinct points)
    labels: torch.Tensor  # (N,) int64: index of each point's centroid
    inertia: float  # sum of squared distances of the points to their centroid


_ONE_THREAD: Any = None  # a threadpoolctl controller, made on first use (after scikit-learn loaded its libraries)


def _one_thread() -> AbstractContextManager[Any]:
    """A context that runs BLAS and OpenMP on one thread (scikit-learn's k-means reduces
    per-thread partial sums, so its last bits would depend on the thread count)."""
    global _ONE_THREAD
    if _ONE_THREAD is None:
        from threadpoolctl import ThreadpoolController

        _ONE_THREAD = ThreadpoolController()
    return _ONE_THREAD.limit(limits=1)


_GOLDEN = 0x9E3779B97F4A7C15 % (1 << 62)  # a large odd multiplier for the row hash


def _at_most_distinct(x: torch.Tensor, k: int) -> bool:
    """Whether the float64 rows of ``x`` (N, d) take at most ``k`` distinct values.

    Rows with different hashes differ, so more than ``k`` distinct hashes answer no
    without sorting whole rows (``torch.unique(dim=0)`` costs a quarter of a k-means of
    6,000 x 256); otherwise the exact count decides. The hash is an integer combination
    of the rows' bits (exact, the same for equal rows whatever the thread count), with
    -0.0 turned into 0.0 first as ``torch.unique`` treats them as equal."""
    if len(x) <= k:
        return True
    bits = (x + 0.0).view(torch.int64)  # (N, d)
    mult = torch.arange(1, 2 * x.shape[1], 2, dtype=torch.int64) * _GOLDEN  # odd, distinct
    if len(torch.unique((bits * mult).sum(1))) > k:  # int64 arithmetic wraps around: exact
        return False
    return len(torch.unique(x, dim=0)) <= k


def kmeans(x: torch.Tensor, k: int, rng: np.random.Generator, n_init: int = 5,
           max_iter: int = 100, tol: float = 0.0) -> KMeansResult:
    """k centroids of the rows of ``x`` (N, d); the best of ``n_init`` seeded restarts.

    scikit-learn's ``KMeans(algorithm="lloyd", init="k-means++")`` in float64 on the CPU
    on one thread (the result does not depend on the device or the number of workers),
    seeded with one integer drawn from ``rng``; returned in ``x``'s dtype and device.
    ``tol`` is scikit-learn's (relative to the mean variance of the features); the
    default 0 runs each restart until no label changes (a Lloyd fixed point: every
    centroid is the mean of its points) or ``max_iter``. With at most ``k`` distinct
    rows, the distinct rows themselves are the centroids (in ``torch.unique`` order,
    inertia 0) and ``rng`` is not drawn from.
    """
    if k < 1:
        raise ValueError(f"kmeans: k must be >= 1, got {k}")
    if n_init < 1:
        raise ValueError(f"kmeans: n_init must be >= 1, got {n_init}")
    if x.dim() != 2 or len(x) == 0:
        raise ValueError(f"kmeans: expected a non-empty (N, d) tensor, got shape {tuple(x.shape)}")
    xd = x.detach().to("cpu", torch.float64)
    if _at_most_distinct(xd, k):
        distinct = torch.unique(xd, dim=0)
        labels = torch.cdist(xd, distinct, compute_mode="donot_use_mm_for_euclid_dist").argmin(1)  # exact
        return KMeansResult(distinct.to(x.device, x.dtype), labels.to(x.device), 0.0)
    from sklearn.cluster import KMeans

    seed = int(rng.integers(2**31 - 1))
    km = KMeans(n_clusters=k, init="k-means++", n_init=n_init, max_iter=max_iter, tol=tol,
                algorithm="lloyd", random_state=seed, copy_x=True)
    with _one_thread():
        km.fit(xd.numpy())
    centroids = torch.from_numpy(km.cluster_centers_)
    labels = torch.from_numpy(km.labels_.astype(np.int64))
    return KMeansResult(centroids.to(x.device, x.dtype), labels.to(x.device), float(km.inertia_))


def dbscan_centroids(x: torch.Tensor, eps: float, min_samples: int,
                     max_clusters: Optional[int] = None, normalize: bool = True) -> torch.Tensor:
    """(m, d) means of the DBSCAN clusters of the rows of ``x``, largest cluster first.

    ``normalize=True`` clusters the L2-normalized rows (``eps`` is then a chord length on
    the unit sphere, independent of the feature scale); the centroids are always means
    of the original rows. Noise points (DBSCAN label -1) belong to no cluster; if every
    point is noise the single centroid is the mean of all rows (the class still gets a
    prototype). ``max_clusters`` keeps only the largest clusters (ties: lower label).
    DBSCAN involves no randomness.
    """
    from sklearn.cluster import DBSCAN

    if x.dim() != 2 or len(x) == 0:
        raise ValueError(f"dbscan_centroids: expected a non-empty (N, d) tensor, got shape {tuple(x.shape)}")
    xd = x.detach().to("cpu", torch.float64)
    feats = torch.nn.functional.normalize(xd, dim=1) if normalize else xd
    labels = DBSCAN(eps=eps, min_samples=min_samples).fit_predict(feats.numpy())
    ids = [int(i) for i in np.unique(labels) if i >= 0]
    if not ids:
        return xd.mean(0, keepdim=True).to(x.device, x.dtype)
    ids.sort(key=lambda i: (-int((labels == i).sum()), i))
    if max_clusters is not None:
        ids = ids[:max_clusters]
    lab = torch.from_numpy(labels)
    return torch.stack([xd[lab == i].mean(0) for i in ids]).to(x.device, x.dtype)


def pad_groups(groups: Sequence[torch.Tensor], size: int) -> torch.Tensor:
    """MP-FedCL eq. (10): pad each client's (n_i, d) prototypes of one class to ``size`` rows.

    The filler is the pool average U_bar = mean of all prototypes of the class in the
    pool (all rows of all groups, before padding). Returns (len(groups), size, d).
    A group larger than ``size`` is an error (the caller decides the size).
    """
    if not groups:
        raise ValueError("pad_groups: no groups")
    big = [len(g) for g in groups if len(g) > size]
    if big:
        raise ValueError(f"pad_groups: a group has {big[0]} prototypes, more than size={size}")
    pool = torch.cat(list(groups))  # (sum n_i, d)
    u_bar = pool.mean(0, keepdim=True)  # (1, d)
    return torch.stack([torch.cat([g, u_bar.expand(size - len(g), -1)]) for g in groups])


# ---------------------------------------------------------------------------------------
# FINCH (Sarfraz, Sharma & Stiefelhagen, CVPR 2019, "Efficient Parameter-free Clustering
# Using First Neighbor Relations"), used by FPL for its cluster prototypes
# ---------------------------------------------------------------------------------------
def first_neighbor_partition(x: np.ndarray, distance: str = "cosine") -> np.ndarray:
    """One FINCH step: (N,) cluster labels of the rows of ``x`` (N, d).

    The clustering equation links i and j when j is i's first (nearest) neighbour, i is j's,
    or both share the same first neighbour; the clusters are the connected components of
    these links. The third case adds nothing to the components (i -> k <- j already joins
    i and j), so the components of the graph i -- kappa_i are the same. Ties in the
    nearest neighbour go to the lower index. Labels follow scipy's component numbering
    (in order of each component's lowest row). One row: one cluster.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial.distance import cdist

    n = len(x)
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    if distance not in ("cosine", "euclidean"):
        raise ValueError(f"FINCH distance must be 'cosine' or 'euclidean', got {distance!r}")
    if distance == "cosine":  # 1 - cos; a zero row is at distance 1 from everything
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        u = x / np.where(norms > 0, norms, 1.0)
        D = 1.0 - u @ u.T
    else:
        D = cdist(x, x)
    np.fill_diagonal(D, np.inf)
    kappa = np.argmin(D, axis=1)  # first neighbours
    graph = coo_matrix((np.ones(n), (np.arange(n), kappa)), shape=(n, n))
    _, labels = connected_components(graph, directed=True, connection="weak")
    return labels.astype(np.int64)


def finch(x: torch.Tensor, distance: str = "cosine") -> list[np.ndarray]:
    """FINCH's hierarchy of partitions of the rows of ``x`` (N, d), finest first.

    Partition 0 is :func:`first_neighbor_partition` of the points; each next partition
    applies the same step to the means of the previous clusters (means of the original
    rows) and merges the clusters it links. The recursion stops when a step leaves one
    cluster or merges nothing; as in the authors' algorithm, that last step is not a
    partition of the result (so every partition after the first has at least 2
    clusters; the first may have 1). No parameter; computed in float64 on the CPU.
    Returns a list of (N,) int64 label arrays, labels 0..k-1 in each.
    """
    if x.dim() != 2 or len(x) == 0:
        raise ValueError(f"finch: expected a non-empty (N, d) tensor, got shape {tuple(x.shape)}")
    pts = x.detach().to("cpu", torch.float64).numpy()
    labels = first_neighbor_partition(pts, distance)
    partitions = [labels]
    while True:
        k = int(labels.max()) + 1
        if k == 1:
            break
        means = np.stack([pts[labels == c].mean(0) for c in range(k)])  # (k, d)
        merged = first_neighbor_partition(means, distance)  # (k,) cluster of each cluster
        if int(merged.max()) + 1 in (1, k):  # one cluster left, or nothing merged: stop
            break
        labels = merged[labels]
        partitions.append(labels)
    return partitions
