"""relaxtune compile WORKLOAD --target cpu -o build/NAME.so"""

from __future__ import annotations

from pathlib import Path

from . import common


def add_arguments(parser) -> None:
    common.add_workload(parser)
    common.add_target(parser)
    common.add_cache(parser)
    common.add_memory_planner(parser)
    common.add_fusion(parser)
    common.add_gpu_options(parser)
    parser.add_argument(
        "-o", "--output", type=Path, required=True, help="the .so to write (params and manifest go beside it)"
    )
    parser.add_argument("--no-cache", action="store_true", help="ignore the cache: rule-based schedules only")


def run(args) -> int:
    from .. import api, targets
    from ..errors import UserError

    if args.output.suffix != ".so":
        raise UserError(f"--output {args.output} must end in .so")
    target = targets.resolve(args.target)
    job = common.job_config(args, use_cache=not args.no_cache)
    workload = common.load_workload(args)
    print(f"target: {target.json}")
    if args.buckets is None and job.compile.use_cache:
        tuned = api.tuned_buckets(workload, target, job)
        if tuned is not None:
            job = job.with_(buckets=tuned)
            print(
                "buckets: "
                + " ".join(f"{dim}={','.join(map(str, tops))}" for dim, tops in tuned.edges.items())
                + " as the cache was tuned (--buckets to choose others)"
            )
    result = api.compile(workload, target, job, args.output)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(result.schedules.items())) or "no kernel tuned"
    print(f"wrote {result.path} in {result.seconds:.1f} s (0 trials: compile never tunes); kernel calls: {counts}")
    return 0
