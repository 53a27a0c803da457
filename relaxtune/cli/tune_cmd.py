"""relaxtune tune WORKLOAD --target cpu --trials N"""

from __future__ import annotations

from ..config import SPACES, TuneConfig
from . import common


def add_arguments(parser) -> None:
    common.add_workload(parser)
    common.add_target(parser)
    common.add_cache(parser)
    common.add_fusion(parser)
    common.add_gpu_options(parser, graphs=False)
    parser.add_argument(
        "--trials",
        type=int,
        default=TuneConfig.trials,
        help=f"trial budget for the job, cached trials included (default {TuneConfig.trials})",
    )
    parser.add_argument(
        "--trials-per-iter", type=int, default=TuneConfig.trials_per_iter, help="candidates measured per batch"
    )
    parser.add_argument(
        "--rpc",
        metavar="HOST:PORT",
        default=TuneConfig.rpc_tracker,
        help="measure on the servers of this TVM RPC tracker (builds stay local)",
    )
    parser.add_argument(
        "--device-key",
        metavar="KEY",
        default=TuneConfig.device_key,
        help="with --rpc: the key the servers registered under",
    )
    parser.add_argument(
        "--early-stop",
        type=int,
        default=TuneConfig.early_stop_batches,
        metavar="BATCHES",
        help="stop a kernel after this many batches without 1%% gain, 0: never (default "
        f"{TuneConfig.early_stop_batches})",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=TuneConfig.time_limit_s,
        metavar="SECONDS",
        help="stop the search this many seconds after the job starts, records kept (default: none)",
    )
    parser.add_argument(
        "--space",
        choices=SPACES,
        default=TuneConfig.space,
        help="design space: each CPU rule's decisions around the rule, measured first (rules), MetaSchedule's "
        f"generic space (generic), or both; kernels without a tunable rule are searched generically (default "
        f"{TuneConfig.space})",
    )
    parser.add_argument(
        "--no-transfer", action="store_true", help="do not seed new kernels from similar cached kernels' records"
    )
    parser.add_argument(
        "--no-bucket-check",
        action="store_true",
        help="do not time each bucket's block with and without its records after the search",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--json", type=lambda p: __import__("pathlib").Path(p), default=None, help="write what is printed as JSON"
    )


def run(args) -> int:
    from .. import api, targets

    target = targets.resolve(args.target)
    tune = TuneConfig(
        trials=args.trials,
        trials_per_iter=args.trials_per_iter,
        rpc_tracker=args.rpc,
        device_key=args.device_key,
        early_stop_batches=args.early_stop,
        transfer=not args.no_transfer,
        time_limit_s=args.time_limit,
        check_buckets=not args.no_bucket_check,
        space=args.space,
    )
    job = common.job_config(args, tune)
    if tune.rpc_tracker:  # fail before the slow part when the tracker or its servers are missing
        from ..schedules import intrin

        intrin.register_for(target.target.kind.name)
        from ..schedules.rpc import check_tracker

        print(f"measuring on {check_tracker(tune)} RPC server(s) under key {tune.device_key!r} at {tune.rpc_tracker}")
    workload = common.load_workload(args)
    print(f"target: {target.json}")
    result = api.tune(workload, target, job, progress=not args.no_progress)
    if not result.tasks:
        library = (
            " (cuBLAS / flash attention; --no-cublas / --no-flash-attention make them TIR kernels to tune)"
            if target.is_gpu
            else ""
        )
        print(f"{workload.name}: nothing to tune: the build has no contraction kernel of its own{library}")
    elif result.trials_run == 0:
        print(
            f"{workload.name}: 0 trials run: the cache already holds {result.trials_cached} trials for its "
            f"{len(result.tasks)} tasks (budget {args.trials})"
        )
    else:
        print(
            f"{workload.name}: {result.trials_run} trials in {result.wall_s:.0f} s ({result.failed} failed), "
            f"{result.trials_cached} were cached"
        )
        print("time (s): " + ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in result.profile.items()))
    print(f"{'task':48} {'trials':>6} {'best us':>10} {'rules us':>10} {'GFLOP/s':>8}")
    tuned = sorted((t for t in result.tasks if t.trials), key=lambda t: -t.trials)
    for t in tuned:
        print(f"{t.name:48} {t.trials:>6} {t.best_us:>10.1f} {t.rule_us:>10.1f} {t.gflops:>8.2f}")
    print(
        f"{len(tuned)} of {len(result.tasks)} kernels have records; the others borrow from the nearest bucket or keep "
        "their rules"
    )
    for b in result.buckets:
        print(
            f"bucket {b['bucket']}: records {b['records_ms']:.3f} ms vs rules {b['rules_ms']:.3f} ms (side by side; "
            f"records / rules {b['ratio']:.3f} over paired rounds): {b['verdict']}"
        )
    common.write_json(
        args.json,
        {
            "target": target.config,
            "trials_run": result.trials_run,
            "trials_cached": result.trials_cached,
            "wall_s": result.wall_s,
            "failed": result.failed,
            "profile": result.profile,
            "ranking": result.ranking,
            "buckets": result.buckets,
            "tasks": [
                {
                    "name": t.name,
                    "trials": t.trials,
                    "best_us": t.best_us,
                    "rule_us": t.rule_us if t.rule_us == t.rule_us else None,
                    "gflops": t.gflops,
                }
                for t in result.tasks
            ],
        },
    )
    return 0
