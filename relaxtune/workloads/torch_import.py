"""Workloads from PyTorch modules: ``torch.export`` with dynamic dims, then TVM's importer.

:func:`from_module` is the core, used by every torch source (:mod:`.torch_spec`'s
``torch:package.module:Factory``, :mod:`.hf_import`, :mod:`.torchvision_import`). It exports
``module`` with one ``torch.export.Dim`` per symbolic name in the inputs' shapes (``b`` batch,
``n`` sequence), imports the program with ``tvm.relax.frontend.torch`` (weights kept as inputs,
then detached with ``relax.frontend.detach_params``), renames torch's symbolic variables
(``s43``) to the names of the inputs' shapes so that ``--shape n=...`` works, and keeps the
importer's ``tir_var_lower_bound`` / ``tir_var_upper_bound`` (the Dim bounds) under those names.
The reference is the torch module itself; ``params`` are keyed by ``main``'s weight names
(``p_fc1_weight``) and loaded back into a copy of the module when other weights are given.

What ``torch.export`` rejects is an :class:`ExportError`; what TVM's importer cannot translate
is reported as a :class:`~relaxtune.errors.UserError` naming the operator. Must run before:
nothing; in a new process call ``relaxtune.schedules.intrin.register_for`` before anything
imports MetaSchedule.
"""

from __future__ import annotations

import copy
import logging
from typing import Mapping

import numpy as np

from ..errors import UserError
from ..relax_passes.unmerge_leading_dims import UnmergeLeadingDims
from .base import TensorSpec, Workload
from .common import bounded_dims, detached_weights

logger = logging.getLogger(__name__)


class ExportError(UserError):
    """``torch.export`` (or its decomposition) rejected the dynamic shapes."""


def first_line(err: BaseException) -> str:
    """`err` as one short line (torch's and TVM's messages are long): its type and first line."""
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
        raise ExportError(f"torch.export of {name} with dynamic {', '.join(bounds)} failed: {first_line(err)}") from err


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
                    f"cannot import {name}: TVM's PyTorch importer failed on operator {op}: {first_line(err)}"
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
