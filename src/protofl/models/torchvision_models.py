"""Any torchvision classification model by name: ``model.name: torchvision:<name>`` (the
``torchvision`` extra).

The network comes from ``torchvision.models.get_model(name, ...)`` and is split into body
and head by :func:`protofl.models.split.split_classifier`, so that every method, prototype
methods included, can use it. ``model.params`` pass through to torchvision's builder
(``zero_init_residual``, ``dropout``, ``width_mult``, ...); ``num_classes`` is the
dataset's.

Pretrained weights: ``weights: <name>`` (``IMAGENET1K_V1``, ``DEFAULT``, or the full
``ResNet18_Weights.IMAGENET1K_V1``) are read from torch's hub cache
(``$TORCH_HOME/hub/checkpoints``, where torchvision itself keeps them), checked against the
hash prefix in their file name, and loaded with ``torch.load(..., weights_only=True)``.
protofl never downloads them (a missing file is a one-line error that says where to put
which URL). With the weights' own classes (1,000 for ImageNet) differing from the
dataset's, the head is a fresh Linear; the body keeps the pretrained weights.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Callable, cast, Optional
from urllib.parse import urlparse

import torch

from ..errors import ConfigError, one_line
from ..nn.modes import eval_mode
from ..registry import UnknownNameError
from .base import FLModel
from .pretrained import read_state_dict
from .split import split_classifier

PREFIX = "torchvision:"
USAGE = "torchvision:<name> (any torchvision classification model, e.g. torchvision:resnet18; the torchvision extra)"
INSTALL = ("install the torchvision build of your torch: with a CUDA torch, pip install 'protofl[torchvision]'; with "
           "the CPU build of torch 2.13.0, pip install torchvision==0.28.0 --index-url "
           "https://download.pytorch.org/whl/cpu (PyPI's torchvision wheels are CUDA builds)")
# builders whose training-mode forward also returns auxiliary logits unless told not to; the
# body must return features only (with pretrained weights torchvision loads the auxiliary
# heads and then drops them, as it does for its own users)
NO_AUX = {"googlenet": "aux_logits", "inception_v3": "aux_logits"}
HASH = re.compile(r"-([a-f0-9]*)\.")  # torch.hub's: the sha256 prefix in a checkpoint's file name
_VERIFIED: dict[tuple[str, int, int], bool] = {}  # (file, size, mtime): hashed once per process


def torchvision_models(name: str = PREFIX):
    """``torchvision.models``, or the one-line error that says how to install it."""
    try:
        import torchvision.models as tvm
    except ImportError:
        raise ConfigError("model.name", name, f"needs torchvision: {INSTALL}") from None
    except Exception as e:  # noqa: BLE001 - a build that does not match torch fails to import in many ways
        raise ConfigError("model.name", name, f"torchvision is installed but cannot be imported "
                          f"({type(e).__name__}: {one_line(e, 160)}): {INSTALL}") from None
    return tvm


def unknown(name: str, known: list[str]) -> UnknownNameError:
    """The error for a name torchvision has no classification model for, with close matches."""
    close = difflib.get_close_matches(name.lower(), known, n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else f"it has: {', '.join(known)}"
    return UnknownNameError(f"torchvision has no classification model {name!r}; {hint}")


def resolve(name: str) -> Callable[..., FLModel]:
    """The builder of ``torchvision:<name>``: ``(input_shape, num_classes, weights=None,
    **options) -> FLModel``."""
    if not name:
        raise UnknownNameError("expected torchvision:<name>, e.g. torchvision:resnet18")
    tvm = torchvision_models(PREFIX + name)
    known = tvm.list_models(module=tvm)  # classification models only (not detection, video, ...)
    if name not in known:
        raise unknown(name, known)

    def build(input_shape: tuple, num_classes: int, weights: Optional[str] = None, **options: Any) -> FLModel:
        return build_torchvision(name, input_shape, num_classes, weights, options)

    build.__name__ = build.__qualname__ = f"torchvision_{name}"
    build.__doc__ = f"torchvision's {name}, split into body and head (protofl.models.torchvision_models)."
    return build


def build_torchvision(name: str, input_shape: tuple, num_classes: int, weights: Optional[str],
                      options: dict[str, Any]) -> FLModel:
    if "progress" in options:
        raise ConfigError("model.progress", options["progress"], "protofl never downloads weights")
    tvm = torchvision_models(PREFIX + name)
    kwargs = dict(options)
    aux = NO_AUX.get(name)
    if aux is not None:
        if kwargs.setdefault(aux, False):
            raise ConfigError(f"model.{aux}", kwargs[aux], "protofl trains on the main output only; leave it false")
    enum = weights_member(tvm, name, weights)
    try:
        if enum is None:
            net = tvm.get_model(name, weights=None, num_classes=num_classes, **kwargs)
        else:
            with state_dict_from(enum, hub_checkpoint(enum, cast(str, weights))):  # enum: weights named it
                net = tvm.get_model(name, weights=enum, progress=False, **kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a parameter the builder does not take, or refuses
        raise ConfigError("model", options, f"torchvision's {name} refuses these parameters: "
                          f"{type(e).__name__}: {one_line(e, 200)}") from None
    model = split_classifier(net, num_classes)
    check_forward(model, name, input_shape)
    return model


def weights_member(tvm, name: str, weights: Optional[str]):
    """The member of ``name``'s weights enum that ``weights`` names (None for none)."""
    if weights is None:
        return None
    enum_cls = tvm.get_model_weights(name)
    member = str(weights).removeprefix(f"{enum_cls.__name__}.")
    if member not in enum_cls.__members__:
        raise ConfigError("model.weights", weights, f"torchvision's {name} has the weights "
                          f"{', '.join(enum_cls.__members__)} (or null)")
    return enum_cls.__members__[member]


def hub_checkpoint(enum, weights: str) -> Path:
    """The verified file of ``enum`` in torch's hub cache (where torchvision downloads it to)."""
    url = enum.url
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
    if not path.is_file():
        raise ConfigError("model.weights", weights, f"{enum!r} is not in torch's hub cache and protofl never "
                          f"downloads weights: download {url} to {path} (or load the model once with torchvision "
                          "where there is network; TORCH_HOME moves the cache)")
    m = HASH.search(path.name)
    st = path.stat()
    stamp = (str(path), st.st_size, st.st_mtime_ns)
    if m and not _VERIFIED.get(stamp):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if not h.hexdigest().startswith(m.group(1)):
            raise ConfigError("model.weights", weights, f"{path} is not the published file of {enum!r} (its sha256 "
                              f"starts {h.hexdigest()[:len(m.group(1))]}, the name says {m.group(1)}): delete it "
                              f"and download {url} again")
        _VERIFIED[stamp] = True
    return path


@contextlib.contextmanager
def state_dict_from(enum, path: Path):
    """While torchvision builds the model, ``enum.get_state_dict()`` reads ``path`` with
    ``weights_only=True``.

    torchvision's builders adapt the architecture to the weights (the number of classes, the
    auxiliary heads and ``transform_input`` of GoogLeNet and Inception, ViT's image size) and
    then call ``weights.get_state_dict()``, which would download a missing file and
    unpickles with ``weights_only=False``. Letting the builder do the first and answering the
    second from the verified cached file keeps torchvision's own recipe and loads tensors only.
    """
    cls = type(enum)
    own = cls.__dict__.get("get_state_dict")
    cls.get_state_dict = lambda self, *args, **kwargs: read_state_dict(path, "model.weights")
    try:
        yield
    finally:
        if own is None:
            del cls.get_state_dict
        else:
            cls.get_state_dict = own


def check_forward(model: FLModel, name: str, input_shape: tuple) -> None:
    """One forward of two zero inputs in eval mode (no state changes, no random draws):
    the body must take ``input_shape`` and give (B, feature_dim)."""
    shape = tuple(input_shape)
    try:
        with eval_mode(model), torch.no_grad():
            h = model.body(torch.zeros(2, *shape))
    except (RuntimeError, ValueError, IndexError, AssertionError) as e:  # channels, a minimum or fixed size
        raise ValueError(f"torchvision's {name} cannot take inputs of shape {shape}: {one_line(e, 200)}") from None
    if tuple(h.shape) != (2, model.feature_dim):
        raise ValueError(f"torchvision's {name}: its body gives features of shape {tuple(h.shape[1:])}, "
                         f"not ({model.feature_dim},), for inputs of shape {shape}")
