"""relaxtune report memory WORKLOAD --shape n=512: the activation memory plan at one shape.

Builds the workload up to explicit allocations (fusion, rule-based schedules, CallTIRRewrite; no
tuning cache), picks the bucket function that serves the shape, plans it with relaxtune's
PlanMemory and with TVM's StaticPlanBlockMemory, checks both plans with the verifier, and prints
per tensor its lifetime (binding indices), size and offset, then four peaks in use at this shape:

- no reuse: every intermediate tensor in its own allocation;
- tvm: StaticPlanBlockMemory's storages, each from its first to its last tensor's use, counted up to
  the furthest byte its tensors reach at this shape;
- relaxtune: the arena, up to the furthest byte in use at this shape;
- lower bound: the largest total size of tensors live at one binding (in-place reuse can go below).

and the bytes each planner allocates (both size storage for the bucket's upper bounds; pages past
the bytes in use are never touched on a CPU). Writes markdown and a PNG of the plan (binding on x,
address on y) to --out, and --json PATH with `peak_bytes` and `allocated_bytes`.
"""

from __future__ import annotations

from pathlib import Path


def explicit_allocations(workload, target):
    """The workload's module right before memory planning (rule-based schedules only)."""
    import tvm

    from .. import api
    from ..config import JobConfig
    from ..relax_passes.pipeline import explicit_allocation_passes, fusion_passes
    from ..schedules import intrin
    from ..schedules.rules import rule_schedules

    intrin.register_for(target.kind.name)
    plan = api.bucket_plan(workload, JobConfig())
    with target:
        return tvm.transform.Sequential(
            [*fusion_passes(target, plan), rule_schedules(target), *explicit_allocation_passes()]
        )(workload.mod)


def bucket_function(mod, values: dict[str, int]) -> str:
    """The name of the function that serves these shapes (a bucket copy of main, or main)."""
    from tvm import relax

    from ..ir_attrs import BUCKET_ATTR

    for gv, func in mod.functions_items():
        ranges = (func.attrs or {}).get(BUCKET_ATTR) if isinstance(func, relax.Function) else None
        if ranges and all(int(r[0]) <= values[d] <= int(r[1]) for d, r in ranges.items() if d in values):
            return gv.name_hint
    return "main"


def storage_peak(func, values: dict[str, int], mod, in_use: bool) -> int:
    """The largest total of storages live at one binding (a storage lives from its first to its last
    tensor's use), counting each at its size (allocated) or at the furthest byte its tensors reach (in use)."""
    from ..relax_passes.verify_memory_plan import placements

    layout = placements(func, values, mod)
    spans: dict = {}  # storage var -> [first, last, furthest byte]
    for t in layout.tensors:
        span = spans.setdefault(t.storage_var, [t.first, t.last, 0])
        span[0], span[1], span[2] = min(span[0], t.first), max(span[1], t.last), max(span[2], t.end)
    size = {s: (span[2] if in_use else layout.storages[s]) for s, span in spans.items()}
    points = {p for span in spans.values() for p in span[:2]}
    return max((sum(size[s] for s, (a, b, _) in spans.items() if a <= p <= b) for p in points), default=0)


def measure(workload, target, values: dict[str, int]) -> dict:
    """The plan and the four peaks of the function that serves `values`."""
    from tvm import relax

    from ..relax_passes.plan_memory import PlanMemory, plan_function
    from ..relax_passes.verify_memory_plan import verify

    mod = explicit_allocations(workload, target.target)
    name = bucket_function(mod, values)
    with target.target:
        ours, theirs = PlanMemory()(mod), relax.transform.StaticPlanBlockMemory()(mod)
    plan = plan_function(mod[name], mod, name)
    if plan is None:
        zero = dict.fromkeys(("no_reuse", "tvm", "relaxtune", "lower_bound"), 0)
        return {
            "function": name,
            "tensors": [],
            "peak_bytes": zero,
            "allocated_bytes": {"tvm": 0, "relaxtune": 0},
            "problems": [],
        }
    at = plan.at(values)
    problems = [f"relaxtune: {p}" for p in verify(ours[name], values, mod)] + [
        f"tvm: {p}" for p in verify(theirs[name], values, mod)
    ]
    slots = [t.slot for t in plan.tensors]
    writer = _writers(mod[name])
    tensors = [
        {"name": n, "kernel": writer.get(plan.tensors[i].var, "-"), "first": s, "last": e, "bytes": size, "offset": off}
        | {"shares_with": [plan.tensors[k].name for k in range(len(slots)) if slots[k] == slot and k != i]}
        for i, ((n, s, e, size, off), slot) in enumerate(zip(at["tensors"], slots))
    ]
    peaks = {
        "no_reuse": at["no_reuse"],
        "tvm": storage_peak(theirs[name], values, mod, True),
        "relaxtune": storage_peak(ours[name], values, mod, True),
    }
    allocated = {
        "tvm": storage_peak(theirs[name], values, mod, False),
        "relaxtune": storage_peak(ours[name], values, mod, False),
    }
    return {
        "function": name,
        "tensors": tensors,
        "peak_bytes": {**peaks, "lower_bound": at["lower_bound"]},
        "allocated_bytes": allocated,
        "problems": problems,
    }


def _writers(func) -> dict:
    """tensor (allocation var) -> the name of the kernel that first takes it as an argument (its writer)."""
    import tvm
    from tvm import relax

    found: dict = {}  # keyed by the Var: names may repeat in a function
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
                for arg in value.args:
                    if isinstance(arg, relax.Var):
                        found.setdefault(arg, value.op.name_hint)
    return found


def markdown(workload_name: str, values: dict[str, int], result: dict) -> str:
    shape = " ".join(f"{k}={v}" for k, v in values.items())
    lines = [
        f"# Memory plan: {workload_name} at {shape} ({result['function']})",
        "",
        "| tensor | written by | live (bindings) | bytes | offset | shares bytes with |",
        "|---|---|---|---|---|---|",
    ]
    for t in result["tensors"]:
        lines.append(
            f"| {t['name']} | {t['kernel']} | {t['first']}..{t['last']} | {t['bytes']:,} | {t['offset']:,} | "
            f"{', '.join(t['shares_with']) or '-'} |"
        )
    peaks, allocated = result["peak_bytes"], result["allocated_bytes"]
    lower = max(1, peaks["lower_bound"])
    lines += ["", "| plan | peak bytes in use at this shape | x lower bound | bytes allocated |", "|---|---|---|---|"]
    labels = {
        "no_reuse": "no reuse",
        "tvm": "TVM StaticPlanBlockMemory",
        "relaxtune": "relaxtune PlanMemory",
        "lower_bound": "lower bound (live at one binding)",
    }
    for key, label in labels.items():
        lines.append(
            f"| {label} | {peaks[key]:,} | {peaks[key] / lower:.3f} | "
            f"{format(allocated[key], ',') if key in allocated else '-'} |"
        )
    lines += [
        "",
        "verifier: "
        + (
            "no overlap between live tensors, in both plans"
            if not result["problems"]
            else "; ".join(result["problems"])
        ),
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    mib = 1 << 20
    fig, ax = plt.subplots(figsize=(9, 5))
    colors = plt.get_cmap("tab20")
    for i, t in enumerate(result["tensors"]):
        rect = Rectangle(
            (t["first"], t["offset"] / mib),
            t["last"] - t["first"] + 1,
            t["bytes"] / mib,
            alpha=0.75,
            color=colors(i % 20),
            ec="black",
            lw=0.5,
        )
        ax.add_patch(rect)
        if t["bytes"] >= 0.04 * max(1, result["peak_bytes"]["relaxtune"]):
            ax.text(t["first"] + 0.2, (t["offset"] + t["bytes"] / 2) / mib, t["name"], fontsize=7, va="center")
    last = max((t["last"] for t in result["tensors"]), default=0) + 1
    peaks = result["peak_bytes"]
    top = max(peaks["relaxtune"], peaks["lower_bound"]) / mib * 1.3 or 1.0
    for key, style in (("relaxtune", "-"), ("lower_bound", ":"), ("tvm", "--"), ("no_reuse", "-.")):
        shown = "" if peaks[key] / mib <= top else " (above the plot)"
        ax.axhline(
            peaks[key] / mib, ls=style, color="black", lw=1, label=f"{key} in use: {peaks[key] / mib:.2f} MiB{shown}"
        )
    allocated = result["allocated_bytes"]
    ax.plot(
        [],
        [],
        " ",
        label=f"allocated: relaxtune {allocated['relaxtune'] / mib:.2f} MiB, tvm {allocated['tvm'] / mib:.2f} MiB",
    )
    ax.set_xlim(0, last)
    ax.set_ylim(0, top)
    ax.set_xlabel("binding (program point)")
    ax.set_ylabel("address in the arena (MiB)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
