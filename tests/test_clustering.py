"""k-means with seeded restarts, the DBSCAN wrapper and MP-FedCL's padding (eq. 10)."""
import numpy as np
import pytest
import torch

from protofl.nn.clustering import dbscan_centroids, kmeans, pad_groups


def rows(t):
    """Rows of a 2-D tensor as a sorted list of tuples (order-free comparison)."""
    return sorted(tuple(round(float(v), 6) for v in r) for r in t)


def test_kmeans_two_blobs_hand_computed():
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [10.0, 0.0], [10.0, 1.0]])
    res = kmeans(x, 2, np.random.default_rng(0))
    assert rows(res.centroids) == [(0.0, 0.5), (10.0, 0.5)]
    # each point belongs to the centroid of its blob; inertia = 4 * 0.5^2
    assert res.labels[0] == res.labels[1] != res.labels[2] == res.labels[3]
    assert res.inertia == pytest.approx(1.0)
    assert res.centroids.dtype == x.dtype


def test_kmeans_returns_k_centroids_that_are_means_of_their_points():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=g)
    res = kmeans(x, 4, np.random.default_rng(1))
    assert res.centroids.shape == (4, 3)
    for j in range(4):  # a Lloyd fixed point: every centroid is the mean of its cluster
        torch.testing.assert_close(res.centroids[j], x[res.labels == j].mean(0), atol=1e-5, rtol=0)
    # every point is assigned to its nearest centroid
    assert torch.equal(res.labels, torch.cdist(x, res.centroids).argmin(1))


def test_kmeans_deterministic_from_the_generator():
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(3))
    a = kmeans(x, 3, np.random.default_rng(7))
    b = kmeans(x, 3, np.random.default_rng(7))
    assert torch.equal(a.centroids, b.centroids) and torch.equal(a.labels, b.labels)


def test_kmeans_restarts_never_worse_than_the_first():
    # the first restart of n_init=8 draws exactly what n_init=1 draws from the same seed
    x = torch.randn(40, 2, generator=torch.Generator().manual_seed(5))
    for seed in range(5):
        one = kmeans(x, 5, np.random.default_rng(seed), n_init=1)
        many = kmeans(x, 5, np.random.default_rng(seed), n_init=8)
        assert many.inertia <= one.inertia + 1e-12


def test_kmeans_fewer_distinct_samples_than_k():
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]])
    res = kmeans(x, 3, np.random.default_rng(0))
    assert rows(res.centroids) == [(1.0, 2.0), (3.0, 4.0)]  # 2 distinct points -> 2 centroids
    assert res.inertia == 0.0
    single = kmeans(torch.tensor([[5.0, 6.0]]), 2, np.random.default_rng(0))
    assert rows(single.centroids) == [(5.0, 6.0)]


def test_kmeans_three_separated_blobs_give_their_means():
    # blobs around (0, 0), (10, 0), (0, 10): every restart ends at the three blob means
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0],
                      [10.0, 0.0], [11.0, 0.0], [10.0, 2.0],
                      [0.0, 10.0], [0.0, 12.0]])
    for seed in range(3):
        res = kmeans(x, 3, np.random.default_rng(seed), n_init=1)
        assert rows(res.centroids) == rows([[0.0, 11.0], [1 / 3, 1 / 3], [31 / 3, 2 / 3]])
        # per blob: (2 + 5 + 5)/9, (5 + 8 + 17)/9, 1 + 1
        assert res.inertia == pytest.approx(4 / 3 + 10 / 3 + 2.0)


def test_kmeans_duplicate_points_count_with_their_multiplicity():
    # three copies of (0, 0) pull their cluster's mean: {(0,0) x3, (0,1)} -> (0, 0.25)
    x = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0], [10.0, 0.0], [10.0, 0.0]])
    res = kmeans(x, 2, np.random.default_rng(0))
    assert rows(res.centroids) == [(0.0, 0.25), (10.0, 0.0)]
    assert res.inertia == pytest.approx(3 * 0.25 ** 2 + 0.75 ** 2)
    assert res.labels.tolist()[:4] == [res.labels[0].item()] * 4 and res.labels[4] == res.labels[5] != res.labels[0]


def test_kmeans_k_equal_to_distinct_points_returns_them_without_drawing():
    x = torch.tensor([[3.0, 4.0], [1.0, 2.0], [3.0, 4.0], [-0.0, 1.0], [0.0, 1.0]])  # -0.0 == 0.0
    rng = np.random.default_rng(0)
    res = kmeans(x, 3, rng)
    assert rows(res.centroids) == [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]
    assert res.inertia == 0.0
    assert torch.equal(res.centroids[res.labels], x)  # every point is its own centroid
    assert rng.integers(1 << 30) == np.random.default_rng(0).integers(1 << 30)  # rng untouched


def test_kmeans_same_bits_whatever_the_thread_count():
    # scikit-learn reduces per-thread partial sums; kmeans runs it on one thread, so an
    # outer thread setting (a worker process vs the sequential executor) changes nothing
    from threadpoolctl import threadpool_limits

    x = torch.randn(3000, 16, generator=torch.Generator().manual_seed(0))
    with threadpool_limits(limits=1):
        a = kmeans(x, 4, np.random.default_rng(3), n_init=2)
    with threadpool_limits(limits=2):
        b = kmeans(x, 4, np.random.default_rng(3), n_init=2)
    assert torch.equal(a.centroids, b.centroids) and torch.equal(a.labels, b.labels)
    assert a.inertia == b.inertia


def test_kmeans_rejects_bad_input():
    with pytest.raises(ValueError):
        kmeans(torch.zeros(0, 2), 2, np.random.default_rng(0))
    with pytest.raises(ValueError):
        kmeans(torch.zeros(3, 2), 0, np.random.default_rng(0))


def test_dbscan_centroids_are_cluster_means_largest_first_noise_dropped():
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1],  # cluster of 3
                      [5.0, 5.0], [5.1, 5.0],  # cluster of 2
                      [20.0, -20.0]])  # noise
    c = dbscan_centroids(x, eps=0.5, min_samples=2, normalize=False)
    torch.testing.assert_close(c, torch.tensor([[0.1 / 3, 0.1 / 3], [5.05, 5.0]]))
    # max_clusters keeps the largest
    torch.testing.assert_close(dbscan_centroids(x, 0.5, 2, max_clusters=1, normalize=False),
                               torch.tensor([[0.1 / 3, 0.1 / 3]]))


def test_dbscan_all_noise_gives_the_mean_and_normalize_uses_directions():
    x = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    torch.testing.assert_close(dbscan_centroids(x, 0.5, 2, normalize=False), x.mean(0, keepdim=True))
    # same direction, very different norms: one cluster on the unit sphere; its raw mean
    y = torch.tensor([[1.0, 0.0], [10.0, 0.0], [100.0, 0.0]])
    torch.testing.assert_close(dbscan_centroids(y, 0.1, 2, normalize=True), torch.tensor([[37.0, 0.0]]))


def test_pad_groups_fills_with_the_pool_mean_eq10():
    a = torch.tensor([[0.0, 0.0], [2.0, 0.0]])  # client 1: K = 2 prototypes
    b = torch.tensor([[4.0, 6.0]])  # client 2: only one
    out = pad_groups([a, b], 2)
    u_bar = torch.tensor([2.0, 2.0])  # mean of the 3 pool prototypes
    assert out.shape == (2, 2, 2)
    torch.testing.assert_close(out[0], a)
    torch.testing.assert_close(out[1], torch.stack([b[0], u_bar]))
    with pytest.raises(ValueError):
        pad_groups([a], 1)
