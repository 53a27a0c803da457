"""Per-kernel times of a torchvision model: relaxtune's kernels against ONNX Runtime's nodes, each
with its GFLOP/s, and the whole call on 1 and N threads for both.

    python benchmarks/convnet_kernels.py resnet50 [--batch 1,8] [--threads 2] [--cache DIR] [--json PATH]

relaxtune: rules only (or ``--cache``), the bucket of each batch; each kernel call of one ``main``
call re-run on its own arguments for about 20 ms after a warm-up call (a VM instrument), its
FLOPs from TVM's estimate on the kernel specialised at that batch. ONNX Runtime: its profiler's
per-node kernel times over 20 calls (the median), FLOPs of convolutions and matrix products from
the profiled input / output shapes. Whole calls: the median of 20, in this process on N threads
and in a child process on one thread (the scaling of each system). Keys shared by both sides
(``conv KxK s<stride> <in channels>-><out channels> @<out size>``) sum their kernels, so the two
columns compare layer by layer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--whole-only", action="store_true", help=argparse.SUPPRESS)  # the one-thread child
    return parser.parse_args()


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def conv_key(out_shape, in_channels: int, kernel: int, stride: int, groups: int = 1) -> str:
    """A layer's name shared by both sides: NHWC / NCHW agnostic (channels and size given)."""
    kind = "dw" if groups > 1 and groups == in_channels else "conv"
    return f"{kind} {kernel}x{kernel} s{stride} {in_channels}->{out_shape[0]} @{out_shape[1]}"


def relaxtune_kernels(workload, target, job, batch: int) -> tuple[dict, float, callable]:
    """{key: [ms, GFLOP]} per layer of relaxtune's build at ``batch``, the whole call's ms, and the call."""
    import tvm
    from tvm import relax
    from tvm.s_tir import analysis

    from relaxtune.compiler.build import bucket_plan, build
    from relaxtune.relax_passes.pipeline import fuse
    from relaxtune.runtime.artifact import prepare_params
    from relaxtune.schedules.tasks import bucket_functions, bucket_of, specialise

    fused = fuse(workload.mod, target.target, bucket_plan(workload, job))
    keys, flops = {}, {}
    for gv in bucket_functions(fused):
        if not all(lo <= batch <= hi for lo, hi, _ in bucket_of(fused[gv]).values()):
            continue
        symbolic = {v.name for v in relax.analysis.defined_symbolic_vars(fused[gv])}
        for name, static in specialise(fused, gv, {"b": batch} if "b" in symbolic else {}):
            if static is None:
                continue
            flops[name] = float(analysis.estimate_tir_flops(tvm.IRModule({"main": static})))
            keys[name] = _kernel_key(name, static)
    executable = build(workload, target, job)[0]
    vm = relax.VirtualMachine(executable, tvm.cpu())
    inputs = workload.random_inputs({"b": batch})
    args = [tvm.runtime.tensor(inputs["x"])] + prepare_params(
        vm, [tvm.runtime.tensor(v) for v in workload.params.values()]
    )
    times = collections.defaultdict(float)
    calls = collections.Counter()

    def instrument(func, symbol, before, _ret, *call_args):
        if before or symbol.startswith(("vm.", "main", "compute_symbolic", "shape_func", "relax.")):
            return 0
        func(*call_args)
        start, n = time.perf_counter(), 0
        while n < 3 or time.perf_counter() - start < 0.02:
            func(*call_args)
            n += 1
        times[symbol] += (time.perf_counter() - start) / n * 1e3
        calls[symbol] += 1
        return 0

    plain = relax.VirtualMachine(executable, tvm.cpu())
    whole = _median_ms(lambda: plain["main"](*args))
    vm.set_instrument(instrument)
    vm["main"](*args)
    layers = collections.defaultdict(lambda: [0.0, 0.0])
    for symbol, ms in times.items():
        base = symbol.removesuffix("_tuned")
        key = keys.get(base, base)
        layers[key][0] += ms
        layers[key][1] += flops.get(base, 0.0) * 1e-9 * calls[symbol]
    return dict(layers), whole, lambda: plain["main"](*args)


def _kernel_key(name: str, func) -> str:
    """conv key of a fused convolution kernel (its NHWC output and weight buffers), else its name."""
    if "conv2d" not in name:
        return name.rstrip("0123456789_")
    shapes = [[int(d) for d in p.ty.shape] if hasattr(p.ty, "shape") else [] for p in func.params]
    out = shapes[-1]
    weight = next((s for s in shapes if len(s) == 5), None) or next(
        (s for s in shapes[1:] if len(s) == 4 and s[0] == s[1] and s[0] <= 11), None
    )
    data = shapes[0]
    if weight is None or len(out) != 4 or len(data) != 4:
        return name
    kernel = weight[1] if len(weight) == 5 else weight[0]
    in_channels = weight[3] if len(weight) == 5 else weight[2]
    groups = data[3] if in_channels == 1 else 1
    stride = max(1, round(data[1] / out[1])) if data[1] != out[1] + kernel - 1 else 1
    return conv_key((out[3], out[1]), data[3], kernel, stride, groups)


def ort_nodes(session_path: Path, batch: int, threads: int, image: int) -> tuple[dict, float]:
    """{key: [ms, GFLOP]} per layer from ONNX Runtime's profiler, and the whole call's ms."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    x = np.random.default_rng(0).standard_normal((batch, 3, image, image)).astype("float32")
    plain = ort.InferenceSession(str(session_path), options, providers=["CPUExecutionProvider"])
    whole = _median_ms(lambda: plain.run(None, {"x": x}))
    options.enable_profiling = True
    options.profile_file_prefix = str(session_path.with_suffix("")) + f"-b{batch}"
    profiled = ort.InferenceSession(str(session_path), options, providers=["CPUExecutionProvider"])
    for _ in range(25):
        profiled.run(None, {"x": x})
    events = json.loads(Path(profiled.end_profiling()).read_text())
    per_node = collections.defaultdict(list)
    info = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_node[event["name"]].append(event["dur"] / 1e3)
            info[event["name"]] = event.get("args", {})
    layers = collections.defaultdict(lambda: [0.0, 0.0])
    for node, durations in per_node.items():
        args = info[node]
        key, gflop = _node_key(args), _node_gflop(args)
        layers[key][0] += statistics.median(durations[5:] or durations)
        layers[key][1] += gflop
    return dict(layers), whole


def _shapes(args: dict, field: str) -> list[list[int]]:
    return [list(next(iter(s.values()))) for s in args.get(field, [])]


def _node_key(args: dict) -> str:
    op = args.get("op_name", "?")
    inputs, outputs = _shapes(args, "input_type_shape"), _shapes(args, "output_type_shape")
    if op in ("Conv", "FusedConv") and inputs and outputs and len(inputs) > 1:
        weight, out, data = inputs[1], outputs[0], inputs[0]
        channels = data[1] * (data[4] if len(data) == 5 else 1)
        out_channels = out[1] * (out[4] if len(out) == 5 else 1)
        kernel = weight[2]
        groups = channels if weight[1] == 1 and len(weight) == 4 and weight[0] == channels else 1
        if len(weight) == 6 and weight[1] == 1 and weight[0] * weight[5] == out_channels and out_channels == channels:
            groups = channels  # NCHWc depthwise
        stride = max(1, round(data[2] / out[2])) if data[2] != out[2] + kernel - 1 else 1
        return conv_key((out_channels, out[2]), channels, kernel, stride, groups)
    return op


def _node_gflop(args: dict) -> float:
    inputs, outputs = _shapes(args, "input_type_shape"), _shapes(args, "output_type_shape")
    if args.get("op_name") in ("Conv", "FusedConv") and len(inputs) > 1 and outputs:
        weight = inputs[1]
        out = outputs[0]
        per_output = 1
        for d in weight[1:]:
            per_output *= d
        if len(weight) == 6:  # NCHWc: [O/b, I/b, KH, KW, b_i, b_o]
            per_output = weight[1] * weight[2] * weight[3] * weight[4]
        elements = 1
        for d in out:
            elements *= d
        return 2 * elements * per_output * 1e-9
    return 0.0


def _rate(layer: list) -> str:
    """GFLOP/s of a layer's [ms, GFLOP], or '-'."""
    return f"{layer[1] / layer[0] * 1e3:.0f}" if layer[0] and layer[1] else "-"


def main() -> None:
    args = _parse()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from relaxtune import targets, threads
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.measure import onnxruntime_baseline
    from relaxtune.workloads import load

    threads.configure()
    workload = load(f"torchvision:{args.model}", {"image": str(args.image)})
    target = targets.resolve("cpu")
    job = JobConfig(
        cache_dir=args.cache or Path("tuning_logs"),
        buckets=BucketConfig(edges={"b": (1, 8, 16)}),
        compile=CompileConfig(use_cache=args.cache is not None),
    )
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "convnet_kernels"
    folder.mkdir(parents=True, exist_ok=True)
    onnx_path = onnxruntime_baseline.export(workload, folder / f"{args.model}.onnx")
    if args.whole_only:  # the child: whole calls on this process's threads only
        for batch in (int(b) for b in args.batch.split(",")):
            _, whole, _ = relaxtune_kernels(workload, target, job, batch)
            print(
                json.dumps(
                    {
                        "batch": batch,
                        "relaxtune_ms": whole,
                        "onnxruntime_ms": ort_nodes(onnx_path, batch, args.threads, args.image)[1],
                    }
                )
            )
        return
    report = {"model": args.model, "threads": args.threads, "target": target.config, "batches": []}
    for batch in (int(b) for b in args.batch.split(",")):
        ours, ours_ms, _ = relaxtune_kernels(workload, target, job, batch)
        theirs, theirs_ms = ort_nodes(onnx_path, batch, args.threads, args.image)
        report["batches"].append(
            {
                "batch": batch,
                "relaxtune_ms": ours_ms,
                "onnxruntime_ms": theirs_ms,
                "relaxtune": ours,
                "onnxruntime": theirs,
            }
        )
        print(
            f"\n## {args.model} b={batch}, {args.threads} threads: "
            f"whole call relaxtune {ours_ms:.2f} ms, onnxruntime {theirs_ms:.2f} ms"
        )
        print("| layer | relaxtune ms | GFLOP/s | onnxruntime ms | GFLOP/s |\n|---|---|---|---|---|")
        for key in sorted(set(ours) | set(theirs), key=lambda k: -max(ours.get(k, [0])[0], theirs.get(k, [0])[0])):
            a, b = ours.get(key, [0.0, 0.0]), theirs.get(key, [0.0, 0.0])
            print(f"| {key} | {a[0]:.3f} | {_rate(a)} | {b[0]:.3f} | {_rate(b)} |")
        print(
            f"| sum | {sum(v[0] for v in ours.values()):.2f} | | {sum(v[0] for v in theirs.values()):.2f} | |",
            flush=True,
        )
    env = {**os.environ, "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    one = [
        sys.executable,
        __file__,
        args.model,
        "--batch",
        args.batch,
        "--threads",
        "1",
        "--image",
        str(args.image),
        "--whole-only",
    ]
    if args.cache:
        one += ["--cache", str(args.cache)]
    done = subprocess.run(one, env=env, capture_output=True, text=True, check=False)
    singles = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    report["one_thread"] = singles
    for row in singles:
        multi = next(b for b in report["batches"] if b["batch"] == row["batch"])
        print(
            f"b={row['batch']}: 1 thread relaxtune {row['relaxtune_ms']:.2f} ms, "
            f"onnxruntime {row['onnxruntime_ms']:.2f} ms; "
            f"{args.threads} threads speed-up relaxtune {row['relaxtune_ms'] / multi['relaxtune_ms']:.2f}, "
            f"onnxruntime {row['onnxruntime_ms'] / multi['onnxruntime_ms']:.2f}"
        )
    if done.returncode:
        print(done.stderr[-2000:])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
