"""data.augment: random crop with padding and horizontal flip, in the one training step."""
import math

import pytest
import torch

from protofl.config import ConfigError, load_config
from protofl.engine.augment import apply, Augment, augment_plan
from protofl.engine.simulation import Simulation

from conftest import DIGITS, strip_timing


def test_crop_and_flip_by_hand():
    x = torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).view(2, 1, 3, 3)  # two 3x3 images
    pad = torch.full((1, 1, 1, 1), -1.0)  # the padding value (a raw 0, normalized)
    aug = Augment(crop=1, flip=True)
    # image 0: offset (0, 0) = one row and column of padding at the top left; image 1: offset
    # (1, 2) = shifted one column to the left, padding on the right, then flipped
    out = apply(aug, x, torch.tensor([[0, 0], [1, 2]]), torch.tensor([False, True]), pad)
    assert out[0, 0].tolist() == [[-1, -1, -1], [-1, 0, 1], [-1, 3, 4]]
    assert out[1, 0].tolist() == [[-1, 11, 10], [-1, 14, 13], [-1, 17, 16]]
    centre = apply(aug, x, torch.tensor([[1, 1], [1, 1]]), torch.tensor([False, False]), pad)
    assert torch.equal(centre, x)  # offset (p, p) without a flip is the image itself


def test_the_plan_is_a_seeded_stream_of_offsets_and_flips():
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    a, b = augment_plan(Augment(crop=4, flip=True), 50, 8, g()), augment_plan(Augment(crop=4, flip=True), 50, 8, g())
    assert (a["offsets"] == b["offsets"]).all() and (a["flips"] == b["flips"]).all()
    assert a["offsets"].shape == (50, 8, 2) and a["offsets"].min() == 0 and a["offsets"].max() == 8
    assert 0.35 < a["flips"].mean() < 0.65
    none = augment_plan(Augment(), 3, 2, g())
    assert not none["offsets"].any() and not none["flips"].any()


def test_config_checks_and_non_images_are_refused(tmp_path):
    for bad, why in (({"crop": -1}, "crop"), ({"crop": 1.5}, "crop"), ({"flip": "yes"}, "flip"), ({"cutout": 8}, "cutout")):
        with pytest.raises(ConfigError, match=why):
            load_config(DIGITS, [f"data.augment={bad}"])
    cfg = load_config(DIGITS, ["data.name=spiral", "model.name=mlp2d", "data.augment={flip: true}",
                               f"output.dir={tmp_path}"])
    with pytest.raises(ConfigError, match="crops and flips images"):
        Simulation(cfg)


def cfg_aug(tmp_path, *extra):
    return load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false", "execution.threads=1", "rounds=2",
                                "partition.num_clients=4", "participation.fraction=1.0", "training.batch_size=24",
                                "eval.final_all_clients=false", "data.augment={crop: 2, flip: true}", *extra])


def test_augmentation_changes_training_is_deterministic_and_off_leaves_it_alone(tmp_path):
    a = Simulation(cfg_aug(tmp_path), run_dir=tmp_path / "a").run()
    b = Simulation(cfg_aug(tmp_path), run_dir=tmp_path / "b").run()
    assert strip_timing(a.rows) == strip_timing(b.rows)  # the same seed: the same crops and flips
    off = Simulation(cfg_aug(tmp_path).replace(**{"data.augment": {}}), run_dir=tmp_path / "off").run()
    assert a.rows[-1]["train_loss"] != off.rows[-1]["train_loss"]
    plain = load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false", "execution.threads=1", "rounds=2",
                                 "partition.num_clients=4", "participation.fraction=1.0", "training.batch_size=24",
                                 "eval.final_all_clients=false"])
    assert plain.fingerprint() == cfg_aug(tmp_path).replace(**{"data.augment": {}}).fingerprint()
    assert plain.fingerprint() != cfg_aug(tmp_path).fingerprint()


@pytest.mark.parametrize("pad", [False, True])  # the batched stack's short batches grouped, or padded
@pytest.mark.parametrize("method", ["fedavg", "fednh", "fedrep"])
def test_sequential_and_batched_see_the_same_augmented_images(tmp_path, method, pad):
    # FedRep's body phase at lr 0.05 with momentum 0.9 multiplies any rounding change ~4000x
    # here (the grouped stack with 2 threads differs from the sequential run by 4e-4 too): the
    # padded stack, which sums in another order, is compared at lr 0.02
    calm = ["training.lr=0.02"] if pad and method == "fedrep" else []
    got = {}
    for ex in ("sequential", "batched"):
        sim = Simulation(cfg_aug(tmp_path, f"algorithm.name={method}", f"execution.executor={ex}",
                                 f"execution.pad_batches={pad}", *calm), run_dir=tmp_path / ex)
        got[ex] = sim.run()
    assert got["batched"].summary["execution"]["padded"] is pad
    for ra, rb in zip(got["sequential"].rows, got["batched"].rows):
        assert math.isclose(ra["train_loss"], rb["train_loss"], rel_tol=1e-5)
    wa, wb = got["sequential"].server_state.weights, got["batched"].server_state.weights
    for k in wa:
        err = float((wa[k].double() - wb[k].double()).norm() / wa[k].double().norm().clamp(min=1e-12))
        assert err <= 1e-5, (k, err)
