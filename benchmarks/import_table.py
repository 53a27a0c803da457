"""Which real architectures arrive through the importers, how right and how fast they are.

For each tiny random Hugging Face family (hidden 64, 2 layers, 4 heads, vocab 128) loaded as
``hf:TYPE``, and for the ONNX export (``torch.onnx.export`` with dynamic axes) of two of them:
imported yes/no (the one-line error otherwise), the number of PrimFuncs after relaxtune's fusion
(all shape buckets), the kernels and intermediate bytes of the function serving b = 1, n = 32
with stock and with relaxtune fusion (``relaxtune report fusion``), the max abs error against
torch eager at n = 1, 32 and the bound (b = 1,
after tuning; once with the configured memory planner, once with TVM's), and the latency at
n = 32 after a 16-trial tuning run into a temporary cache (``relaxtune.measure.bench.bench`` with the
systems relaxtune and torch, both on ``--threads`` threads, default 1; for an ONNX row torch runs
the module that was exported). A failed tuning run is
reported in its column and the latency is then that of the rule-based schedules. Prints a
markdown table; ``--json PATH`` writes the rows.

    python benchmarks/import_table.py [--families llama,gpt2] [--no-onnx] [--json build/import_table.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from relaxtune.schedules import intrin

intrin.register_for("llvm")  # before anything imports MetaSchedule

import numpy as np  # noqa: E402

from relaxtune import api, targets  # noqa: E402
from relaxtune.config import CompileConfig, JobConfig, TuneConfig  # noqa: E402
from relaxtune.errors import UserError  # noqa: E402
from relaxtune.measure import bench  # noqa: E402
from relaxtune.reports import fusion as fusion_report  # noqa: E402
from relaxtune.workloads import load  # noqa: E402

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox", "bert")
ONNX_FAMILIES = ("gpt2", "llama")
CONFIG = {"hidden": "64", "layers": "2", "heads": "4", "ffn": "128", "vocab": "128", "max_seq": "128"}
BENCH_N = 32


def max_error(workload, executable) -> float:
    """Max abs error against the workload's reference at n = 1, 32 and the bound (b = 1)."""
    import tvm
    from tvm import relax

    from relaxtune.runtime.artifact import prepare_params

    vm = relax.VirtualMachine(executable, tvm.cpu())
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    worst = 0.0
    for n in sorted({1, BENCH_N, workload.dims["n"].upper}):
        point = {d: (n if d == "n" else 1) for d in workload.dims}
        inputs = workload.random_inputs(point, seed=n)
        out = vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs), *weights).numpy()
        worst = max(worst, float(np.max(np.abs(out.astype("float64") - workload.reference(inputs, workload.params)))))
    return worst


def onnx_workload(family: str, folder: Path):
    """The ONNX export of ``hf:family`` loaded as a workload; its torch baseline is the exported
    module itself (same weights), so the row's relaxtune / torch ratio compares like with like."""
    module = load(f"hf:{family}", CONFIG).torch_module()
    workload = load(onnx_file(module, family, folder), {"max_seq": CONFIG["max_seq"]})
    return dataclasses.replace(workload, torch_module=lambda: module)


def onnx_file(module, family: str, folder: Path) -> str:
    """Export a torch module (hf:family's wrapper) to ONNX with dynamic batch/seq axes."""
    import torch

    ids, mask = torch.randint(0, 128, (2, 7)), torch.ones(2, 7, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    path = folder / f"{family}.onnx"
    try:
        torch.onnx.export(
            module,
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["out"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "out": axes},
        )
    except Exception as err:  # the exporter's own failure is a row of the table, not a crash
        raise UserError(
            f"torch.onnx.export failed: {type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
        ) from err
    return str(path)


def measure(label: str, source: str, make, target, cache: Path, planner: str) -> dict:
    from relaxtune.relax_passes.pipeline import fuse

    row = {"model": label, "source": source, "imported": "no"}
    start = time.perf_counter()
    try:
        workload = make()
    except UserError as err:
        row["imported"] = f"no: {err}"
        return row
    row.update(imported="yes", dims=",".join(sorted(workload.dims)), import_s=round(time.perf_counter() - start, 1))
    job = JobConfig(cache_dir=cache / label, tune=TuneConfig(trials=16), compile=CompileConfig(memory_planner=planner))
    fused = fuse(workload.mod, target.target, api.bucket_plan(workload, job))
    row["primfuncs"] = sum(1 for _, f in fused.functions_items() if f.__class__.__name__ == "PrimFunc")
    point = {d: (BENCH_N if d == "n" else 1) for d in workload.dims}
    kernels = fusion_report.measure(workload, target, point)  # the function serving b=1, n=BENCH_N
    row.update(
        {f"kernels_{f}": kernels[f]["kernels"] for f in kernels},
        **{f"bytes_{f}": kernels[f]["intermediate_bytes"] for f in kernels},
    )
    try:
        result = api.tune(workload, target, job, progress=False)
        row["tuned"] = f"{result.trials_run} trials, {len(result.tasks)} tasks"
    except Exception as err:  # a tuning failure is a finding of the table: bench the rule-based schedules
        logging.warning("tuning %s failed: %s", label, str(err).strip().splitlines()[0][:300])
        row["tuned"] = f"failed: {type(err).__name__}: {str(err).strip().splitlines()[0][:90]}"
        job = job.with_(compile=CompileConfig(use_cache=False, memory_planner=planner))
    row["max_err"] = max_error(workload, api.build(workload, target, job)[0])
    if planner != "tvm":
        tvm_job = job.with_(compile=CompileConfig(use_cache=job.compile.use_cache, memory_planner="tvm"))
        row["max_err_tvm_planner"] = max_error(workload, api.build(workload, target, tvm_job)[0])
    systems = ("relaxtune", "torch") if workload.torch_module is not None else ("relaxtune",)
    for r in bench.bench(workload, target, job, {"n": [BENCH_N]}, systems=systems):
        row[f"{r.system}_ms"] = r.median_ms
    return row


def markdown(rows: list[dict], planner: str) -> str:
    head = [
        "model",
        "source",
        "imported",
        "dims",
        "PrimFuncs after fusion",
        f"kernels n={BENCH_N} stock → relaxtune",
        f"intermediate KB n={BENCH_N} stock → relaxtune",
        "tuning (16 trials)",
        f"max err vs torch ({planner} planner)",
        "max err (tvm planner)",
        f"relaxtune ms n={BENCH_N}",
        f"torch eager ms n={BENCH_N}",
        "relaxtune / torch",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    for r in rows:
        ratio = r["relaxtune_ms"] / r["torch_ms"] if "relaxtune_ms" in r and "torch_ms" in r else None
        kernels = f"{r['kernels_stock']} → {r['kernels_relaxtune']}" if "kernels_stock" in r else "-"
        kbytes = f"{r['bytes_stock'] / 1024:.0f} → {r['bytes_relaxtune'] / 1024:.0f}" if "bytes_stock" in r else "-"
        cells = [
            r["model"],
            r["source"],
            r["imported"].replace("|", "/"),
            r.get("dims", "-"),
            fmt(r.get("primfuncs"), "d"),
            kernels,
            kbytes,
            r.get("tuned", "-").replace("|", "/"),
            fmt(r.get("max_err"), ".1e"),
            fmt(r.get("max_err_tvm_planner", r.get("max_err") if planner == "tvm" else None), ".1e"),
            fmt(r.get("relaxtune_ms"), ".3f"),
            fmt(r.get("torch_ms"), ".3f"),
            fmt(ratio, ".2f") + ("x" if ratio else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated transformers model types")
    parser.add_argument("--no-onnx", action="store_true", help="skip the ONNX exports")
    parser.add_argument("--memory-planner", default=CompileConfig().memory_planner, help="CompileConfig.memory_planner")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads of TVM's runtime and of torch, the same for both (default 1: torch and TVM run in this one "
        "process, and two pools of 2 threads on a shared 2-core box stalled ~256 ms per call)",
    )
    args = parser.parse_args(argv)
    import os

    import torch

    if args.threads < 1:
        parser.error(f"--threads {args.threads}: give 1 or more")
    os.environ["TVM_NUM_THREADS"] = str(
        args.threads
    )  # before TVM's pool starts (relaxtune's import set the core count)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    target = targets.resolve("cpu")
    print(
        f"target: {target.json}; threads: TVM {os.environ['TVM_NUM_THREADS']}, torch {torch.get_num_threads()}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="import_table_") as tmp:
        folder = Path(tmp)
        for family in [f for f in args.families.split(",") if f]:
            rows.append(
                measure(family, "hf", lambda f=family: load(f"hf:{f}", CONFIG), target, folder, args.memory_planner)
            )
            print(json.dumps(rows[-1]), flush=True)
        for family in () if args.no_onnx else ONNX_FAMILIES:
            rows.append(
                measure(family, "onnx", lambda f=family: onnx_workload(f, folder), target, folder, args.memory_planner)
            )
            print(json.dumps(rows[-1]), flush=True)
    print()
    print(markdown(rows, args.memory_planner))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": target.config, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
