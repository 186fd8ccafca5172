"""Speed-ups must not change results.

* process workers (one thread each, largest clients first) vs sequential with one thread:
  bit-identical metrics and weights, for stateless and stateful methods (more methods
  with ``pytest -m long``);
* channels_last on vs off: the same computation in another memory layout; float
  results differ in the last bits and SGD amplifies that a little, so after 3 rounds the
  weights agree to 2e-4 (absolute; measured: 3e-5) and accuracies to within 2 test samples;
* the evaluation batch size: predictions per sample do not depend on it (accuracies
  within 1 test sample; in practice identical).
"""
import pytest
import torch

from protofl import run

from conftest import strip_timing


# every method also goes through the workers' code path, in-process, in
# tests/test_algorithms_common.py; real processes for fedproto by default, for the other
# three with `pytest -m long`
@pytest.mark.parametrize("method", ["fedproto", *(pytest.param(m, marks=pytest.mark.long)
                                                  for m in ("fednh", "rebafl", "mpfedcl"))])
def test_workers_bit_identical_to_sequential(digits_cfg, tmp_path, method):
    cfg = digits_cfg("rounds=3", f"algorithm.name={method}")
    seq = run(cfg, run_dir=tmp_path / "seq")
    par = run(cfg.replace(**{"execution.workers": 2}), run_dir=tmp_path / "par")
    assert strip_timing(seq.rows) == strip_timing(par.rows)


def test_channels_last_within_tolerance(digits_cfg, tmp_path):
    # cnn_fmnist pads its convolutions, so it runs on 8x8 digits
    cfg = digits_cfg("rounds=3", "eval.personal_every=1").replace(**{"model.name": "cnn_fmnist"})
    off = run(cfg.replace(**{"execution.channels_last": False}), run_dir=tmp_path / "off")
    on = run(cfg.replace(**{"execution.channels_last": True}), run_dir=tmp_path / "on")
    n_test = 450
    for a, b in zip(off.rows, on.rows):
        for key in ("gm", "pm_v", "pm_l", "pa"):
            assert abs(a[key] - b[key]) <= 2 / n_test + 1e-12, (key, a[key], b[key])
    for k, w in off.server_state.weights.items():
        if w.is_floating_point():
            torch.testing.assert_close(on.server_state.weights[k].contiguous(), w, rtol=0, atol=2e-4)


def test_eval_batch_size_does_not_change_metrics(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=2", "eval.personal_every=1")
    small = run(cfg.replace(**{"eval.batch_size": 7}), run_dir=tmp_path / "small")
    big = run(cfg.replace(**{"eval.batch_size": 4096}), run_dir=tmp_path / "big")
    for a, b in zip(small.rows, big.rows):
        assert a["train_loss"] == b["train_loss"]  # training is untouched
        for key in ("gm", "acc", "pm_v", "pm_l", "pa"):
            assert abs(a[key] - b[key]) <= 1 / 450 + 1e-12, (key, a[key], b[key])



def test_embed_batches_subdivide_the_old_blocks():
    from protofl.engine.train import embed_batches

    assert embed_batches(0, 256) == []
    assert embed_batches(3, 256) == [(0, 3)]
    assert embed_batches(700, 256) == [(0, 256), (256, 700)]  # no piece under 256
    assert embed_batches(1026, 256) == [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1026)]
    assert embed_batches(2100, 1024) == [(0, 1024), (1024, 2048), (2048, 2100)]  # the old batching
    for n in range(0, 2600, 37):
        b = embed_batches(n, 256)
        assert [s for s, _ in b[1:]] == [e for _, e in b[:-1]] and (not b or (b[0][0], b[-1][1]) == (0, n))
        for s, e in b:  # inside one old block, and tiny only where the old block was
            assert s // 1024 == (e - 1) // 1024 and e - s >= min(256, n - s // 1024 * 1024)


def test_embed_batch_size_does_not_change_prototypes(digits_cfg, tmp_path, monkeypatch):
    # ClientContext.embed in batches of 256 (measured fastest) vs the earlier 1024: FedProto's
    # prototypes feed training, so whole runs must agree bit for bit. Two clients of ~650
    # training samples each, so the batches really are cut.
    from protofl.engine import client

    cfg = digits_cfg("rounds=2", "algorithm.name=fedproto", "partition.num_clients=2",
                     "participation.fraction=1.0").replace(**{"model.name": "cnn_fmnist"})
    rows = {}
    for bs in (256, 1024):  # (batches of 3 would differ: the tiny-batch kernels)
        monkeypatch.setattr(client, "EMBED_BATCH_SIZE", bs)
        rows[bs] = strip_timing(run(cfg, run_dir=tmp_path / str(bs)).rows)
    assert rows[256] == rows[1024]
