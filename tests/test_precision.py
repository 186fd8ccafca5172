"""execution.precision: bf16 autocast in the training loop, fp32 weights and messages."""
import logging

import pytest
import torch
from torch import nn

from protofl import run
from protofl.config import ConfigError, from_dict, load_config
from protofl.engine import precision as P
from protofl.engine.train import TrainSettings, fit

from conftest import DIGITS


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread is fastest (and what the engine's workers use)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, x, y


def train(model, x, y, precision, loss=None, epochs=20):
    loss = loss or (lambda m, xb, yb, extras: nn.functional.cross_entropy(m(xb), yb))
    return fit(model, x, y, loss=loss, extras={}, names=[k for k, _ in model.named_parameters()],
               settings=TrainSettings(lr=0.1, momentum=0.9, batch_size=16, epochs=epochs),
               generator=torch.Generator().manual_seed(1), precision=precision)


def test_config_precision_default_fp32_and_bad_value_names_the_choices():
    assert load_config(DIGITS).execution.precision == "fp32"
    assert load_config(DIGITS, ["execution.precision=bf16"]).execution.precision == "bf16"
    with pytest.raises(ConfigError) as e:
        from_dict({"execution": {"precision": "fp16"}})
    assert e.value.key == "execution.precision" and "'fp32', 'bf16'" in str(e.value)
    assert "\n" not in str(e.value)


def test_fingerprint_unchanged_for_fp32_and_distinct_for_bf16():
    cfg = load_config(DIGITS)
    # fp32 is the default: existing run folders and checkpoints keep their fingerprint
    assert cfg.replace(**{"execution.precision": "fp32"}).fingerprint() == cfg.fingerprint()
    # bf16 changes the results, so it must not resume or reuse an fp32 run
    assert cfg.replace(**{"execution.precision": "bf16"}).fingerprint() != cfg.fingerprint()


def test_bf16_forward_runs_in_bfloat16_and_weights_stay_float32():
    model, x, y = tiny_problem()
    seen = []

    def loss(m, xb, yb, extras):
        out = m(xb)
        seen.append(out.dtype)
        return nn.functional.cross_entropy(out, yb)

    stats = train(model, x, y, "bf16", loss=loss, epochs=1)
    assert set(seen) == {torch.bfloat16} and stats.steps == 4
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    seen.clear()
    train(model, x, y, "fp32", loss=loss, epochs=1)
    assert set(seen) == {torch.float32}


def test_bf16_training_tracks_fp32_on_a_tiny_problem():
    m32, x, y = tiny_problem()
    m16, _, _ = tiny_problem()
    s32, s16 = train(m32, x, y, "fp32"), train(m16, x, y, "bf16")
    assert s16.loss == pytest.approx(s32.loss, abs=0.05)
    acc = [float((m(x).argmax(1) == y).float().mean()) for m in (m32, m16)]
    assert acc[0] > 0.9 and abs(acc[0] - acc[1]) <= 0.05
    # bf16 actually changed the arithmetic (this is not fp32 under another name)
    assert not all(torch.equal(a, b) for a, b in zip(m32.parameters(), m16.parameters()))


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError):
        P.autocast("fp8", "cpu")


def test_bf16_note_warns_once_where_the_cpu_lacks_bf16(monkeypatch, caplog):
    assert P.bf16_note("fp32", "cpu") is None
    monkeypatch.setattr(P, "cpu_has_bf16", lambda: False)
    note = P.bf16_note("bf16", "cpu")
    assert "AVX512-BF16" in note and "slow" in note and "\n" not in note
    with caplog.at_level(logging.WARNING, logger="protofl"):
        P.check_precision("bf16", "cpu")
    assert [r.getMessage() for r in caplog.records] == [note]
    monkeypatch.setattr(P, "cpu_has_bf16", lambda: True)
    assert P.bf16_note("bf16", "cpu") is None


@pytest.mark.parametrize("method", ["fedavg", "fedproto"])
def test_bf16_end_to_end_close_to_fp32_with_fp32_messages(digits_cfg, tmp_path, method):
    cfg = digits_cfg("rounds=3", f"algorithm.name={method}", "eval.final_all_clients=false")
    a = run(cfg, run_dir=tmp_path / "fp32")
    b = run(cfg.replace(**{"execution.precision": "bf16"}), run_dir=tmp_path / "bf16")
    key = "gm" if method == "fedavg" else "pa"
    assert b.rows[-1][key] == pytest.approx(a.rows[-1][key], abs=0.05)
    assert b.rows[-1]["bytes_up"] == a.rows[-1]["bytes_up"]  # the messages are still float32
    assert b.rows[-1] != a.rows[-1]  # and the arithmetic did change
    if method == "fedavg":
        assert all(v.dtype == torch.float32 for v in b.server_state.weights.values())
