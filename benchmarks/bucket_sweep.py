"""Latency sweep over the symbolic range: bucketed tuning vs one-n tuning vs rules vs torch eager.

    python benchmarks/bucket_sweep.py --trials 128 --out build/sweep

Tunes the workload with the same budget into fresh caches (default power-of-two buckets; one
bucket tuned at --single-at; and, as spot checks, one bucket tuned at exactly each --exact n),
each job ending with its bucket check (relaxtune/bucket_check.py); builds them and a rules-only
artifact, then times each with torch eager, interleaved in rounds, at every n (an exact-n
artifact only at its n; torch eager in a child process, `relaxtune/bench_remote.py`), and writes a markdown table (with
bucketed / exact),
JSON and a PNG.
It also measures the bucket dispatch overhead: a one-op model compiled with one bucket and with
the default buckets, timed at the same n.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from relaxtune import api, targets
from relaxtune.config import BucketConfig, CompileConfig, JobConfig, TuneConfig
from relaxtune.measure.bench import Row, interleaved, plot, time_call
from relaxtune.measure.torch_process import TorchProcess
from relaxtune.measure.vm import VMRunner
from relaxtune.workloads import load


def dispatch_overhead(target, ns: list[int]) -> dict[int, float]:
    """Median call time with power-of-two buckets minus with one bucket, for `y = x + 1` (us)."""
    import tvm
    from tvm import relax
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class AddOne:
        @R.function
        def main(x: R.Tensor((1, "n", 16), "float32")) -> R.Tensor((1, "n", 16), "float32"):
            R.func_attr({"tir_var_upper_bound": {"n": 1024}, "tir_var_lower_bound": {"n": 1}, "num_input": 1})
            with R.dataflow():
                y = R.add(x, R.const(1.0, "float32"))
                R.output(y)
            return y

    from relaxtune.relax_passes.bucket_dispatch import plan_buckets
    from relaxtune.relax_passes.pipeline import pipeline

    out = {}
    builds = {
        name: relax.VirtualMachine(
            tvm.compile(AddOne, target=target.target, relax_pipeline=pipeline(target.target, plan)), tvm.cpu()
        )
        for name, plan in (
            ("one", plan_buckets({"n": (1, 1024, 1024)}, {}, {"n": 1024})),
            ("pow2", plan_buckets({"n": (1, 1024, 128)}, {})),
        )
    }
    for n in ns:
        x = tvm.runtime.tensor(np.zeros((1, n, 16), "float32"))
        times = {
            name: statistics.median(time_call(lambda vm=vm: vm["main"](x), min_runs=200)) for name, vm in builds.items()
        }
        out[n] = (times["pow2"] - times["one"]) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="llama-block")
    parser.add_argument("--config", default="", help="workload config overrides, e.g. hidden=64,max_seq=128")
    parser.add_argument("--trials", type=int, default=128)
    parser.add_argument("--single-at", type=int, default=128)
    parser.add_argument(
        "--exact",
        default="16,512",
        help="spot checks: the same budget tuned at exactly these n (and --single-at), timed there",
    )
    parser.add_argument("--n", default="1,2,3,7,16,37,64,100,128,300,512,1000")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("build/sweep"))
    parser.add_argument(
        "--caches",
        type=Path,
        default=None,
        help="folder for the jobs' caches (default: a new temporary folder); an earlier run's folder re-times its "
        "artifacts (0 new trials)",
    )
    args = parser.parse_args()
    ns = [int(v) for v in args.n.split(",")]
    exact = [int(v) for v in args.exact.split(",") if v.strip()]
    target = targets.resolve("cpu")
    config = dict(kv.split("=", 1) for kv in args.config.split(",") if kv)
    workload = load(args.workload, config)
    root = args.caches or Path(tempfile.mkdtemp(prefix="sweep-"))
    print(f"caches: {root}", flush=True)
    single = f"tuned at n={args.single_at} only"
    jobs = {
        "relaxtune bucketed": JobConfig(cache_dir=root / "bucketed", tune=TuneConfig(trials=args.trials)),
        single: JobConfig(
            cache_dir=root / "single",
            tune=TuneConfig(trials=args.trials),
            buckets=BucketConfig(single={"n": args.single_at}),
        ),
    }
    for n in exact:  # a kernel tuned for exactly that n: the bucketed artifact's yardstick there
        jobs[f"tuned at n={n} only"] = JobConfig(
            cache_dir=root / f"exact{n}", tune=TuneConfig(trials=args.trials), buckets=BucketConfig(single={"n": n})
        )
    tuning = {}
    for name, job in jobs.items():
        result = api.tune(workload, target, job, progress=False)
        verdicts = {b["bucket"]: b["verdict"] for b in result.buckets}
        tuning[name] = {"trials": result.trials_run, "wall_s": result.wall_s, "buckets": result.buckets}
        print(f"{name}: {result.trials_run} trials in {result.wall_s:.0f} s; bucket check: {verdicts}", flush=True)
    jobs["rules only"] = JobConfig(compile=CompileConfig(use_cache=False))
    executables = {name: api.build(workload, target, job)[0] for name, job in jobs.items()}
    import tvm

    # torch eager in a process of its own: in this one, TVM's calls ran up to 1.7x slower (bench_remote.py)
    torch_eager = TorchProcess(args.workload, config)
    rows: list[Row] = []
    for n in ns + [n for n in exact if n not in ns]:
        point = {"b": 1, "n": n}
        inputs = workload.random_inputs(point)
        expected = workload.reference(inputs, workload.params)
        calls, errors = {}, {}
        for name, ex in executables.items():
            if name.startswith("tuned at n=") and name != single and name != f"tuned at n={n} only":
                continue  # exact-n artifacts are timed at their own n only
            runner = VMRunner.for_workload(ex, tvm.cpu(), workload)
            errors[name] = float(np.abs(runner.outputs(inputs) - expected).max())
            calls[name] = runner.caller(inputs)
        calls["torch"] = torch_eager.at(point)
        medians = interleaved(calls, args.rounds)
        for name, ms in medians.items():
            label = "tuned at exact n" if name.startswith("tuned at n=") and name != single else name
            rows.append(Row(label, point, ms, args.rounds, errors.get(name)))
        print(" ".join(f"{name}={ms:.3f}ms" for name, ms in medians.items()), flush=True)
    torch_eager.close()
    overhead = dispatch_overhead(target, [1, 100, 1000])
    systems = list(dict.fromkeys(r.system for r in rows))
    by = {(r.system, r.shape["n"]): r for r in rows}
    lines = [
        "| n | " + " | ".join(f"{s} ms (x torch)" for s in systems) + " | bucketed / exact |",
        "|---" * (len(systems) + 2) + "|",
    ]
    for n in sorted({r.shape["n"] for r in rows}):
        base = by[("torch", n)].median_ms
        cells = [
            f"{by[(s, n)].median_ms:.3f} ({by[(s, n)].median_ms / base:.2f}x)" if (s, n) in by else "-" for s in systems
        ]
        yardstick = by.get(("tuned at exact n", n)) or (by.get((single, n)) if n == args.single_at else None)
        ratio = f"{by[('relaxtune bucketed', n)].median_ms / yardstick.median_ms:.2f}" if yardstick else "-"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {ratio} |")
    table = "\n".join(lines)
    overhead_line = "dispatch overhead (power-of-two buckets vs one bucket, y = x + 1): " + ", ".join(
        f"n={n}: {us:+.2f} us" for n, us in overhead.items()
    )
    print(table)
    print(overhead_line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text(
        f"# {args.workload} latency sweep ({target.json})\n\n{table}\n\n{overhead_line}\n"
    )
    (args.out / "sweep.json").write_text(
        json.dumps({"rows": [r.as_json() for r in rows], "tuning": tuning, "dispatch_overhead_us": overhead}, indent=2)
    )
    plot(
        [r for r in rows if r.system != "tuned at exact n"], args.out / "sweep.png", f"{args.workload}: latency over n"
    )
    print(f"saved {args.out}/sweep.md, sweep.json, sweep.png")


if __name__ == "__main__":
    main()
