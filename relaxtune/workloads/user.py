"""Workloads from a user's Python file.

The file is imported from its path with importlib (so TVMScript can read its source) and must
define either

* ``workload()`` returning a :class:`~relaxtune.workloads.base.Workload` (config items are passed
  as keyword arguments with string values, and ``dtype=`` when given and accepted), or
* a module-level ``mod``: a Relax ``tvm.IRModule`` with a ``main`` function. Its symbolic
  dimensions need ``tir_var_upper_bound`` (``tir_var_lower_bound`` is optional, default 0: an
  empty dimension, such as the cache of a first decode step, is a value like any other).
  Every parameter of ``main`` becomes an input (``num_input`` is set to their count), the
  weights dict is empty, each dimension's representative value is ``min(128, upper)``
  (at least ``lower`` and 1).

A workload without a reference of its own gets stock TVM's build of its un-transformed module
(`tvm.compile` with TVM's default pipeline: naive loop nests, slow, and independent of relaxtune).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import logging
import os
import sys
from typing import Mapping

import numpy as np

from ..errors import UserError
from .base import Dim, TensorSpec, Workload
from .common import check_dtype

logger = logging.getLogger(__name__)

REPRESENTATIVE = 128


def import_file(path: str):
    """Import the Python file at ``path`` as a fresh module (registered in ``sys.modules``)."""
    if not os.path.isfile(path):
        raise UserError(f"user workload file {path!r} does not exist: give a built-in name or a path to a .py file")
    path = os.path.abspath(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"relaxtune_user_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"user workload file {path!r} cannot be imported: it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # TVMScript and dataclasses look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's code failed: report it as one line
        sys.modules.pop(name, None)
        raise UserError(f"user workload file {path!r} failed to import: {type(err).__name__}: {err}") from err
    return module


def load_user(path: str, config: Mapping[str, str] | None = None, dtype: str | None = None) -> Workload:
    """Load the workload defined by the user file at ``path`` (see the module docstring)."""
    module = import_file(path)
    name = os.path.splitext(os.path.basename(path))[0]
    config = dict(config or {})
    if dtype is not None:
        check_dtype(dtype)
    if callable(getattr(module, "workload", None)):
        workload = _call_workload(module.workload, path, config, dtype)
    elif hasattr(module, "mod"):
        if config:
            raise UserError(
                f"config key {next(iter(config))!r} is not accepted by {path!r}: a file defining "
                "`mod` takes no config (define workload(**config) instead)"
            )
        workload = workload_from_mod(module.mod, name)
    else:
        raise UserError(
            f"user workload file {path!r} defines neither workload() nor a module-level `mod` "
            "(a Relax IRModule with a `main` function)"
        )
    if workload.reference is None:
        workload = dataclasses.replace(workload, reference=stock_reference(workload))
    if dtype is not None:
        wrong = [t for t in workload.inputs if t.dtype.startswith("float") and t.dtype != dtype]
        if wrong:
            raise UserError(
                f"dtype {dtype!r} does not match {path!r}: its input {wrong[0].name!r} is "
                f"{wrong[0].dtype} (a user file fixes its own dtypes; drop the dtype option)"
            )
    return workload


def _call_workload(func, path: str, config: dict[str, str], dtype: str | None) -> Workload:
    kwargs: dict[str, object] = dict(config)
    params = inspect.signature(func).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if dtype is not None and (takes_any or "dtype" in params):
        kwargs["dtype"] = dtype
    for key in kwargs:
        if not takes_any and key not in params:
            raise UserError(
                f"config key {key!r} is not accepted by workload() in {path!r}: "
                f"its arguments are {', '.join(params) or '(none)'}"
            )
    result = func(**kwargs)
    if not isinstance(result, Workload):
        raise UserError(f"workload() in {path!r} returned {type(result).__name__}, expected a relaxtune Workload")
    return result


def workload_from_mod(mod, name: str) -> Workload:
    """Wrap a Relax IRModule whose ``main`` has bounded symbolic dims as a :class:`Workload`."""
    import tvm
    from tvm import relax

    if not isinstance(mod, tvm.IRModule):
        raise UserError(f"`mod` in user workload {name!r} is a {type(mod).__name__}, expected a tvm.IRModule")
    names = [gv.name_hint for gv in mod.get_global_vars()]
    if "main" not in names or not isinstance(mod["main"], relax.Function):
        raise UserError(f"`mod` in user workload {name!r} has no Relax function `main` (it has {sorted(names)})")
    main = mod["main"]
    attrs = main.attrs or {}
    upper = {str(k): int(v) for k, v in dict(attrs.get("tir_var_upper_bound", {}) or {}).items()}
    lower = {str(k): int(v) for k, v in dict(attrs.get("tir_var_lower_bound", {}) or {}).items()}

    inputs, dims = [], {}
    for var in main.params:
        ty = var.ty
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            raise UserError(f"parameter {var.name!r} of main in {name!r} must be a tensor with a known shape")
        shape: list[int | str] = []
        for dim in ty.shape.values:
            if isinstance(dim, tvm.tirx.IntImm):
                shape.append(int(dim))
            elif isinstance(dim, tvm.tirx.Var):
                shape.append(_dim(dim.name, name, upper, lower, dims))
            else:
                raise UserError(
                    f"parameter {var.name!r} of main in {name!r} has shape entry {dim}: only "
                    "integers and plain symbolic variables are supported"
                )
        inputs.append(TensorSpec(var.name, tuple(shape), str(ty.dtype)))

    mod = mod.clone()
    mod["main"] = main.with_attr("num_input", len(main.params))
    logger.debug("user workload %s: inputs %s, dims %s", name, inputs, dims)
    return Workload(name=name, mod=mod, params={}, inputs=tuple(inputs), dims=dims)


def _dim(var: str, name: str, upper: dict[str, int], lower: dict[str, int], dims: dict[str, Dim]) -> str:
    if var not in dims:
        if var not in upper:
            raise UserError(
                f"symbolic dimension {var!r} of main in {name!r} has no upper bound: add "
                f'R.func_attr({{"tir_var_upper_bound": {{"{var}": N}}}})'
            )
        low, high = lower.get(var, 0), upper[var]
        if not 0 <= low <= high or high < 1:
            raise UserError(
                f"dimension {var!r} in {name!r} has bounds [{low}, {high}]: need 0 <= lower <= upper, upper >= 1"
            )
        dims[var] = Dim(var, low, high, max(low, 1, min(REPRESENTATIVE, high)))
    return var


def stock_reference(workload: Workload):
    """`reference(inputs, params)` by stock TVM: the un-transformed module built with `tvm.compile`'s
    default pipeline for the host CPU (built once, on first use)."""
    built = {}

    def reference(inputs, params):
        import tvm
        from tvm import relax

        if "vm" not in built:
            built["vm"] = relax.VirtualMachine(tvm.compile(workload.mod, target=tvm.target.Target("llvm")), tvm.cpu())
        args = [inputs[t.name] for t in workload.inputs] + list(params.values())
        out = built["vm"]["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args])
        if not hasattr(out, "numpy"):
            raise UserError(f"main of {workload.name} returns {type(out).__name__}: a reference compares one tensor")
        return out.numpy()

    return reference
