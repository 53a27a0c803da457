"""Workloads from torchvision's classification models: ``torchvision:NAME`` (``torchvision:resnet50``).

The model is built by ``torchvision.models.get_model(NAME)`` with random weights (torchvision's own
initialisation under ``seed``; the batch-norm statistics and affine parameters are then drawn from
``seed`` too, so that a folded batch norm is not the identity), or loaded from ``weights=FILE``, a
state dict saved with ``torch.save`` (nothing is downloaded). It is exported by
:func:`relaxtune.workloads.torch_import.from_module` with one input ``x: (b, C, image, image)``,
``b`` symbolic in ``[1, max_batch]`` (its buckets as for any symbolic dimension), and its reference
is the torch model itself. Its linear layers' weights stay as stored, (out, in) (``Workload.weights_nk``):
the classifier at batch 1 is then a GEMV over contiguous weight rows, not a strided walk of its
transpose (``docs/results.md``, CPU convolutional nets).

Config keys (:data:`DEFAULTS`): ``max_batch`` (16), ``image`` (224: the input's height and width),
``input`` (``CxHxW``, e.g. ``3x224x224``, instead of ``image``: its rank and channel count are
checked against the model), ``num_classes`` (1000), ``weights`` (a state dict file), ``seed`` (0).

torchvision and this machine's torch: PyPI's torchvision wheels ship a C++ extension linked against
a CUDA build of torch, which does not load beside the CPU build pip installs here; the models need
none of its operators, and ``relaxtune.torchvision_compat`` makes ``import torchvision`` work
without it. Detection, video and segmentation models, which call those operators, are not
classification models and are not offered.

Must run before: nothing. Bad input (an unknown model name, a bad config, an operator TVM's
importer cannot translate) is a :class:`~relaxtune.errors.UserError`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Mapping
from pathlib import Path

from ..errors import UserError
from .base import TensorSpec, Workload
from .common import convert_config_value
from .torch_import import from_module

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, object] = {
    "max_batch": 16,
    "image": 224,
    "input": "",
    "num_classes": 1000,
    "weights": "",
    "seed": 0,
}
PREFIX = "torchvision:"
# stock TVM compiles convolutions to naive loop nests (minutes for a ResNet-50 batch): not run by default
BENCH_SYSTEMS = ("relaxtune", "torch", "torch.compile", "onnxruntime")


def torchvision_models():
    """``torchvision.models`` (``relaxtune.torchvision_compat`` lets it import without the C++ extension)."""
    from ..torchvision_compat import install

    install()
    try:
        return importlib.import_module("torchvision.models")
    except ImportError as err:
        if err.name == "torchvision":
            raise UserError("torchvision: workloads need the torchvision package: pip install torchvision") from None
        raise


def available() -> list[str]:
    """The names of torchvision's classification models, sorted."""
    models = torchvision_models()
    return sorted(models.list_models(module=models))


def _check_name(name: str) -> None:
    names = available()
    if name not in names:
        raise UserError(f"unknown torchvision model {name!r}: the classification models are {', '.join(names)}")


def _resolve(config: Mapping[str, object] | None) -> dict[str, object]:
    resolved = dict(DEFAULTS)
    for key, value in (config or {}).items():
        if key not in DEFAULTS:
            raise UserError(f"unknown config key {key!r} for torchvision models: valid keys are {', '.join(DEFAULTS)}")
        resolved[key] = convert_config_value(key, value, DEFAULTS[key])
    for key in ("max_batch", "image", "num_classes"):
        if int(resolved[key]) < 1:
            raise UserError(f"config {key}={resolved[key]} is invalid: {key} must be >= 1")
    return resolved


def _input_shape(settings: Mapping[str, object], channels: int) -> tuple[int, int, int]:
    """(C, H, W) of one image: from ``input`` when given (rank and channels checked), else ``image``."""
    text = str(settings["input"])
    if not text:
        return channels, int(settings["image"]), int(settings["image"])
    items = text.split("x")
    if not all(i.isdigit() and int(i) > 0 for i in items):
        raise UserError(f"config input={text!r} is malformed: use CxHxW with positive sizes, e.g. {channels}x224x224")
    if len(items) != 3:
        raise UserError(f"config input={text!r} has rank {len(items)}: the model takes one CxHxW image per batch row")
    shape = tuple(int(i) for i in items)
    if shape[0] != channels:
        raise UserError(
            f"config input={text!r} has {shape[0]} channels: the model's first convolution takes {channels}"
        )
    return shape


def _first_conv_channels(model) -> int:
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            return int(module.in_channels)
    return 3


def _randomise_batch_norms(model, seed: int) -> None:
    """Batch-norm statistics and affine parameters drawn from ``seed`` (torchvision leaves them at
    mean 0, variance 1, scale 1, shift 0: a folded batch norm would be the identity)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                size = module.running_mean.shape
                module.running_mean.copy_(torch.randn(size, generator=gen) * 0.1)
                module.running_var.copy_(torch.rand(size, generator=gen) * 0.5 + 0.75)
                if module.affine:
                    module.weight.copy_(1.0 + torch.randn(size, generator=gen) * 0.1)
                    module.bias.copy_(torch.randn(size, generator=gen) * 0.1)


def _load_weights(model, path: str) -> None:
    import torch

    file = Path(path)
    if not file.is_file():
        raise UserError(f"config weights={path!r}: no such file (give a state dict saved with torch.save)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"config weights={path!r} is not a torch state dict file: {type(err).__name__}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise UserError(f"config weights={path!r} holds a {type(state).__name__}, not a state dict")
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        first = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise UserError(f"config weights={path!r} does not fit the model: {first}") from None
    if result.missing_keys or result.unexpected_keys:
        keys = [*(f"missing {k}" for k in result.missing_keys), *(f"unexpected {k}" for k in result.unexpected_keys)]
        raise UserError(f"config weights={path!r} does not fit the model: {len(keys)} keys differ, e.g. {keys[0]}")


def build_model(name: str, settings: Mapping[str, object]):
    """The torch model ``name`` in eval mode, with random (seeded) weights or the state dict file."""
    import torch

    models = torchvision_models()
    torch.manual_seed(int(settings["seed"]))
    try:
        model = models.get_model(name, weights=None, num_classes=int(settings["num_classes"]))
    except (TypeError, ValueError) as err:
        raise UserError(
            f"torchvision model {name} cannot be built with num_classes={settings['num_classes']}: {err}"
        ) from None
    if settings["weights"]:
        _load_weights(model, str(settings["weights"]))
    else:
        _randomise_batch_norms(model, int(settings["seed"]))
    return model.eval()


def load_torchvision(spec: str, config: Mapping[str, object] | None = None, dtype: str | None = None) -> Workload:
    """Build the workload of a ``torchvision:NAME`` spec (see the module docstring)."""
    if dtype not in (None, "float32"):
        raise UserError(f"dtype {dtype!r} is not supported for torchvision models: they run in float32")
    name = spec[len(PREFIX) :]
    _check_name(name)
    settings = _resolve(config)
    model = build_model(name, settings)
    shape = _input_shape(settings, _first_conv_channels(model))
    batch = "b" if int(settings["max_batch"]) > 1 else 1  # max_batch=1: a static batch of one
    inputs = (TensorSpec("x", (batch, *shape), "float32"),)
    bounds = {"b": (1, int(settings["max_batch"]))} if batch == "b" else {}
    recorded = {k: v for k, v in settings.items() if v != DEFAULTS[k]}
    workload = from_module(name, model, inputs, bounds, {"spec": spec, **recorded})
    # the classifier's weight stays (classes, features) as stored: at b = 1 its GEMV reads weight rows contiguously
    return dataclasses.replace(workload, bench_systems=BENCH_SYSTEMS, weights_nk=True)
