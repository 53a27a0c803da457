"""Shared plumbing for the built-in workloads.

Every built-in is a ``tvm.relax.frontend.nn`` module whose ``forward(x)`` takes one activation
``x`` of shape ``(b, n, hidden)`` with symbolic batch ``b`` and sequence ``n``. This file turns
such a module into a :class:`~relaxtune.workloads.base.Workload`: it exports the module, renames
the exported function to ``main``, attaches the dimension bounds, draws deterministic weights
and wires up the torch reference.

Weights are keyed by the exported parameter names (``self_attn.q_proj.weight``), which are also
the names of ``main``'s weight parameters (``Var.name``; TVMScript prints them with underscores)
and the ``state_dict`` keys of the torch references. ``params`` is ordered like ``main``'s weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..errors import UserError
from .base import Dim, TensorSpec, Workload

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")
REPRESENTATIVE = {"b": 1, "n": 128}


@dataclass(frozen=True)
class Builtin:
    """A registered built-in workload: its config defaults and the function that builds it."""

    name: str
    description: str
    defaults: Mapping[str, object]
    build: Callable[[dict[str, object]], Workload]


def require(ok: bool, message: str) -> None:
    """Raise :class:`UserError` with ``message`` unless ``ok``."""
    if not ok:
        raise UserError(message)


def check_positive(config: Mapping[str, object], *keys: str) -> None:
    """Every named config value must be > 0."""
    for key in keys:
        require(config[key] > 0, f"config {key}={config[key]} is invalid: {key} must be > 0")


def check_dtype(dtype: object) -> None:
    """The dtype must be one of :data:`DTYPES`."""
    require(dtype in DTYPES, f"dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")


def export_main(module, hidden: int, dtype: str, max_batch: int, max_seq: int):
    """Export ``module.forward(x)`` with ``x: (b, n, hidden)`` as a bounded ``main``.

    Returns ``(mod, names)``: the IRModule and the exported (dotted) parameter names in the
    order of ``main``'s weight parameters.
    """
    from tvm.relax.frontend import nn

    spec = {"forward": {"x": nn.spec.Tensor(["b", "n", hidden], dtype)}}
    mod, named = module.export_tvm(spec=spec)
    mod = rename_function(mod, "forward", "main")
    mod = set_bounds(mod, upper={"b": max_batch, "n": max_seq}, lower={"b": 1, "n": 1})
    return mod, [name for name, _ in named]


def rename_function(mod, old: str, new: str):
    """Return a copy of ``mod`` where the function ``old`` is called ``new`` (attrs kept)."""
    import tvm

    functions = {}
    for gvar, func in mod.functions_items():
        if gvar.name_hint == old:
            gvar = tvm.ir.GlobalVar(new)
            func = func.with_attr("global_symbol", new)
        functions[gvar] = func
    return tvm.IRModule(functions, attrs=mod.attrs)


def set_bounds(mod, upper: Mapping[str, int], lower: Mapping[str, int], func: str = "main"):
    """Attach ``tir_var_upper_bound`` / ``tir_var_lower_bound`` to the Relax function ``func``."""
    main = mod[func].with_attr("tir_var_upper_bound", dict(upper))
    main = main.with_attr("tir_var_lower_bound", dict(lower))
    mod = mod.clone()
    mod[func] = main
    return mod


def init_params(mod, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random weights for ``main``'s weight parameters, like a real init.

    2-D weights (linear layers) get ``normal * 0.02``; 1-D ``*weight`` (norm scales) get
    ``1 + normal * 0.02``; biases get ``normal * 0.02`` (non-zero, so the bias path is tested).
    """
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for var in main.params[num_input:]:
        shape = tuple(int(d) for d in var.ty.shape.values)
        dtype = str(var.ty.dtype)
        noise = rng.standard_normal(shape) * 0.02
        if len(shape) == 1 and var.name.endswith("weight"):
            noise = noise + 1.0
        params[var.name] = noise.astype(dtype)
    return params


def bounded_dims(bounds: Mapping[str, tuple[int, int]]) -> dict[str, Dim]:
    """One ``Dim`` per ``name: (lower, upper)``, its representative value clamped to the bounds."""
    return {d: Dim(d, lo, hi, max(lo, min(REPRESENTATIVE.get(d, 128), hi))) for d, (lo, hi) in bounds.items()}


def detached_weights(mod, detached) -> dict[str, np.ndarray]:
    """The weights ``relax.frontend.detach_params`` took out of ``main``, keyed by its weight names."""
    main = mod["main"]
    names = [v.name for v in main.params[int(main.attrs["num_input"]) :]]
    return {n: t.numpy() for n, t in zip(names, detached.get("main", []))}


def seq_dims(max_batch: int, max_seq: int) -> dict[str, Dim]:
    """The ``b`` and ``n`` dimensions, with representative values clamped to their bounds."""
    upper = {"b": max_batch, "n": max_seq}
    return {name: Dim(name, 1, upper[name], max(1, min(REPRESENTATIVE[name], upper[name]))) for name in ("b", "n")}


def load_torch(module, params: Mapping[str, np.ndarray]):
    """Load ``params`` into a torch module whose state_dict keys are the same names.

    The module is converted to float32 and put in eval mode.
    """
    import torch

    state = {}
    for key in module.state_dict():
        if key not in params:
            raise KeyError(f"weight {key!r} missing for the torch reference (have {sorted(params)})")
        state[key] = torch.from_numpy(np.asarray(params[key], dtype=np.float32))
    module.load_state_dict(state)
    return module.float().eval()


def make_workload(
    name: str,
    module,
    config: dict[str, object],
    torch_factory: Callable[[Mapping[str, np.ndarray]], object],
    flops: Callable[[Mapping[str, int]], float],
) -> Workload:
    """Export ``module`` (input ``x: (b, n, hidden)``) and bundle it as a :class:`Workload`.

    ``torch_factory(params)`` must build the equivalent torch module with those weights.
    """
    dtype = str(config["dtype"])
    hidden = int(config["hidden"])
    mod, names = export_main(module, hidden, dtype, int(config["max_batch"]), int(config["max_seq"]))
    params = init_params(mod)
    if names != list(params):
        raise AssertionError(f"exported names {names} do not match main's weights {list(params)}")
    logger.debug("built %s with %d weights, config %s", name, len(params), config)

    def reference(inputs: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]) -> np.ndarray:
        """Run the torch reference in float32; the result has the workload's dtype."""
        import torch

        model = torch_factory(weights)
        with torch.no_grad():
            out = model(torch.from_numpy(np.asarray(inputs["x"], dtype=np.float32)))
        return out.numpy().astype(dtype)

    return Workload(
        name=name,
        mod=mod,
        params=params,
        inputs=(TensorSpec("x", ("b", "n", hidden), dtype),),
        dims=seq_dims(int(config["max_batch"]), int(config["max_seq"])),
        config=dict(config),
        reference=reference,
        torch_module=lambda: torch_factory(params),
        flops=flops,
    )


def convert_config_value(key: str, value: object, default: object) -> object:
    """A config value (a string from the command line, or already typed) as the type of its default; one line naming
    the key, the value and the default where it does not convert."""
    kind = type(default)
    if isinstance(value, kind) and not isinstance(value, bool):
        return value
    if kind is int:
        try:
            if isinstance(value, float) and value.is_integer():
                return int(value)
            return int(str(value).strip())
        except ValueError:
            pass
        raise UserError(f"config {key}={value!r} is not an integer (default {default})")
    if kind is float:
        try:
            return float(str(value).strip())
        except ValueError:
            raise UserError(f"config {key}={value!r} is not a number (default {default})") from None
    return kind(value)
