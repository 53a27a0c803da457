"""relaxtune report fusion WORKLOAD --shape n=128: kernels and memory traffic, stock vs relaxtune fusion.

Runs the fusion stage twice (`CompileConfig.fusion` "stock": FuseOps only; "relaxtune": its fusion
passes, then FuseOps), then RewriteDataflowReshape, so a reshape that becomes a view is not counted
as a kernel. For every Relax function it lists each kernel, the original operators it holds (read
from the fused functions before FuseTIR: the legalized operator kernels they call) and its outputs;
for the function that serves `--shape` it sums the bytes of every *intermediate* tensor — written by
one kernel and read by another, so it goes through memory — at that shape. `main_transform_params`
runs once at load and is listed apart. `--json PATH` writes
`{"stock": {"kernels": int, "intermediate_bytes": int, ...}, "relaxtune": {...}, "function": ...}`.
"""

from __future__ import annotations

import re

FUSIONS = ("stock", "relaxtune")


def _op_name(kernel_name: str) -> str:
    """`add3` → `add`: the legalized kernel of one operator, without the uniquifying number."""
    return re.sub(r"\d+$", "", kernel_name)


def fused_modules(workload, target, fusion: str):
    """(module right before FuseTIR, module after the fusion stage with reshapes as views)."""
    import tvm
    from tvm import relax

    from .. import api
    from ..config import CompileConfig, JobConfig
    from ..relax_passes.pipeline import fusion_passes
    from ..schedules import intrin

    intrin.register_for(target.kind.name)
    options = CompileConfig(fusion=fusion)
    plan = api.bucket_plan(workload, JobConfig(compile=options))
    passes = fusion_passes(target, plan, options, workload.entries, workload.weights_nk)
    cut = next(i for i, p in enumerate(passes) if p.info.name == "FuseTIR")
    with target:
        before = tvm.transform.Sequential(passes[:cut])(workload.mod)
        after = tvm.transform.Sequential([*passes[cut:], relax.transform.RewriteDataflowReshape()])(before)
    return before, after


def _held_ops(before) -> dict[str, list[str]]:
    """Kernel name → the operators it holds, from the fused Relax functions FuseTIR turns into kernels."""
    import tvm
    from tvm import relax

    held: dict[str, list[str]] = {}
    for gv, func in before.functions_items():
        if isinstance(func, relax.Function) and (func.attrs or {}).get("Primitive"):
            ops = []
            for block in func.body.blocks:
                for binding in block.bindings:
                    value = binding.value
                    if (
                        isinstance(value, relax.Call)
                        and isinstance(value.op, tvm.ir.Op)
                        and value.op.name == "relax.call_tir"
                    ):
                        ops.append(_op_name(value.args[0].name_hint))
            held[gv.name_hint] = ops
    return held


def _bytes(ty, values: dict[str, int]) -> int:
    """Bytes of a tensor (or tuple of tensors) type with the symbolic dims at `values`."""
    import tvm
    from tvm import relax, tirx
    from tvm.sym import Analyzer
    from tvm.tirx.analysis import undefined_vars

    if isinstance(ty, relax.TupleType):
        return sum(_bytes(field, values) for field in ty.fields)
    analyzer = Analyzer()
    count = 1
    for dim in ty.shape.values:
        for var in undefined_vars(dim):
            if var.name in values:
                analyzer.bind(var, tirx.const(values[var.name], str(var.ty.dtype)))
        count *= int(analyzer.simplify(dim))
    return count * tvm.DataType(str(ty.dtype)).bits // 8


def _shape(ty) -> str:
    from tvm import relax, tirx

    if isinstance(ty, relax.TupleType):
        return ", ".join(_shape(field) for field in ty.fields)
    dims = [str(int(d)) if isinstance(d, tirx.IntImm) else str(d) for d in ty.shape.values]
    return f"({', '.join(dims)}) {ty.dtype}"


def kernels_of(func, held: dict[str, list[str]], values: dict[str, int] | None) -> list[dict]:
    """One entry per kernel call of `func`: name, held ops, output type, and whether (and how many
    bytes at `values`) its output is an intermediate: read by another kernel, directly or via a view."""
    import tvm
    from tvm import relax

    def is_call(value, *names) -> bool:
        return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in names

    calls, kernel_reads, aliases = [], set(), {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if is_call(value, "relax.call_tir"):
                calls.append((binding.var, value.args[0].name_hint))
                kernel_reads |= set(relax.analysis.free_vars(value.args[1]))
            elif (
                isinstance(value, relax.TupleGetItem)
                or isinstance(value, relax.Var)
                or is_call(value, "relax.reshape", "relax.memory.view")
            ):
                source = (
                    value.tuple_value
                    if isinstance(value, relax.TupleGetItem)
                    else (value if isinstance(value, relax.Var) else value.args[0])
                )
                aliases.setdefault(source, []).append(binding.var)

    def intermediate(var) -> bool:
        return var in kernel_reads or any(intermediate(alias) for alias in aliases.get(var, []))

    rows = []
    for var, name in calls:
        used = intermediate(var)
        rows.append(
            {
                "kernel": name,
                "ops": held.get(name, [_op_name(name)]),
                "output": _shape(var.ty),
                "intermediate": used,
                "bytes": _bytes(var.ty, values) if (values is not None and used) else 0,
            }
        )
    return rows


def measure(workload, target, values: dict[str, int]) -> dict:
    """Per fusion: the serving function's kernel count and intermediate bytes, and the kernel lists."""
    from tvm import tirx

    from ..relax_passes.fusion_utils import FUSED_OPS_ATTR
    from .memory import bucket_function

    result: dict = {}
    for fusion in FUSIONS:
        before, after = fused_modules(workload, target.target, fusion)
        held = _held_ops(before)
        for gv, func in after.functions_items():  # kernels a relaxtune pass wrote whole
            if isinstance(func, tirx.PrimFunc) and (func.attrs or {}).get(FUSED_OPS_ATTR):
                held[gv.name_hint] = [str(op) for op in func.attrs[FUSED_OPS_ATTR]]
        serving = bucket_function(after, values)
        functions = {}
        for name in (serving, "main", "main_transform_params"):
            if name in [gv.name_hint for gv in after.get_global_vars()] and name not in functions:
                functions[name] = kernels_of(after[name], held, values if name == serving else None)
        rows = functions.get(serving, [])
        result[fusion] = {
            "function": serving,
            "kernels": len(rows),
            "intermediate_bytes": sum(r["bytes"] for r in rows),
            "load_time_kernels": len(functions.get("main_transform_params", [])),
            "functions": functions,
        }
    return result


def markdown(workload_name: str, values: dict[str, int], result: dict) -> str:
    shape = " ".join(f"{k}={v}" for k, v in values.items())
    lines = [
        f"# Fusion: {workload_name} at {shape}",
        "",
        "| fusion | kernels per call | intermediate bytes | load-time kernels |",
        "|---|---|---|---|",
    ]
    for fusion in FUSIONS:
        r = result[fusion]
        lines.append(f"| {fusion} | {r['kernels']} | {r['intermediate_bytes']:,} | {r['load_time_kernels']} |")
    for fusion in FUSIONS:
        for name, rows in result[fusion]["functions"].items():
            if not rows:
                continue
            at = f" (bytes at {shape})" if name == result[fusion]["function"] else ""
            lines += [
                "",
                f"## {fusion}: {name}{at}",
                "",
                "| kernel | holds | output | intermediate bytes |",
                "|---|---|---|---|",
            ]
            for r in rows:
                size = f"{r['bytes']:,}" if r["intermediate"] and at else ("yes" if r["intermediate"] else "-")
                lines.append(f"| {r['kernel']} | {' + '.join(r['ops'])} | {r['output']} | {size} |")
    return "\n".join(lines) + "\n"
