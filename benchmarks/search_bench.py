"""Stock MetaSchedule `tune_relax` against relaxtune's search: same kernels, machine and budget.

Part 1 (cold): the workload is made static at one shape (`--shape n=64`), legalized and fused the
way `compile_relax` prepares it, and MetaSchedule's `extract_tasks` gives the kernels. Then, one
after the other, each in a fresh process and a fresh folder:
- stock: `ms.relax_integration.tune_relax(...)` as a user calls it, with the default XGBoost
  model, search and task scheduler, plus the one fix it needs on this machine: a build function
  without the 35 s tensor-intrinsic import (../shared/notes/tvm-0.27.md §4.1, Fix A; without it
  every build of every batch times out at 30 s and tuning ends with no record at all);
- relaxtune: `schedules.tune.tune` on the same kernels (persistent build workers, persistent cost
  model, right-sized search, early stop, transfer).
Both measure with the same runner settings. A measure callback (stock) and the events file
(relaxtune) give each kernel's best time after every batch, so the estimated model time
(sum over kernels of calls x best time) is known over wall time for both. Then both databases
are applied to the same static module (`compile_relax`) and the two executables are timed
alternately (`--rounds`, medians).

Part 2 (warm, `--second`): relaxtune tunes `--second` (e.g. mlp) into a fresh cache (cold), then
into another fresh cache after `--first` (e.g. llama-block at the same hidden sizes, so they share
the SwiGLU kernels; `--fusion stock` shares more of them): the second job's wall time, and the
time it needs to reach the cold job's final estimated model time, warm against cold
(`--warm-only` runs part 2 alone). Each job's wall time is the `api.tune` call (task extraction,
tuning, the bucket check after it); `tune_wall_s` and `profile` are the tuning part. The final
estimated times are taken over the kernels the cold job tuned, from the cache's best after each
job (so a warm job that measures nothing still has one); along a job, a kernel counts at its
cached best from the job's start. Two ratios, warm over cold, both printed and in `ratios`: the
whole job (`api.tune` wall), and the time to reach the cold job's final estimate (each from its
call; the cold job reaches it at the batch that found it). Every job and run also reports the CPU
time the machine spent on other work meanwhile (`machine`: /proc/stat's busy time less the job's
own processes'), with a warning above 5% of the machine: such a run's timings are disturbed.
`--out` keeps both caches
(`<out>/part2/cold`, `<out>/part2/warm`) with their events and task index.

    python benchmarks/search_bench.py --workload mlp --config hidden=128,ffn=256,max_seq=64 \\
        --shape n=64 --trials 40 [--first llama-block --second mlp] [--out DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# -- shared ---------------------------------------------------------------------------------------
def static_module(args):
    """The workload bound at --shape (other dims at their lower bound), legalized and fused."""
    import tvm
    from tvm import relax

    from relaxtune import targets
    from relaxtune.workloads import load, parse_config

    workload = load(args.workload, parse_config(args.config))
    shape = dict(item.split("=") for item in args.shape)
    values = {d.name: int(shape.get(d.name, d.lower)) for d in workload.dims.values()}
    target = targets.resolve("cpu").target
    mod = relax.transform.BindSymbolicVars(values)(workload.mod)
    prep = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
        ]
    )
    with target:
        fused = prep(mod)
    return workload, values, target, fused


def model_time(best: dict[str, float], weights: dict[str, float]) -> float:
    """Estimated kernel time per model call: sum of calls x best time (inf until all measured)."""
    if any(name not in best for name in weights):
        return float("inf")
    return sum(weights[n] * best[n] for n in weights)


def cpu_seconds() -> tuple[float, float]:
    """(the machine's busy CPU seconds since boot, from /proc/stat: user, nice, system, irq,
    softirq; this process's waited-for children's CPU seconds)."""
    import resource

    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = (values[0] + values[1] + values[2] + values[5] + values[6]) / os.sysconf("SC_CLK_TCK")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, children.ru_utime + children.ru_stime


def foreign_cpu(before: tuple[float, float], wall_s: float) -> dict:
    """CPU the machine spent outside the job (a child of this process, its workers waited for)
    while it ran: other users' work that disturbs its timings. Quiet enough under 5% of the box."""
    busy, mine = (b - a for a, b in zip(before, cpu_seconds()))
    other = max(0.0, busy - mine)
    share = other / (wall_s * (os.cpu_count() or 1)) if wall_s > 0 else 0.0
    return {"other_cpu_s": round(other, 2), "other_cpu_share": round(share, 3), "quiet": share < 0.05}


def time_to_reach(curve: list[tuple[float, float]], goal: float) -> float | None:
    return next((t for t, v in curve if v <= goal * (1 + 1e-9)), None)


# -- the two searches, each run in its own process -------------------------------------------------
def run_stock(args, out: Path) -> None:
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.schedules.build_worker import build_without_intrin_import

    workload, values, target, fused = static_module(args)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    weights = {t.task_name: float(t.weight) for t in tasks}
    best: dict[str, float] = {}
    curve: list[tuple[float, float]] = []
    counted = [0]
    start = time.perf_counter()

    @derived_object
    class Timeline(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, candidates, builds, runs):
            name = tasks[task_id].task_name
            counted[0] += len(runs)
            for r in runs:
                if r.run_secs and not r.error_msg:
                    best[name] = min(
                        best.get(name, float("inf")), 1e6 * sum(float(s) for s in r.run_secs) / len(r.run_secs)
                    )
            curve.append((time.perf_counter() - start, model_time(best, weights)))

    runner = ms.runner.LocalRunner(
        timeout_sec=30, evaluator_config=ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20)
    )
    builder = ms.builder.LocalBuilder(f_build=build_without_intrin_import, timeout_sec=60)
    ms.relax_integration.tune_relax(
        mod=fused,
        params={},
        target=target,
        work_dir=str(out / "stock_db"),
        max_trials_global=args.trials,
        num_trials_per_iter=args.per_iter,
        builder=builder,
        runner=runner,
        seed=0,
        measure_callbacks=[*ms.MeasureCallback.create("default"), Timeline()],
    )
    wall = time.perf_counter() - start
    (out / "stock.json").write_text(
        json.dumps({"wall_s": wall, "curve": curve, "best_us": best, "weights": weights, "trials": counted[0]})
    )


def run_relaxtune(args, out: Path) -> None:
    from relaxtune.schedules import intrin

    intrin.register_for("llvm")
    import tvm_ffi
    from tvm.s_tir import analysis
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.config import TuneConfig
    from relaxtune.schedules.database import CacheDatabase
    from relaxtune.schedules.tasks import Task
    from relaxtune.schedules.tune import tune

    workload, values, target, fused = static_module(args)
    epoch, start = time.time(), time.perf_counter()  # as for stock: from the call that tunes
    tasks = []
    for t in ms.relax_integration.extract_tasks(fused, target):
        mod = t.dispatched[0]  # as stock tunes and looks it up (relaxtune's `normalize` strips attributes)
        flops = float(analysis.estimate_tir_flops(mod))
        tasks.append(
            Task(
                name=t.task_name,
                mod=mod,
                key=str(tvm_ffi.structural_hash(mod)),
                flops=flops,
                bucket={},
                weight=float(t.weight),
            )
        )
    folder = out / "relaxtune_db"
    database = CacheDatabase(folder, writable=True)
    config = TuneConfig(trials=args.trials, trials_per_iter=args.per_iter)
    result = tune(tasks, target, database, config, folder, progress=False, workload=args.workload)
    wall = time.perf_counter() - start
    (out / "relaxtune.json").write_text(
        json.dumps(
            {
                "wall_s": wall,
                "epoch": epoch,
                "weights": {t.name: t.weight for t in tasks},
                "folder": str(folder),
                "profile": result.profile,
                "ranking": result.ranking,
            }
        )
    )


def relaxtune_curve(folder: Path, weights: dict[str, float], epoch: float) -> tuple[list, int]:
    """(seconds since `epoch`, estimated model time) after each batch, from the events file; trials."""
    best: dict[str, float] = {}
    curve, trials = [], 0
    for path in sorted((folder / "events").glob("*.jsonl")):
        for e in (json.loads(x) for x in path.read_text().splitlines() if x.strip()):
            if e["ev"] == "batch":
                trials += len(e["us"])
                valid = [u for u in e["us"] if u is not None]
                if valid:
                    best[e["task"]] = min(best.get(e["task"], float("inf")), *valid)
                curve.append((e["t"] - epoch, model_time(best, weights)))
    return curve, trials


def compare_executables(args, out: Path) -> dict:
    """Apply each database to the same static module and time both executables alternately."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.schedules.database import CacheDatabase

    workload, values, target, fused = static_module(args)
    dbs = {
        "stock": ms.database.JSONDatabase(work_dir=str(out / "stock_db")),
        "relaxtune": CacheDatabase(out / "relaxtune_db"),
    }
    inputs = workload.random_inputs(values)
    args_ = [tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs] + [
        tvm.runtime.tensor(p) for p in workload.params.values()
    ]
    vms, outs = {}, {}
    for name, db in dbs.items():
        ex = ms.relax_integration.compile_relax(db, fused, target, params=None)
        vms[name] = relax.VirtualMachine(ex, tvm.cpu())
        outs[name] = vms[name]["main"](*args_).numpy()
    np.testing.assert_allclose(outs["relaxtune"], outs["stock"], rtol=1e-4, atol=1e-5)
    times: dict[str, list[float]] = {n: [] for n in vms}
    for _ in range(args.rounds):
        for name, vm in vms.items():
            timer = vm.time_evaluator("main", tvm.cpu(), number=10, repeat=1, min_repeat_ms=50)
            times[name].append(timer(*args_).mean * 1e6)
    return {n: float(np.median(v)) for n, v in times.items()}


# -- part 2: warm start across workloads ----------------------------------------------------------
def run_job(args, name: str, cache: Path) -> dict:
    """One `relaxtune tune` job through the Python API (own process); its wall and curve."""
    code = (
        "import json,logging,sys,time;logging.basicConfig(level=logging.INFO,format='%(relativeCreated)7.0f ms "
        "%(name)s: %(message)s');"
        "from relaxtune.schedules import intrin;intrin.register_for('llvm');"
        "from relaxtune import api,targets;from relaxtune.config import "
        "JobConfig,TuneConfig,BucketConfig,CompileConfig;"
        "from relaxtune.workloads import load,parse_config;"
        f"w=load({name!r},parse_config({args.config!r}));t=targets.resolve('cpu');e=time.time();s=time.perf_counter();"
        f"r=api.tune(w,t,JobConfig(cache_dir={str(cache)!r},tune=TuneConfig(trials={args.trials},trials_per_iter={args.per_iter}),"
        f"buckets=BucketConfig.parse({args.buckets!r}),compile=CompileConfig(fusion={args.fusion!r})),progress=False);"
        "print(json.dumps({'wall_s':time.perf_counter()-s,'epoch':e,'trials_run':r.trials_run,'trials_cached':r.trials_cached,"
        "'tune_wall_s':r.wall_s,'profile':r.profile,'tasks':{x.name:x.best_us for x in r.tasks if x.trials},"
        "'weights':{x.name:x.weight for x in r.tasks if x.trials}}))"
    )
    before = set(Path(cache).glob("*/events/*.jsonl"))
    cpu, start = cpu_seconds(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["machine"] = foreign_cpu(cpu, time.perf_counter() - start)
    out["curve"] = job_curve(sorted(set(Path(cache).glob("*/events/*.jsonl")) - before), out)
    return out


def job_curve(files: list[Path], job: dict) -> list[tuple[float, float]]:
    """(seconds since the job's call, estimated kernel time per model call) after each batch, over
    every kernel with records after the job. A kernel the job does not measure (it held its share,
    or an earlier job stopped it) counts at its cached best from the start; one it measures
    counts from the start at the cached best the job found (`cached_best_us` in the events' start
    line), or from its first batch on when it had no record."""
    curve = []
    for path in files:
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        start = next(e for e in lines if e["ev"] == "start")
        # every kernel with records after the job (one it did not tune at its cached best, which
        # the job did not change), and those it tuned
        weights = {**job["weights"], **{t["name"]: t["weight"] for t in start["tasks"]}}
        measured = {e["task"] for e in lines if e["ev"] == "batch"}
        best = {n: job["tasks"][n] for n in weights if n not in measured and n in job["tasks"]}
        best.update({t["name"]: t["cached_best_us"] for t in start["tasks"] if t.get("cached_best_us") is not None})
        curve.append((start["t"] - job["epoch"], model_time(best, weights)))
        for e in lines:
            if e["ev"] == "batch":
                valid = [u for u in e["us"] if u is not None]
                if valid:
                    best[e["task"]] = min(best.get(e["task"], float("inf")), *valid)
                curve.append((e["t"] - job["epoch"], model_time(best, weights)))
    return curve


def final_estimate(job: dict, weights: dict[str, float]) -> float:
    """Estimated kernel time per model call at the job's end: sum over `weights`' kernels of calls
    x the cache's best after the job (inf if one has no record); the same for a job that ran no
    trial, whose curve is empty."""
    return model_time(job["tasks"], weights) if weights else float("inf")


def part_two(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-part2-") as tmp:
        root = Path(args.out or tmp) / "part2"  # --out keeps both caches and their events
        cold_dir, warm_dir = root / "cold", root / "warm"
        if root.exists():
            raise SystemExit(f"{root} exists: give a new --out (part 2 starts from empty caches)")
        for folder in (cold_dir, warm_dir):
            folder.mkdir(parents=True)
        cold = run_job(args, args.second, cold_dir)
        first = run_job(args, args.first, warm_dir)
        warm = run_job(args, args.second, warm_dir)
    shared = sorted(set(cold["tasks"]) & set(warm["tasks"]))
    weights = cold["weights"]  # the kernels the cold job tuned, both jobs estimated over them
    goal, reached = final_estimate(cold, weights), final_estimate(warm, weights)
    reach_cold, reach_warm = time_to_reach(cold["curve"], goal), time_to_reach(warm["curve"], goal)
    if reach_warm is None and reached <= goal * (1 + 1e-9):
        reach_warm = warm["wall_s"]  # no batch: it held the cold job's final time when it ended
    reach_ratio = reach_warm / reach_cold if reach_warm is not None and reach_cold else None
    return {
        "cold": cold,
        "first": first,
        "warm": warm,
        "ratio": warm["wall_s"] / cold["wall_s"],
        "ratios": {
            "whole_job_warm_over_cold": warm["wall_s"] / cold["wall_s"],
            "reach_cold_final_warm_over_cold": reach_ratio,
            "tuning_only_warm_over_cold": warm["tune_wall_s"] / cold["tune_wall_s"],
        },
        "cold_final_estimated_us": goal,
        "warm_final_estimated_us": reached,
        "cold_reached_own_final_s": reach_cold,
        "warm_reached_cold_final_s": reach_warm,
        "reach_ratio": reach_ratio,
        "best_us_cold_vs_warm": {n: [cold["tasks"][n], warm["tasks"][n]] for n in shared},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--config", default="hidden=128,ffn=256,max_seq=64,max_batch=1")
    parser.add_argument("--shape", action="append", default=["n=64"])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--per-iter", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--first", default="", help="part 2: the workload tuned first (e.g. llama-block)")
    parser.add_argument("--second", default="", help="part 2: the workload tuned cold and after --first (e.g. mlp)")
    parser.add_argument("--buckets", action="append", default=["n=@64"], help="part 2: bucket spec for both jobs")
    parser.add_argument("--fusion", default="relaxtune", help="part 2: relaxtune or stock fusion for both jobs")
    parser.add_argument("--warm-only", action="store_true", help="run part 2 only")
    parser.add_argument("--mode", choices=["all", "stock", "relaxtune"], default="all", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", type=Path, default=None, help="keep both databases and the events here (default: a temporary folder)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.mode == "stock":
        run_stock(args, args.out)
        return 0
    if args.mode == "relaxtune":
        run_relaxtune(args, args.out)
        return 0

    report: dict = {"workload": args.workload, "config": args.config, "shape": args.shape, "trials": args.trials}
    if not args.warm_only:
        part_one(args, report)
    if args.first and args.second:
        print(f"part 2: {args.second} cold, then {args.first} and {args.second} in one cache ...", flush=True)
        report["warm"] = part_two(args)
        print(json.dumps(report["warm"], indent=2))
        r, w = report["warm"]["ratios"], report["warm"]
        print(
            f"part 2, warm {args.second} after {args.first} over cold {args.second}: whole job "
            f"{w['warm']['wall_s']:.1f} / {w['cold']['wall_s']:.1f} s = "
            f"{r['whole_job_warm_over_cold']:.2f}; time to reach the cold job's final estimate "
            f"({w['cold_final_estimated_us']:.1f} us) "
            f"{w['warm_reached_cold_final_s'] or float('nan'):.1f} / "
            f"{w['cold_reached_own_final_s'] or float('nan'):.1f} s = "
            f"{r['reach_cold_final_warm_over_cold'] or float('nan'):.2f}; "
            f"trials {w['warm']['trials_run']} / {w['cold']['trials_run']}",
            flush=True,
        )
        noisy = {
            k: w[k]["machine"]["other_cpu_share"] for k in ("cold", "first", "warm") if not w[k]["machine"]["quiet"]
        }
        if noisy:
            shares_text = ", ".join(f"{k} {v:.0%}" for k, v in noisy.items())
            print(
                f"WARNING: other work used part of the machine during jobs ({shares_text}): "
                "their timings are disturbed",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def part_one(args, report: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="search-bench-") as tmp:
        out = Path(args.out or tmp)  # --out keeps both databases and relaxtune's events
        out.mkdir(parents=True, exist_ok=True)
        base = [
            sys.executable,
            __file__,
            "--workload",
            args.workload,
            "--config",
            args.config,
            "--trials",
            str(args.trials),
            "--per-iter",
            str(args.per_iter),
            "--out",
            str(out),
        ]
        base += [x for s in args.shape for x in ("--shape", s)]
        machine = {}
        for mode in ("stock", "relaxtune"):
            print(f"running {mode} ...", flush=True)
            cpu, start = cpu_seconds(), time.perf_counter()
            subprocess.run([*base, "--mode", mode], check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            machine[mode] = foreign_cpu(cpu, time.perf_counter() - start)
        stock = json.loads((out / "stock.json").read_text())
        ours = json.loads((out / "relaxtune.json").read_text())
        curve, our_trials = relaxtune_curve(Path(ours["folder"]), ours["weights"], ours["epoch"])
        goal = stock["curve"][-1][1] if stock["curve"] else float("inf")
        measured = compare_executables(args, out)
    reach_stock = time_to_reach(stock["curve"], goal)
    reach_ours = time_to_reach(curve, goal)
    report["cold"] = {
        "stock_wall_s": stock["wall_s"],
        "relaxtune_wall_s": ours["wall_s"],
        "stock_estimated_us": goal,
        "relaxtune_estimated_us": curve[-1][1] if curve else None,
        "stock_trials": stock["trials"],
        "relaxtune_trials": our_trials,
        "stock_first_batch_done_s": stock["curve"][0][0] if stock["curve"] else None,
        "relaxtune_first_batch_done_s": curve[0][0] if curve else None,
        "stock_reached_own_final_s": reach_stock,
        "relaxtune_reached_stock_final_s": reach_ours,
        "relaxtune_time_fraction_of_stock_wall": (reach_ours / stock["wall_s"]) if reach_ours is not None else None,
        "measured_us": measured,
        "relaxtune_profile": ours["profile"],
        "relaxtune_ranking": ours["ranking"],
        "machine": machine,
    }
    print("stock: tune_relax with the fast build function (Fix A); without it every build times out (notes §4.1)")
    for mode, seen in machine.items():
        if not seen["quiet"]:
            print(
                f"WARNING: other work used {seen['other_cpu_share']:.0%} of the machine during the {mode} run: its "
                "timings are disturbed",
                flush=True,
            )
    print(json.dumps(report["cold"], indent=2))


if __name__ == "__main__":
    sys.exit(main())
