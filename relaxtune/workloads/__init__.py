"""The workload registry and loader.

``load(spec, config, dtype)`` returns a :class:`Workload`: ``spec`` is a built-in name from
:data:`BUILTIN` (``llama-block``, ``gpt2-block``, ``mlp``), the path of a user ``.py`` file
(see :mod:`relaxtune.workloads.user`), or an imported model: ``torch:package.module:Factory``
(:mod:`.torch_spec`), ``hf:MODEL_TYPE`` (:mod:`.hf_import`), ``torchvision:NAME``
(:mod:`.torchvision_import`) or a path ending in ``.onnx`` (:mod:`.onnx_import`), or a language
model: ``gguf:PATH``, ``hf:DIR`` (a local transformers checkpoint) or a packaged model's name such
as ``smollm2`` (:mod:`.language_model`).
``config`` overrides a built-in's defaults; its values
may be strings (as parsed by :func:`parse_config` from ``hidden=512,heads=8``) and are converted
to the type of the default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from ..config import QuantizeConfig
from ..errors import UserError
from . import gpt2_block, llama_block, mlp
from .base import Dim, TensorSpec, Workload
from .common import DTYPES, Builtin, check_dtype, convert_config_value
from .user import load_user

__all__ = ["BUILTIN", "DTYPES", "Builtin", "Dim", "TensorSpec", "Workload", "load", "parse_config", "resolve_config"]

BUILTIN: dict[str, Builtin] = {b.name: b for b in (llama_block.BUILTIN, gpt2_block.BUILTIN, mlp.BUILTIN)}

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FORM = "expected key=value,key=value,... (e.g. hidden=512,heads=8)"


def parse_config(text: str) -> dict[str, str]:
    """Parse ``"hidden=512,heads=8"`` into ``{"hidden": "512", "heads": "8"}``.

    Whitespace around items is ignored, as are empty items (a trailing comma).
    """
    result: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _KEY.match(key) or not value:
            raise UserError(f"malformed config item {item!r}: {_FORM}")
        if key in result:
            raise UserError(f"config key {key!r} is given twice in {text!r}")
        result[key] = value
    return result


def resolve_config(
    builtin: Builtin, config: Mapping[str, object] | None = None, dtype: str | None = None
) -> dict[str, object]:
    """The built-in's defaults overridden by ``config`` (converted) and ``dtype``."""
    resolved = dict(builtin.defaults)
    for key, value in (config or {}).items():
        if key not in resolved:
            raise UserError(
                f"unknown config key {key!r} for {builtin.name}: valid keys are {', '.join(builtin.defaults)}"
            )
        resolved[key] = convert_config_value(key, value, builtin.defaults[key])
    if dtype is not None:
        resolved["dtype"] = dtype
    check_dtype(resolved["dtype"])
    return resolved


def load(
    spec: str,
    config: Mapping[str, str] | None = None,
    dtype: str | None = None,
    quantize: QuantizeConfig = QuantizeConfig(),
    target=None,
) -> Workload:
    """Build a built-in workload by name, or load a user ``.py`` file (see module docstring); `quantize`:
    how a language model keeps its weights (`QuantizeConfig`), or relaxtune's own weight-only quantization
    of any other workload's projections (``q4f32`` / ``q8f32``, `quantize.quantize_workload`). `target`
    (a `targets.ResolvedTarget`, None: the CPU) matters to language models only: their KV cache's kernels
    and float type are the target's.

    The workload remembers ``spec`` (artifact manifests store it, so ``relaxtune run`` can rebuild
    the reference of an imported model)."""
    from .language_model import is_model_spec

    if is_model_spec(spec):
        from .language_model import load as load_model

        workload = load_model(spec, config, dtype, quantize, target)
    else:
        workload = _load(spec, config, _activation_dtype(dtype, quantize))
        if quantize.bits is not None:
            from .quantize import quantize_workload

            workload = quantize_workload(workload, quantize)
    return workload if workload.spec else dataclasses.replace(workload, spec=spec, spec_config=dict(config or {}))


def _activation_dtype(dtype: str | None, quantize: QuantizeConfig) -> str | None:
    """The workload's dtype: `--dtype`, or the one a mode such as ``q4f16`` names (which must agree)."""
    wanted = quantize.activations
    if wanted is None or dtype in (None, wanted):
        return wanted or dtype
    raise UserError(f"--quantize {quantize.mode} computes in {wanted}: --dtype {dtype} is not allowed with it")


def _load(spec: str, config: Mapping[str, str] | None, dtype: str | None) -> Workload:
    if dtype is not None:
        check_dtype(dtype)
    if spec in BUILTIN:
        builtin = BUILTIN[spec]
        return builtin.build(resolve_config(builtin, config, dtype))
    if spec.startswith("torch:"):
        from .torch_spec import load_torch

        return load_torch(spec, config, dtype)
    if spec.startswith("hf:"):
        from .hf_import import load_hf

        return load_hf(spec[len("hf:") :], config, dtype)
    if spec.startswith("torchvision:"):
        from .torchvision_import import load_torchvision

        return load_torchvision(spec, config, dtype)
    if spec.endswith(".onnx"):
        from .onnx_import import load_onnx

        return load_onnx(spec, config, dtype)
    if os.path.isfile(spec):
        return load_user(spec, config, dtype)
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        raise UserError(f"user workload file {spec!r} does not exist: give a built-in name or a path to a .py file")
    raise UserError(
        f"unknown workload {spec!r}: use one of {', '.join(BUILTIN)}, a path to a .py or .onnx file, "
        "torch:package.module:Factory, hf:MODEL_TYPE, hf:DIR, torchvision:NAME, gguf:PATH or smollm2"
    )
