"""relaxtune's own weight-only quantization of a workload (`--quantize q4f32 | q8f32 | q4f16`): every
projection weight becomes 4- or 8-bit groups (`kernels/quant_formats.py`) that one kernel dequantizes as
it multiplies (`kernels/quant_tir.linear`).

A projection is ``matmul(x, permute_dims(W))`` (W (out, in), `nn.Linear`'s form) or ``matmul(x, W)``
(W (in, out)) in the workload's entry function, W one of its weights (after ``num_input``) with a
multiple of the group size as input features and no other use. Each such W is replaced, in the
signature and in `params`, by its parts (``<name>.qweight``, ``<name>.scale``), and each matmul by a
call of the quantized kernel. The reference and the torch module run on the weights dequantized again,
so `relaxtune compile`'s check and `relaxtune bench` compare the kernels against the same values.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..config import QuantizeConfig
from ..errors import UserError
from ..kernels import quant_formats, quant_tir
from .base import Workload

logger = logging.getLogger(__name__)


def _is_op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _projections(func: relax.Function, weights: set) -> dict:
    """{weight var: transposed?} for weights read only as a matmul's right operand (see module docstring)."""
    bound, uses, found = {}, {}, {}

    def visit(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    for block in func.body.blocks:
        for binding in block.bindings:
            bound[binding.var] = binding.value
    for value in bound.values():
        if not _is_op(value, "relax.matmul"):
            continue
        rhs = value.args[1]
        pd = bound.get(rhs)
        if _is_op(pd, "relax.permute_dims") and pd.args[0] in weights and uses.get(rhs) == 1:
            found.setdefault(pd.args[0], []).append(False)  # W (out, in), read transposed
        elif rhs in weights:
            found.setdefault(rhs, []).append(True)  # W (in, out)
    return {w: kinds[0] for w, kinds in found.items() if len(set(kinds)) == 1 and uses.get(w) == len(kinds)}


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, fmt, chosen: dict, parts: dict):
        super().__init__(mod)
        self.fmt, self.chosen, self.parts = fmt, chosen, parts
        self.bound: dict = {}

    def visit_var_binding_(self, binding):
        self.bound[binding.var] = binding.value
        super().visit_var_binding_(binding)

    def visit_call_(self, call):
        if _is_op(call, "relax.matmul"):
            rhs = call.args[1]
            pd = self.bound.get(rhs)
            weight = pd.args[0] if _is_op(pd, "relax.permute_dims") else rhs
            if weight in self.chosen:
                x = self.visit_expr(call.args[0])
                fmt, count = self.fmt, len(self.fmt.part_names)
                dtype = str(call.ty.dtype)

                def compute(x, *parts):
                    return quant_tir.linear(fmt, x, dict(zip(fmt.part_names, parts[:count])), out_dtype=dtype)

                return self.builder_.emit_te(compute, x, *self.parts[weight], primfunc_name_hint="dequantize_linear")
        return super().visit_call_(call)


def quantize_workload(workload: Workload, quantize: QuantizeConfig) -> Workload:
    """`workload` with its projections in relaxtune's `quantize` format (see the module docstring)."""
    fmt = quant_formats.own_format(quantize.bits, quantize.group_size)
    if len(workload.entries) != 1:
        raise UserError(f"--quantize {quantize.mode} quantizes one-function workloads; {workload.name} has several")
    entry = workload.entries[0]
    func = workload.mod[entry]
    num_input = int(func.attrs["num_input"])
    names = list(workload.params)
    weight_vars = dict(zip(func.params[num_input:], names))
    chosen = {}
    for var, transposed in _projections(func, set(weight_vars)).items():
        value = workload.params[weight_vars[var]]
        if value.ndim == 2 and value.shape[0 if transposed else 1] % fmt.group == 0:
            chosen[var] = transposed
    if not chosen:
        raise UserError(
            f"--quantize {quantize.mode}: {workload.name} has no projection with a multiple of {fmt.group} "
            "input features to quantize"
        )
    params, new_params, parts_of, originals = {}, [], {}, {}
    for var, name in weight_vars.items():
        if var not in chosen:
            params[name] = workload.params[name]
            new_params.append(var)
            continue
        value = workload.params[name].astype(np.float32)
        parts = quant_formats.quantize(fmt, value.T if chosen[var] else value)
        originals[name] = (chosen[var], workload.params[name].dtype)
        parts_of[var] = []
        for part, array in parts.items():
            params[f"{name}.{part}"] = array
            pvar = relax.Var(f"{var.name}_{part}", relax.TensorType(array.shape, str(array.dtype)))
            parts_of[var].append(pvar)
            new_params.append(pvar)
    rewriter = _Rewriter(workload.mod, fmt, chosen, parts_of)
    body = rewriter.visit_expr(func.body)
    new_func = relax.Function(list(func.params[:num_input]) + new_params, body, func.ret_ty, func.is_pure, func.attrs)
    mod = rewriter.builder_.get()  # the module with the quantized kernels the rewriter emitted
    mod[entry] = new_func
    mod = relax.transform.DeadCodeElimination()(mod)
    logger.info("%s: %d of %d weights quantized to %s", workload.name, len(chosen), len(names), fmt.name)

    def dequantized(weights):
        out = {k: v for k, v in weights.items() if k.rsplit(".", 1)[0] not in originals}
        for name, (transposed, dtype) in originals.items():
            value = quant_formats.dequantize(fmt, {p: weights[f"{name}.{p}"] for p in fmt.part_names})
            out[name] = (value.T if transposed else value).astype(dtype)
        return {k: out[k] for k in names}

    reference = workload.reference
    torch_module = workload.torch_module
    return dataclasses.replace(
        workload,
        mod=mod,
        params=params,
        config={**workload.config, "quantize": quantize.mode, "group_size": quantize.group_size},
        reference=None if reference is None else lambda inputs, weights: reference(inputs, dequantized(weights)),
        torch_module=None if torch_module is None else lambda: _with_weights(torch_module(), dequantized(params)),
    )


def _with_weights(module, weights: dict[str, np.ndarray]):
    import torch

    module.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}, strict=False)
    return module
