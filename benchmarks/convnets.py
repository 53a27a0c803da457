"""Convolutional nets on the CPU: relaxtune against torch eager, torch.compile and ONNX Runtime,
interleaved in one process, plus the kernels and layout transforms each fusion leaves.

    python benchmarks/convnets.py [--models resnet50,mobilenet_v3_large] [--batch 1,8] [--threads 2]
                                  [--cache DIR] [--rounds 7] [--json PATH]

For each ``torchvision:MODEL`` (random weights) and batch size: relaxtune built with the cache
(``--cache``; rules only without it) at buckets ``b = 1 | 2..8 | 9..16``; torch eager;
``torch.compile(dynamic=True)``; ONNX Runtime (``relaxtune/measure/onnxruntime_baseline.py``: the module
through ``torch.onnx.export``, CPU execution provider, ``ORT_ENABLE_ALL``). Every system runs on
``--threads`` threads (TVM_NUM_THREADS, torch.set_num_threads, ORT's intra-op threads); pin the
process to as many cores (``taskset -c 0,1``) for a two-core figure on a larger machine. Each
round samples every system for about ``--sample-s`` seconds in turn, so load on a shared machine
hits them alike; the table gives the median of the rounds and relaxtune's ratios to ONNX Runtime
and torch.compile. relaxtune's output is checked against torch first (max error relative to the
largest logit).

Kernel counts per call and the layout transforms left on activations (``transpose`` /
``layout_transform`` kernels) come from the fused module of the bucket serving each batch, for
stock fusion (FuseOps on the NCHW import) and relaxtune's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,mobilenet_v3_large")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None, help="tuning cache (default: rules only)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sample-s", type=float, default=0.3)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def kernels(workload, target, job, batch: int) -> dict[str, dict[str, int]]:
    """Kernels per call and activation layout transforms in the bucket of ``batch``, per fusion."""
    import tvm
    from tvm import relax

    from relaxtune.compiler.build import bucket_plan
    from relaxtune.config import CompileConfig
    from relaxtune.relax_passes.pipeline import fuse

    out = {}
    plan = bucket_plan(workload, job)
    for fusion in ("stock", "relaxtune"):
        fused = fuse(workload.mod, target.target, plan, CompileConfig(fusion=fusion))
        name = next(
            gv.name_hint
            for gv, f in fused.functions_items()
            if isinstance(f, relax.Function)
            and f.attrs
            and "relaxtune.bucket" in f.attrs
            and all(
                lo <= batch <= hi for lo, hi, _ in [[int(v) for v in s] for s in f.attrs["relaxtune.bucket"].values()]
            )
        )
        calls: list[str] = []

        def visit(expr, calls=calls):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_tir":
                calls.append(expr.args[0].name_hint)

        relax.analysis.post_order_visit(fused[name].body, visit)
        out[fusion] = {
            "kernels": len(calls),
            "layout_transforms": sum(c.startswith(("transpose", "layout_transform")) for c in calls),
        }
    return out


def main() -> None:
    args = _parse()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: its idle threads must not spin against TVM's
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import torch
    import tvm

    from relaxtune import targets, threads
    from relaxtune.compiler.build import build
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.measure import onnxruntime_baseline
    from relaxtune.measure.timing import interleaved
    from relaxtune.measure.vm import VMRunner
    from relaxtune.workloads import load

    threads.configure()
    torch.set_num_threads(args.threads)
    target = targets.resolve("cpu")
    job = JobConfig(
        cache_dir=args.cache or Path("tuning_logs"),
        buckets=BucketConfig(edges={"b": (1, 8, 16)}),
        compile=CompileConfig(use_cache=args.cache is not None),
    )
    batches = [int(b) for b in args.batch.split(",")]
    results = []
    print(f"target {target.json}; {args.threads} threads; {'cache ' + str(args.cache) if args.cache else 'rules only'}")
    for model in args.models.split(","):
        workload = load(f"torchvision:{model}", {"image": str(args.image)})
        start = time.perf_counter()
        executable = build(workload, target, job)[0]
        build_s = time.perf_counter() - start
        session = onnxruntime_baseline.session(workload, threads=args.threads)
        eager = workload.torch_module().eval()
        compiled = torch.compile(eager, dynamic=True)
        for batch in batches:
            inputs = workload.random_inputs({"b": batch}, seed=batch)
            runner = VMRunner.for_workload(executable, tvm.cpu(), workload)
            call, output = runner.caller(inputs), functools.partial(runner.outputs, inputs)
            expected = workload.reference(inputs, workload.params)
            error = float(np.abs(output() - expected).max() / max(1.0, float(np.abs(expected).max())))
            x = torch.from_numpy(inputs["x"])

            def run_torch(module=eager, x=x):
                with torch.no_grad():
                    return module(x)

            systems = {
                "relaxtune": call,
                "onnxruntime": onnxruntime_baseline.runner(session, workload, inputs)[0],
                "torch.compile": functools.partial(run_torch, compiled),
                "torch": run_torch,
            }
            for fn in systems.values():  # warm-up (torch.compile compiles here)
                fn()
            medians = interleaved(systems, args.rounds, args.sample_s)
            row = {
                "model": model,
                "batch": batch,
                "ms": medians,
                "max_error": error,
                "build_s": round(build_s, 1),
                "relaxtune/onnxruntime": medians["relaxtune"] / medians["onnxruntime"],
                "relaxtune/torch.compile": medians["relaxtune"] / medians["torch.compile"],
                "kernels": kernels(workload, target, job, batch),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    head = [
        "model",
        "b",
        "relaxtune ms",
        "onnxruntime ms",
        "torch.compile ms",
        "torch ms",
        "rt/ort",
        "rt/compile",
        "kernels stock -> relaxtune",
        "layout transforms stock -> relaxtune",
        "max err",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        ms, k = r["ms"], r["kernels"]
        cells = [
            r["model"],
            str(r["batch"]),
            *(f"{ms[s]:.2f}" for s in ("relaxtune", "onnxruntime", "torch.compile", "torch")),
            f"{r['relaxtune/onnxruntime']:.2f}",
            f"{r['relaxtune/torch.compile']:.2f}",
            f"{k['stock']['kernels']} -> {k['relaxtune']['kernels']}",
            f"{k['stock']['layout_transforms']} -> {k['relaxtune']['layout_transforms']}",
            f"{r['max_error']:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": target.config, "threads": args.threads, "rows": results}, indent=1))
    print(
        f"medians of {args.rounds} interleaved rounds; "
        f"{statistics.mean([r['build_s'] for r in results]):.0f} s per relaxtune build"
    )


if __name__ == "__main__":
    main()
