"""Per-kernel times of a torchvision model on 1 and N threads: relaxtune's kernels against ONNX
Runtime's nodes, each with its GFLOP/s and its parallel efficiency, and the whole call of both.

    python benchmarks/convnet_kernels.py resnet50 [--batch 1,8] [--threads 2] [--rounds 7] [--calls 3]
                                         [--cache DIR] [--json PATH]

Made for a loaded shared machine: every figure is the best call of ``--rounds`` rounds of ``--calls`` calls,
the systems and thread counts interleaved round by round in one process (TVM's pool re-sized between them
with ``runtime.config_threadpool``); one thread as CPU time (``time.process_time``, which other processes'
time slices do not inflate), N threads as wall time. relaxtune: rules only (or ``--cache``), the bucket of
each batch; each kernel timed inside whole ``main`` calls between the VM's instrument callbacks (so with the
caches as the call leaves them, the weights streamed from memory), FLOPs from TVM's estimate on the kernel
specialised at that batch. ONNX Runtime: a session on one thread and one on N, its profiler's per-node times
(the best call of each node). ``eff``: the one-thread time over N times the N-thread time (1.0: perfect
scaling). Keys shared by both sides (``conv KxK s<stride> <in channels>-><out channels> @<out size>``) sum
their kernels, so the two sides compare layer by layer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3, help="calls of each system per round")
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def _set_threads(count: int) -> None:
    import tvm_ffi

    tvm_ffi.get_global_func("runtime.config_threadpool")(1, count)


def _per_call(fn, clock, budget_s: float) -> float:
    """Seconds of the fastest call of ``fn`` by ``clock``, calls repeated for about ``budget_s`` (the
    best call: what the code does when the shared machine lets it run)."""
    fn()
    best, wall, n = float("inf"), time.perf_counter(), 0
    while n < 3 or time.perf_counter() - wall < budget_s:
        start = clock()
        fn()
        best = min(best, clock() - start)
        n += 1
    return best


def conv_key(out_shape, in_channels: int, kernel: int, stride: int, groups: int = 1) -> str:
    """A layer's name shared by both sides: NHWC / NCHW agnostic (channels and size given)."""
    kind = "dw" if groups > 1 and groups == in_channels else "conv"
    return f"{kind} {kernel}x{kernel} s{stride} {in_channels}->{out_shape[0]} @{out_shape[1]}"


class Relaxtune:
    """relaxtune's build at one batch: its kernel calls captured from one ``main`` call."""

    def __init__(self, workload, target, job, batch: int):
        import tvm
        from tvm import relax
        from tvm.s_tir import analysis

        from relaxtune.compiler.build import bucket_plan, build
        from relaxtune.relax_passes.pipeline import fuse
        from relaxtune.runtime.artifact import prepare_params
        from relaxtune.schedules.tasks import bucket_functions, bucket_of, specialise

        fused = fuse(
            workload.mod, target.target, bucket_plan(workload, job), job.compile, workload.entries, workload.weights_nk
        )
        self.keys, self.flops = {}, {}
        for gv in bucket_functions(fused):
            if not all(lo <= batch <= hi for lo, hi, _ in bucket_of(fused[gv]).values()):
                continue
            symbolic = {v.name for v in relax.analysis.defined_symbolic_vars(fused[gv])}
            for name, static in specialise(fused, gv, {"b": batch} if "b" in symbolic else {}):
                if static is not None:
                    self.flops[name] = float(analysis.estimate_tir_flops(tvm.IRModule({"main": static})))
                    self.keys[name] = _kernel_key(name, static)
        executable = build(workload, target, job)[0]
        vm = relax.VirtualMachine(executable, tvm.cpu())
        inputs = workload.random_inputs({"b": batch})
        args = [tvm.runtime.tensor(inputs["x"])] + prepare_params(
            vm, [tvm.runtime.tensor(v) for v in workload.params.values()]
        )
        self.plain = relax.VirtualMachine(executable, tvm.cpu())
        self.timed = relax.VirtualMachine(executable, tvm.cpu())
        self.args = args

    def sample(self, threads: int, calls: int) -> tuple[dict, float]:
        """{key: [ms, GFLOP]} per layer and the whole call's ms: each kernel's fastest of ``calls`` whole
        ``main`` calls (timed between the VM's instrument callbacks, so with the caches as a call leaves
        them: the weights streamed from memory as they are in use), and the fastest whole call without
        the instrument. CPU time on one thread, wall time on more."""
        _set_threads(threads)
        clock = time.process_time if threads == 1 else time.perf_counter
        names: list[str] = []
        best: list[float] = []
        state = {"i": 0, "start": 0.0}

        def instrument(_func, symbol, before, _ret, *_args):
            if symbol.startswith(("vm.", "main", "compute_symbolic", "shape_func", "relax.")):
                return 0
            if before:
                state["start"] = clock()
                return 0
            elapsed, i = clock() - state["start"], state["i"]
            if i == len(names):
                names.append(symbol.removesuffix("_tuned"))
                best.append(elapsed)
            best[i] = min(best[i], elapsed)
            state["i"] = i + 1
            return 0

        self.timed.set_instrument(instrument)
        for _ in range(calls):
            state["i"] = 0
            self.timed["main"](*self.args)
        layers = collections.defaultdict(lambda: [0.0, 0.0])
        for name, seconds in zip(names, best):
            layer = layers[self.keys.get(name, name.rstrip("0123456789_"))]
            layer[0] += seconds * 1e3
            layer[1] += self.flops.get(name, 0.0) * 1e-9
        return dict(layers), _per_call(lambda: self.plain["main"](*self.args), clock, 0.3) * 1e3


def _kernel_key(name: str, func) -> str:
    """conv key of a fused convolution kernel (its NHWC output and weight buffers), else its name."""
    if "conv2d" not in name:
        return name.rstrip("0123456789_")
    shapes = [[int(d) for d in p.ty.shape] if hasattr(p.ty, "shape") else [] for p in func.params]
    out = shapes[-1]
    weight = next((s for s in shapes if len(s) == 5), None) or next(
        (s for s in shapes[1:] if len(s) == 4 and s[0] == s[1] and s[0] <= 11), None
    )
    in_channels = (weight[3] if len(weight) == 5 else weight[2]) if weight else 0
    wanted = in_channels if in_channels > 1 else out[3]  # a depthwise weight has one input channel
    data = max(
        (s for s in shapes[:-1] if len(s) == 4 and s is not weight and s[3] == wanted), key=lambda s: s[1], default=[]
    )
    if weight is None or len(out) != 4 or len(data) != 4:
        return name
    kernel = weight[1] if len(weight) == 5 else weight[0]
    groups = data[3] if in_channels == 1 else 1
    stride = max(1, round(data[1] / out[1])) if data[1] != out[1] + kernel - 1 else 1
    return conv_key((out[3], out[1]), data[3], kernel, stride, groups)


class OnnxRuntime:
    """An ONNX Runtime session on ``threads`` intra-op threads, profiled per node."""

    def __init__(self, session_path: Path, batch: int, threads: int, image: int):
        import numpy as np
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.feed = {"x": np.random.default_rng(0).standard_normal((batch, 3, image, image)).astype("float32")}
        self.plain = ort.InferenceSession(str(session_path), options, providers=["CPUExecutionProvider"])
        options.enable_profiling = True
        options.profile_file_prefix = str(session_path.with_suffix("")) + f"-b{batch}-t{threads}"
        self.profiled = ort.InferenceSession(str(session_path), options, providers=["CPUExecutionProvider"])
        self.threads = threads

    def whole(self, budget_s: float = 0.3) -> float:
        clock = time.process_time if self.threads == 1 else time.perf_counter
        return _per_call(lambda: self.plain.run(None, self.feed), clock, budget_s) * 1e3

    def profile(self, calls: int) -> None:
        for _ in range(calls):
            self.profiled.run(None, self.feed)

    def events(self) -> list[dict]:
        """The profiler's events of every call so far (a session profiles once)."""
        return json.loads(Path(self.profiled.end_profiling()).read_text())


def ort_layers(events: list[dict]) -> dict:
    """{key: [ms, GFLOP]} per layer from the profiler's events: each node's best call."""
    per_node, info = collections.defaultdict(list), {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_node[event["name"]].append(event["dur"] / 1e3)
            info[event["name"]] = event.get("args", {})
    layers = collections.defaultdict(lambda: [0.0, 0.0])
    for node, durations in per_node.items():
        key, gflop = _node_key(info[node]), _node_gflop(info[node])
        layers[key][0] += min(durations)
        layers[key][1] += gflop
    return dict(layers)


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


def _best(samples: list[dict]) -> dict:
    """Per key, the best (smallest ms) of the rounds' samples."""
    out = {}
    for sample in samples:
        for key, (ms, gflop) in sample.items():
            if key not in out or ms < out[key][0]:
                out[key] = [ms, gflop]
    return out


def measure(workload, target, job, onnx_path: Path, batch: int, args) -> dict:
    """Both systems at ``batch`` on 1 and ``args.threads`` threads, interleaved round by round."""
    ours = Relaxtune(workload, target, job, batch)
    counts = tuple(dict.fromkeys((1, args.threads)))  # once each: a profiled session ends its profile once
    theirs = {t: OnnxRuntime(onnx_path, batch, t, args.image) for t in counts}
    samples = collections.defaultdict(list)
    for _ in range(args.rounds):
        for threads in counts:
            layers, whole = ours.sample(threads, args.calls)
            samples[f"relaxtune/{threads}"].append(layers)
            samples[f"relaxtune/{threads}/whole"].append(whole)
            theirs[threads].profile(args.calls)
            samples[f"onnxruntime/{threads}/whole"].append(theirs[threads].whole())
    _set_threads(args.threads)
    report = {"batch": batch, "threads": args.threads}
    for threads in counts:
        report[f"relaxtune/{threads}"] = _best(samples[f"relaxtune/{threads}"])
        report[f"onnxruntime/{threads}"] = ort_layers(theirs[threads].events())
        for system in ("relaxtune", "onnxruntime"):
            report[f"{system}/{threads}/whole"] = min(samples[f"{system}/{threads}/whole"])
    return report


def _print(model: str, report: dict) -> None:
    n = report["threads"]
    print(
        f"\n## {model} b={report['batch']}: whole call relaxtune {report['relaxtune/1/whole']:.2f} ms on 1 thread "
        f"(CPU time), {report[f'relaxtune/{n}/whole']:.2f} on {n}; onnxruntime {report['onnxruntime/1/whole']:.2f}, "
        f"{report[f'onnxruntime/{n}/whole']:.2f}"
    )
    print(
        f"| layer | relaxtune 1 ms | {n} ms | GFLOP/s | eff | onnxruntime 1 ms | {n} ms | GFLOP/s | eff |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    cols = ["relaxtune/1", f"relaxtune/{n}", "onnxruntime/1", f"onnxruntime/{n}"]
    keys = set().union(*(report[c] for c in cols))
    zero = [0.0, 0.0]
    for key in sorted(keys, key=lambda k: -max(report[c].get(k, zero)[0] for c in cols)):
        cells = []
        for one, many in (cols[:2], cols[2:]):
            a, b = report[one].get(key, zero), report[many].get(key, zero)
            eff = f"{a[0] / (n * b[0]):.2f}" if a[0] and b[0] else "-"
            cells += [f"{a[0]:.3f}", f"{b[0]:.3f}", _rate(b), eff]
        print(f"| {key} | " + " | ".join(cells) + " |")
    sums = [sum(v[0] for v in report[c].values()) for c in cols]
    print(f"| sum | {sums[0]:.2f} | {sums[1]:.2f} | | | {sums[2]:.2f} | {sums[3]:.2f} | | |", flush=True)


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
    out = {"model": args.model, "target": target.config, "rounds": args.rounds, "batches": []}
    for batch in (int(b) for b in args.batch.split(",")):
        report = measure(workload, target, job, onnx_path, batch, args)
        out["batches"].append(report)
        _print(args.model, report)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
