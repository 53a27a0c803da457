"""The ``torch:package.module:Factory`` workload spec: which module to build and with what inputs.

:func:`load_torch` (called by the registry, :func:`relaxtune.workloads.load`) imports
``Factory`` from the module (which must be importable: installed or on ``sys.path``) and calls it
to build the ``nn.Module``, which :func:`relaxtune.workloads.torch_import.from_module` exports.
What the inputs are comes from attributes of ``Factory`` (a function or class):

* ``input_shapes`` (required unless the config gives ``shape``): one shape per ``forward``
  argument; ints are static sizes, ``"b"`` and ``"n"`` are the symbolic batch and sequence.
* ``input_dtypes`` (default float32 each), ``input_names`` (default ``forward``'s argument
  names), ``input_fills`` (per input ``"normal"``, ``"ones"`` or an int N: random integers in
  ``[0, N)``; default ``"normal"`` for floats and ``2`` for integers).
* ``max_seq`` (default 128), ``min_seq`` (default 1), ``max_batch`` (default 4; 1 means a static
  batch of 1).

Config keys ``max_seq``, ``min_seq``, ``max_batch`` override those attributes; ``shape=bxnx64``
gives one float32 input instead of ``input_shapes``. Every other config key is passed to
``Factory`` as a keyword argument (converted to the type of its default). Imported models run in
float32. A malformed spec, config or attribute is a :class:`~relaxtune.errors.UserError`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Mapping

from ..errors import UserError
from .base import TensorSpec, Workload
from .common import convert_config_value
from .torch_import import first_line, from_module

RESERVED = {"max_seq": 128, "min_seq": 1, "max_batch": 4}
_SPEC = re.compile(r"torch:([A-Za-z_][\w.]*):([A-Za-z_]\w*)\Z")


def _factory(spec: str):
    match = _SPEC.match(spec)
    if not match:
        raise UserError(f"torch workload {spec!r} is malformed: use torch:package.module:Factory")
    path, attr = match.groups()
    try:
        pymod = importlib.import_module(path)
    except Exception as err:
        raise UserError(
            f"torch workload module {path!r} cannot be imported ({first_line(err)}): it must be on sys.path"
        ) from err
    factory = getattr(pymod, attr, None)
    if not callable(factory):
        raise UserError(f"torch workload {spec!r}: {path} has no callable {attr!r}")
    return factory


def _factory_kwargs(spec: str, factory, config: Mapping[str, object]) -> dict[str, object]:
    params = inspect.signature(factory).parameters
    kwargs = {}
    for key, value in config.items():
        if key not in params:
            allowed = ", ".join([*RESERVED, "shape", *params]) or "(none)"
            raise UserError(f"config key {key!r} is not accepted by {spec}: valid keys are {allowed}")
        default = params[key].default
        typed = default is not inspect.Parameter.empty and default is not None
        kwargs[key] = convert_config_value(key, value, default) if typed else value
    return kwargs


def _parse_shape(text: str) -> tuple[int | str, ...]:
    shape: list[int | str] = []
    for item in str(text).split("x"):
        if item in ("b", "n"):
            shape.append(item)
        elif item.isdigit() and int(item) > 0:
            shape.append(int(item))
        else:
            raise UserError(f"config shape={text!r} is malformed: use sizes and b/n joined by x, e.g. bxnx64")
    return tuple(shape)


def _input_specs(spec: str, factory, module, shape_text: object | None) -> tuple[TensorSpec, ...]:
    import torch

    if shape_text is not None:
        shapes, dtypes = [_parse_shape(str(shape_text))], ["float32"]
    else:
        shapes = getattr(factory, "input_shapes", None)
        if not shapes:
            raise UserError(
                f"torch workload {spec}: the factory has no input_shapes attribute (or give config shape=bxnx64)"
            )
        dtypes = list(getattr(factory, "input_dtypes", ["float32"] * len(shapes)))
    forward = [p for p in inspect.signature(module.forward).parameters]
    names = list(getattr(factory, "input_names", forward[: len(shapes)]))
    fills = list(getattr(factory, "input_fills", [None] * len(shapes)))
    if not len(names) == len(dtypes) == len(fills) == len(shapes):
        raise UserError(
            f"torch workload {spec}: input_shapes, input_dtypes, input_names and input_fills differ in length"
        )
    result = []
    for name, shape, dtype, fill in zip(names, shapes, dtypes, fills):
        bad = [d for d in shape if not (isinstance(d, int) and d > 0) and d not in ("b", "n")]
        if bad or not hasattr(torch, str(dtype)):
            raise UserError(
                f"torch workload {spec}: input {name!r} has shape {tuple(shape)} / dtype {dtype}: sizes must be ints > "
                "0, 'b' or 'n'"
            )
        if fill is None:
            fill = "normal" if "float" in str(dtype) else 2
        if isinstance(fill, int):
            result.append(TensorSpec(name, tuple(shape), str(dtype), "index", fill))
        else:
            result.append(TensorSpec(name, tuple(shape), str(dtype), str(fill)))
    return tuple(result)


def _int(key: str, value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise UserError(f"config {key}={value!r} is not an integer") from None


def load_torch(spec: str, config: Mapping[str, object] | None = None, dtype: str | None = None) -> Workload:
    """Build the workload of a ``torch:package.module:Factory`` spec (see the module docstring)."""
    if dtype not in (None, "float32"):
        raise UserError(f"dtype {dtype!r} is not supported for imported models: they run in float32")
    factory = _factory(spec)
    config = dict(config or {})
    limits = {k: _int(k, config.pop(k, getattr(factory, k, default))) for k, default in RESERVED.items()}
    shape_text = config.pop("shape", None)
    module = factory(**_factory_kwargs(spec, factory, config))
    if not hasattr(module, "forward") or not callable(module):
        raise UserError(
            f"torch workload {spec}: the factory returned {type(module).__name__}, expected a torch.nn.Module"
        )
    inputs = _input_specs(spec, factory, module, shape_text)
    if not 1 <= limits["min_seq"] <= limits["max_seq"] or limits["max_batch"] < 1:
        raise UserError(f"torch workload {spec}: need 1 <= min_seq <= max_seq and max_batch >= 1, got {limits}")
    used = {d for t in inputs for d in t.shape if isinstance(d, str)}
    if limits["max_batch"] == 1 and "b" in used:
        inputs = tuple(
            TensorSpec(t.name, tuple(1 if d == "b" else d for d in t.shape), t.dtype, t.fill, t.high) for t in inputs
        )
        used.discard("b")
    bounds = {
        d: b
        for d, b in {"b": (1, limits["max_batch"]), "n": (limits["min_seq"], limits["max_seq"])}.items()
        if d in used
    }
    name = spec.rsplit(":", 1)[1]
    return from_module(name, module, inputs, bounds, {"spec": spec, **limits, **{k: str(v) for k, v in config.items()}})
