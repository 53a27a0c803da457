"""Workloads from PyTorch modules: ``torch.export`` with dynamic dims, then TVM's importer.

:func:`from_module` is the core (also used by :mod:`.hf_import`). It exports ``module`` with one
``torch.export.Dim`` per symbolic name in the inputs' shapes (``b`` batch, ``n`` sequence),
imports the program with ``tvm.relax.frontend.torch`` (weights kept as inputs, then detached with
``relax.frontend.detach_params``), renames torch's symbolic variables (``s43``) to the names of
the inputs' shapes so that ``--shape n=...`` works, and keeps the importer's
``tir_var_lower_bound`` / ``tir_var_upper_bound`` (the Dim bounds) under those names. The
reference is the torch module itself; ``params`` are keyed by ``main``'s weight names
(``p_fc1_weight``) and loaded back into a copy of the module when other weights are given.

:func:`load_torch` reads the spec ``torch:package.module:Factory``: ``Factory`` is imported from
the module (which must be importable: installed or on ``sys.path``) and called to build the
``nn.Module``. What the inputs are comes from attributes of ``Factory`` (a function or class):

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
float32.

What TVM's importer cannot translate is reported as a :class:`~relaxtune.errors.UserError`
naming the operator. Must run before: nothing; in a new process call
``relaxtune.schedules.intrin.register_for`` before anything imports MetaSchedule.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import re
from typing import Mapping

import numpy as np

from ..errors import UserError
from ..relax_passes.unmerge_leading_dims import UnmergeLeadingDims
from .base import TensorSpec, Workload
from .common import bounded_dims, detached_weights

logger = logging.getLogger(__name__)

RESERVED = {"max_seq": 128, "min_seq": 1, "max_batch": 4}
_SPEC = re.compile(r"torch:([A-Za-z_][\w.]*):([A-Za-z_]\w*)\Z")


class ExportError(UserError):
    """``torch.export`` (or its decomposition) rejected the dynamic shapes."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def example_sizes(bounds: Mapping[str, tuple[int, int]], static: set[int]) -> dict[str, int]:
    """A distinct example size per dimension inside its bounds (torch merges equal sizes)."""
    sizes: dict[str, int] = {}
    for name, (lo, hi) in bounds.items():
        for value in (7, 5, 3, 11, 13, 6, 9, 10, 2, *range(14, hi + 1)):
            if lo <= value <= hi and value not in sizes.values() and value not in static:
                sizes[name] = value
                break
        else:
            raise UserError(f"dimension {name} with bounds [{lo}, {hi}] leaves no distinct example size: widen it")
    return sizes


def _example(spec: TensorSpec, sizes: Mapping[str, int]):
    import torch

    shape = spec.concrete(sizes)
    dtype = getattr(torch, spec.dtype)
    if spec.fill == "ones":
        return torch.ones(shape, dtype=dtype)
    if spec.fill == "index":
        return torch.randint(0, spec.high, shape, dtype=dtype)
    return torch.randn(shape, dtype=dtype)


def _export(name: str, module, inputs: tuple[TensorSpec, ...], bounds: Mapping[str, tuple[int, int]]):
    import torch

    static = {d for t in inputs for d in t.shape if isinstance(d, int)}
    sizes = example_sizes(bounds, static)
    dims = {d: torch.export.Dim(d, min=lo, max=hi) for d, (lo, hi) in bounds.items()}
    dynamic = tuple({axis: dims[d] for axis, d in enumerate(t.shape) if isinstance(d, str)} for t in inputs)
    args = tuple(_example(t, sizes) for t in inputs)
    try:
        with torch.no_grad():
            program = torch.export.export(module, args, dynamic_shapes=dynamic)
            return program.run_decompositions()
    except Exception as err:  # torch's message is long: keep its first line
        raise ExportError(
            f"torch.export of {name} with dynamic {', '.join(bounds)} failed: {_first_line(err)}"
        ) from err


def _translate(name: str, program):
    """TVM's importer, with each converter's failure reported under its operator's name."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    importer = ExportedProgramImporter()
    missing: dict[str, list[str]] = {}  # operator -> the graph nodes calling it
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target.__name__ not in importer.convert_map:
            missing.setdefault(node.target.__name__, []).append(node.name)
    if missing:
        where = "; ".join(
            f"{op} (node {', '.join(nodes[:3])}{', ...' if len(nodes) > 3 else ''})"
            for op, nodes in sorted(missing.items())
        )
        raise UserError(
            f"cannot import {name}: TVM's PyTorch importer has no converter for operator(s) {where} "
            "(rewrite them with supported torch ops)"
        )

    def named(op: str, convert):
        def run(*args):
            try:
                return convert(*args)
            except Exception as err:
                raise UserError(
                    f"cannot import {name}: TVM's PyTorch importer failed on operator {op}: {_first_line(err)}"
                ) from err

        return run

    importer.convert_map = {op: named(op, f) if isinstance(op, str) else f for op, f in importer.convert_map.items()}
    return importer.from_exported_program(program, True, True, False, None)


def _rename_dims(name: str, mod, inputs: tuple[TensorSpec, ...], bounds: Mapping[str, tuple[int, int]]):
    """torch's symbols (s43) → the inputs' dimension names; the bounds attrs follow."""
    from tvm import relax, tirx

    main = mod["main"]
    renames: dict[str, str] = {}
    mapping = {}
    for spec, var in zip(inputs, main.params):
        for axis, (want, got) in enumerate(zip(spec.shape, var.ty.shape.values)):
            if not isinstance(want, str):
                continue
            if not isinstance(got, tirx.Var):
                raise UserError(
                    f"cannot import {name}: torch fixed dimension {want} of input {spec.name!r} to {got} (axis {axis})"
                )
            if renames.setdefault(got.name, want) != want:
                raise UserError(
                    f"cannot import {name}: torch merged dimensions {renames[got.name]} and {want} into one"
                )
            mapping[got] = tirx.Var(want, "int64")
    mod = relax.transform.BindSymbolicVars(mapping)(mod)
    attrs = main.attrs
    lower = {renames[k]: int(v) for k, v in dict(attrs.get("tir_var_lower_bound", {}) or {}).items() if k in renames}
    upper = {renames[k]: int(v) for k, v in dict(attrs.get("tir_var_upper_bound", {}) or {}).items() if k in renames}
    for dim, (lo, hi) in bounds.items():
        lower.setdefault(dim, lo)
        upper.setdefault(dim, hi)
    mod = mod.clone()
    mod["main"] = mod["main"].with_attr("tir_var_lower_bound", lower).with_attr("tir_var_upper_bound", upper)
    return mod, {d: (lower[d], upper[d]) for d in bounds}


def _check_shapes(name: str, main) -> None:
    """Tensors whose shape the importer could not infer break legalization later: name the op."""
    from tvm import relax

    for block in main.body.blocks:
        for binding in block.bindings:
            ty = binding.var.ty
            if isinstance(ty, relax.TensorType) and ty.shape is None and isinstance(binding.value, relax.Call):
                op = getattr(binding.value.op, "name", str(binding.value.op))
                raise UserError(
                    f"cannot import {name}: TVM's importer left the output of operator {op} with an unknown shape"
                )


def from_module(
    name: str,
    module,
    inputs: tuple[TensorSpec, ...],
    bounds: Mapping[str, tuple[int, int]],
    config: Mapping[str, object],
) -> Workload:
    """Export ``module`` (its ``forward`` takes ``inputs`` positionally) as a bounded workload.

    ``bounds`` gives ``(lower, upper)`` for every symbolic name used in the inputs' shapes.
    """
    from tvm import relax

    module = module.eval()
    program = _export(name, module, inputs, bounds)
    mod = _translate(name, program)
    main = mod["main"]
    if not isinstance(main.ret_ty, relax.TensorType):
        raise UserError(
            f"cannot import {name}: its forward returns {main.ret_ty}, relaxtune workloads return one tensor"
        )
    mod, bounds = _rename_dims(name, mod, inputs, bounds)
    mod = UnmergeLeadingDims()(mod)
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    _check_shapes(name, main)
    params = detached_weights(mod, detached)
    targets = {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind.name == "PARAMETER"}
    dims = bounded_dims(bounds)
    logger.info("imported %s: %d inputs, %d weights, dims %s", name, len(inputs), len(params), bounds)

    def reference(values: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]) -> np.ndarray:
        """The torch module itself (a copy holding ``weights`` when they are not the workload's)."""
        import torch

        model = module
        if weights is not params:
            model = copy.deepcopy(module)
            state = {targets[k]: torch.from_numpy(np.asarray(v)) for k, v in weights.items() if k in targets}
            model.load_state_dict(state, strict=False)
        with torch.no_grad():
            out = model(*(torch.from_numpy(np.asarray(values[t.name])) for t in inputs))
        return out.numpy()

    return Workload(
        name=name,
        mod=mod,
        params=params,
        inputs=tuple(inputs),
        dims=dims,
        config=dict(config),
        reference=reference,
        torch_module=lambda: module,
    )


def _factory(spec: str):
    match = _SPEC.match(spec)
    if not match:
        raise UserError(f"torch workload {spec!r} is malformed: use torch:package.module:Factory")
    path, attr = match.groups()
    try:
        pymod = importlib.import_module(path)
    except Exception as err:
        raise UserError(
            f"torch workload module {path!r} cannot be imported ({_first_line(err)}): it must be on sys.path"
        ) from err
    factory = getattr(pymod, attr, None)
    if not callable(factory):
        raise UserError(f"torch workload {spec!r}: {path} has no callable {attr!r}")
    return factory


def _factory_kwargs(spec: str, factory, config: Mapping[str, object]) -> dict[str, object]:
    from . import _convert  # the package's config conversion (package is initialised by now)

    params = inspect.signature(factory).parameters
    kwargs = {}
    for key, value in config.items():
        if key not in params:
            allowed = ", ".join([*RESERVED, "shape", *params]) or "(none)"
            raise UserError(f"config key {key!r} is not accepted by {spec}: valid keys are {allowed}")
        default = params[key].default
        kwargs[key] = value if default is inspect.Parameter.empty or default is None else _convert(key, value, default)
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
