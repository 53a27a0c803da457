"""Workloads from ONNX files: a path ending in ``.onnx``, imported with ``tvm.relax.frontend.onnx``.

The graph's inputs become the workload's inputs and its initializers the weights (imported with
``keep_params_in_input=True``, then detached), except rank-0 initializers: those are the exporter's
literals and become constants. Each dynamic axis (an ONNX ``dim_param``, e.g.
from ``torch.onnx.export(..., dynamic_axes=...)``) must be the batch or the sequence: a
``dim_param`` named ``b``/``batch``/``batch_size`` becomes ``b`` and one named
``n``/``seq``/``seq_len``/``sequence``/``sequence_length`` becomes ``n``; config keys
``batch_name=NAME`` / ``seq_name=NAME`` map other names. The bounds come from the config:
``max_seq`` (default 128), ``min_seq`` (1), ``max_batch`` (4).

Random inputs: floats are standard normal, an integer input whose name contains ``mask`` is all
ones, and another integer input is a random index below the row count of the initializer it is
gathered from (a token id within the vocabulary; below 2 when there is none).

The reference is ONNX's own evaluator (``onnx.reference.ReferenceEvaluator``) with the given
weights; ``torch_module()`` is not available. An operator TVM's ONNX importer does not support
or fails on is a :class:`~relaxtune.errors.UserError` naming it. Must run before: nothing.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import re
from typing import Mapping

import numpy as np

from ..errors import UserError
from .base import TensorSpec, Workload
from .common import bounded_dims, convert_config_value, detached_weights, set_bounds

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, object] = {"max_seq": 128, "min_seq": 1, "max_batch": 4, "batch_name": "", "seq_name": ""}
NAMES = {"b": ("b", "batch", "batch_size"), "n": ("n", "seq", "seq_len", "sequence", "sequence_length")}
_FAILED_OP = re.compile(r"Error converting operator (\w+)")


def _settings(path: str, config: Mapping[str, object] | None) -> dict[str, object]:
    settings = dict(DEFAULTS)
    for key, value in (config or {}).items():
        if key not in DEFAULTS:
            raise UserError(f"unknown config key {key!r} for {path}: valid keys are {', '.join(DEFAULTS)}")
        settings[key] = convert_config_value(key, value, DEFAULTS[key])
    if not 1 <= int(settings["min_seq"]) <= int(settings["max_seq"]) or int(settings["max_batch"]) < 1:
        raise UserError(f"config for {path} is invalid: need 1 <= min_seq <= max_seq and max_batch >= 1")
    return settings


def _dim_names(settings: Mapping[str, object]) -> dict[str, str]:
    """ONNX dim_param → ``b`` / ``n``."""
    names = {alias: dim for dim, aliases in NAMES.items() for alias in aliases}
    if settings["batch_name"]:
        names[str(settings["batch_name"])] = "b"
    if settings["seq_name"]:
        names[str(settings["seq_name"])] = "n"
    return names


def _index_bounds(graph) -> dict[str, int]:
    """Integer inputs gathered from an initializer: their exclusive upper bound (its row count)."""
    rows = {init.name: int(init.dims[0]) for init in graph.initializer if len(init.dims) >= 1}
    bounds: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in rows:
            bounds[node.input[1]] = rows[node.input[0]]
    return bounds


def _input_specs(path: str, model, settings) -> tuple[tuple[TensorSpec, ...], dict[str, str]]:
    import onnx

    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    names = _dim_names(settings)
    gathered = _index_bounds(graph)
    specs, renames = [], {}
    for value in graph.input:
        if value.name in initializers:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
        shape: list[int | str] = []
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value > 0:
                shape.append(int(dim.dim_value))
                continue
            if dim.dim_param not in names:
                raise UserError(
                    f"input {value.name!r} of {path} has dynamic axis {dim.dim_param!r}: name it batch or seq in the "
                    "export, or map it with config batch_name=NAME or seq_name=NAME"
                )
            renames[dim.dim_param] = names[dim.dim_param]
            shape.append(names[dim.dim_param])
        if "float" in dtype:
            specs.append(TensorSpec(value.name, tuple(shape), dtype))
        elif "mask" in value.name:
            specs.append(TensorSpec(value.name, tuple(shape), dtype, "ones"))
        else:
            specs.append(TensorSpec(value.name, tuple(shape), dtype, "index", gathered.get(value.name, 2)))
    return tuple(specs), renames


def _import(path: str, model):
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    from .onnx_fixes import relaxtune_converters

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), relaxtune_converters():  # the importer prints the failing operator
            return from_onnx(model, keep_params_in_input=True, sanitize_input_names=False)
    except tvm.error.OpNotImplemented as err:
        raise UserError(f"cannot import {path}: {str(err).splitlines()[0]}") from err
    except Exception as err:
        match = _FAILED_OP.search(printed.getvalue())
        op = match.group(1) if match else "(unknown)"
        first = (str(err).strip().splitlines() or [""])[-1][:200]
        raise UserError(
            f"cannot import {path}: TVM's ONNX importer failed on operator {op}: {type(err).__name__}: {first}"
        ) from err


def load_onnx(path: str, config: Mapping[str, object] | None = None, dtype: str | None = None) -> Workload:
    """Build the workload of an ``.onnx`` file (see the module docstring)."""
    import tvm
    from tvm import relax, tirx

    if dtype not in (None, "float32"):
        raise UserError(f"dtype {dtype!r} is not supported for imported models: they run in float32")
    if not os.path.isfile(path):
        raise UserError(f"ONNX file {path!r} does not exist")
    try:
        import onnx
    except ImportError:
        raise UserError("ONNX workloads need the onnx package: pip install onnx") from None
    settings = _settings(path, config)
    try:
        model = onnx.load(path)
    except Exception as err:
        raise UserError(f"ONNX file {path!r} cannot be read: {type(err).__name__}") from None
    inputs, renames = _input_specs(path, model, settings)
    mod = _import(path, model)
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    mapping = {}
    for var in relax.analysis.defined_symbolic_vars(main):
        if var.name in renames and var.name != renames[var.name]:
            mapping[var] = tirx.Var(renames[var.name], "int64")
    if mapping:
        mod = relax.transform.BindSymbolicVars(mapping)(mod)
    used = {d for t in inputs for d in t.shape if isinstance(d, str)}
    bounds = {"b": (1, int(settings["max_batch"])), "n": (int(settings["min_seq"]), int(settings["max_seq"]))}
    bounds = {d: b for d, b in bounds.items() if d in used}
    mod = set_bounds(mod, {d: hi for d, (_, hi) in bounds.items()}, {d: lo for d, (lo, _) in bounds.items()})
    params = detached_weights(mod, detached)
    # rank-0 initializers are the exporter's literals (scales, mask fills, True), not weights: bound as
    # constants, so passes can read them (FuseAttention needs the scale and the mask's fill value)
    literals = {k: v for k, v in params.items() if v.ndim == 0}
    if literals:
        mod = relax.transform.BindParams("main", {k: tvm.runtime.tensor(v) for k, v in literals.items()})(mod)
        params = {k: v for k, v in params.items() if k not in literals}
    originals = {init.name.removeprefix("onnx::"): init.name for init in model.graph.initializer}
    dims = bounded_dims(bounds)
    logger.info("imported %s: %d inputs, %d weights, dims %s", path, num_input, len(params), bounds)

    def reference(values: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]) -> np.ndarray:
        """ONNX's reference evaluator on the graph, with ``weights`` as its initializers."""
        from onnx import numpy_helper
        from onnx.reference import ReferenceEvaluator

        graph_model = model
        if weights is not params:
            graph_model = copy.deepcopy(model)
            given = {originals.get(k, k): np.asarray(v) for k, v in weights.items()}
            for init in graph_model.graph.initializer:
                if init.name in given:
                    init.CopyFrom(numpy_helper.from_array(given[init.name], init.name))
        feeds = {t.name: np.asarray(values[t.name]) for t in inputs}
        return np.asarray(ReferenceEvaluator(graph_model).run(None, feeds)[0])

    name = os.path.splitext(os.path.basename(path))[0]
    return Workload(
        name=name,
        mod=mod,
        params=params,
        inputs=inputs,
        dims=dims,
        config={"path": os.path.abspath(path), **settings},
        reference=reference,
    )
