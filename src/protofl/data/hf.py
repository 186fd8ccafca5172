"""Any Hugging Face dataset by name: ``data.name: hf:<repo>`` (the ``hf`` extra).

The Hub copy is read with the ``datasets`` library (its cache, its revision pinning);
protofl takes one image (or feature) column and one label column of a train and a test
split and holds them in memory like every other dataset. Partitions stay protofl's own.
``<repo>`` may also be a local folder ``datasets`` can read (parquet, csv, an image
folder), which is how the tests run it without a network.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..errors import ConfigError, DataFileError, InputError, one_line
from .dataset import Dataset

IMAGE_COLUMNS = ("image", "img", "pixel_values")
LABEL_COLUMNS = ("label", "labels", "fine_label", "character")


def _first(columns, wanted, given: Optional[str], what: str, repo: str) -> str:
    if given is not None:
        if given not in columns:
            raise ConfigError(f"data.{what}_column", given, f"hf:{repo} has the columns {', '.join(columns)}")
        return given
    found = next((c for c in wanted if c in columns), None)
    if found is None:
        raise ConfigError(f"data.{what}_column", None, f"hf:{repo} has no {what} column among {', '.join(columns)}; "
                          f"name one (data.{what}_column=...)")
    return found


def _image(v: Any) -> Any:
    """An image as ``datasets`` may hand it undecoded ({"bytes": ..., "path": ...}) -> PIL."""
    if isinstance(v, dict) and ("bytes" in v or "path" in v):
        import io

        from PIL import Image

        return Image.open(io.BytesIO(v["bytes"]) if v.get("bytes") is not None else v["path"])
    return v


def to_array(values: list, repo: str) -> np.ndarray:
    """A column of PIL images (decoded or as ``datasets``' {"bytes", "path"} records), nested
    lists or numbers -> a numpy array (images: uint8 (N, C, H, W))."""
    values = [_image(v) for v in values]
    first = values[0] if values else None
    if first is not None and hasattr(first, "convert") and hasattr(first, "size"):  # PIL images
        mode = "RGB" if any(getattr(v, "mode", "L") not in ("L", "1", "I;16") for v in values) else "L"
        arrays = [np.asarray(v.convert(mode), dtype=np.uint8) for v in values]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise DataFileError(f"hf:{repo}: images of different sizes {sorted(shapes)[:3]}; protofl holds "
                                "same-sized images only")
        x = np.stack(arrays)
        return x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
    return np.asarray(values)


def from_columns(repo: str, train: dict[str, list], test: dict[str, list], image: str, label: str,
                 class_names: Optional[list[str]] = None) -> Dataset:
    """The train and test splits' columns -> a :class:`Dataset` (images as uint8, scaled to [0, 1]
    and normalized by the training split's per-channel statistics; other features as float32)."""
    from .dataset import channel_stats

    xs = [to_array(split[image], repo) for split in (train, test)]
    ys = []
    for split in (train, test):
        try:
            ys.append(np.asarray(split[label], dtype=np.int64).reshape(-1))
        except (TypeError, ValueError):
            raise DataFileError(f"hf:{repo}: label column {label!r} is not integer class ids") from None
    num_classes = len(class_names) if class_names else int(max(y.max() if y.size else -1 for y in ys)) + 1
    if any(y.size and (y.min() < 0 or y.max() >= num_classes) for y in ys):
        raise DataFileError(f"hf:{repo}: labels outside 0..{num_classes - 1}")
    if xs[0].dtype == np.uint8 and xs[0].ndim == 4:
        mean, std = channel_stats(xs[0])
        fields: dict[str, Any] = dict(scale=255.0, mean=mean, std=std, kind="image")
    else:
        xs = [x.astype(np.float32) for x in xs]
        fields = dict(kind="vector" if xs[0].ndim == 2 else "image")
    return Dataset(name=f"hf:{repo}", x_train=torch.from_numpy(np.ascontiguousarray(xs[0])),
                   y_train=torch.from_numpy(ys[0]), x_test=torch.from_numpy(np.ascontiguousarray(xs[1])),
                   y_test=torch.from_numpy(ys[1]), num_classes=num_classes, class_names=class_names,
                   info={"source": f"hf:{repo}"}, **fields)


@contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """The Hugging Face libraries kept off the network (their HF_HUB_OFFLINE, read when a
    call is made) while ``offline``."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants as constants

    before = (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = before


def load_hf(repo: str, seed: int, image_column: Optional[str] = None, label_column: Optional[str] = None,
            train_split: str = "train", test_split: str = "test", revision: Optional[str] = None,
            subset: Optional[str] = None, *, download: Optional[bool] = None) -> Dataset:
    """Load ``repo`` (a Hub id or a local folder) with ``datasets.load_dataset``.

    ``PROTOFL_OFFLINE=1`` or ``download=False`` (``data.download: false``) keep it off the
    network: a local folder or a copy in the ``datasets`` cache loads, anything else stops
    in one line."""
    from .fetch import offline_reason

    try:
        import datasets
    except ImportError:
        raise ConfigError("data.name", f"hf:{repo}", "needs the datasets library: pip install 'protofl[hf]'") from None
    if not repo:
        raise ConfigError("data.name", "hf:", "expected hf:<repository>, e.g. hf:uoft-cs/cifar10")
    why = offline_reason(download)
    try:
        with _hub_offline(why is not None):
            dd = datasets.load_dataset(repo, subset, revision=revision)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for an unknown or unreachable repo
        off = f"; downloads are off ({why}) and it is neither a local folder nor in the datasets cache" if why else ""
        raise DataFileError(f"hf:{repo}: cannot be loaded ({type(e).__name__}: {one_line(e, 200)}){off}") from None
    missing = [s for s in (train_split, test_split) if s not in dd]
    if missing:
        raise ConfigError("data.test_split" if test_split in missing else "data.train_split", missing[0],
                          f"hf:{repo} has the splits {', '.join(dd)}")
    columns = list(dd[train_split].column_names)
    image = _first(columns, IMAGE_COLUMNS, image_column, "image", repo)
    label = _first(columns, LABEL_COLUMNS, label_column, "label", repo)
    feature = dd[train_split].features.get(label)
    names = list(feature.names) if getattr(feature, "names", None) else None
    # the two columns, each image decoded (to_dict() leaves datasets' Image records undecoded)
    cols = [{c: list(dd[split][c]) for c in (image, label)} for split in (train_split, test_split)]
    return from_columns(repo, cols[0], cols[1], image, label, names)
