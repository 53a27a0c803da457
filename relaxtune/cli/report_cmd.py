"""relaxtune report NAME ...: parse, then run the report of relaxtune.reports.NAME."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from . import common

HELP = {  # name -> one-line description
    "memory": "activation memory plan at one shape: per tensor lifetime, size, offset; peaks vs TVM, lower bound",
    "fusion": "kernels per call, the ops each holds and intermediate bytes at one shape: stock vs relaxtune fusion",
    "tuning": "where tuning time went: best latency vs wall time per task and model, trials/s, failures, ranking",
}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="report", required=True, metavar="REPORT")
    for name in ("memory", "fusion"):
        report = sub.add_parser(name, help=HELP[name], description=HELP[name])
        common.add_workload(report)
        common.add_target(report)
        common.add_shape(report, many=False)
        report.add_argument("--out", type=Path, default=Path("build/reports"), help="folder for the markdown and plots")
        report.add_argument("--json", type=Path, default=None, help="write the report's figures as JSON")
    tuning = sub.add_parser("tuning", help=HELP["tuning"], description=HELP["tuning"])
    common.add_cache(tuning, buckets=False)
    tuning.add_argument("--target", default=None, help="only this target's folder (cpu, cuda, JSON); default: all")
    tuning.add_argument("--out", type=Path, default=Path("build/reports"), help="folder for the markdown and plots")
    tuning.add_argument("--json", type=Path, default=None, help="write the figures as JSON")


def run(args) -> int:
    return {"memory": _memory, "fusion": _fusion, "tuning": _tuning}[args.report](args)


def _at_shape(args):
    """(target, workload, values): `--shape` values, every other dimension at its representative value."""
    from .. import targets

    target = targets.resolve(args.target)
    workload = common.load_workload(args)
    given = {k: v[0] for k, v in common.parse_shapes(args.shape, many=False).items()}
    values = {d.name: given.get(d.name, d.representative) for d in workload.dims.values()}
    workload.check_shape({**values, **given})
    return target, workload, values


def _save_markdown(args, report: str, workload, values: dict, text: str) -> Path:
    """Print `text`, write it to `--out` as REPORT-WORKLOAD-<shape>.md; returns that path without suffix."""
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"{report}-{workload.name}-" + "-".join(f"{k}{v}" for k, v in values.items()))
    stem.with_suffix(".md").write_text(text)
    return stem


def _fusion(args) -> int:
    from ..reports import fusion

    target, workload, values = _at_shape(args)
    result = fusion.measure(workload, target, values)
    stem = _save_markdown(args, "fusion", workload, values, fusion.markdown(workload.name, values, result))
    common.write_json(args.json, {"workload": workload.name, "shape": values, **result})
    print(f"saved {stem}.md")
    return 0


def _memory(args) -> int:
    from ..reports import memory

    target, workload, values = _at_shape(args)
    result = memory.measure(workload, target, values)
    stem = _save_markdown(args, "memory", workload, values, memory.markdown(workload.name, values, result))
    memory.plot(result, stem.with_suffix(".png"), f"{workload.name} {result['function']} at {values}")
    common.write_json(args.json, {"workload": workload.name, "shape": values, **result})
    print(f"saved {stem}.md and .png")
    return 0 if not result["problems"] else 1


def _tuning(args) -> int:
    from ..reports import tuning

    args.cache = common.cache_dir(args)
    sources = tuning.event_files(args.cache, args.target)
    jobs = [j for j in (tuning.read_job(p) for p in sources) if j is not None]
    if not jobs:
        raise UserError(f"no complete tuning job in {len(sources)} events file(s) under {args.cache}")
    result = tuning.analyse(jobs)
    text = tuning.markdown(result, sources)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tuning.md").write_text(text)
    pngs = tuning.plot(result, args.out)
    common.write_json(args.json, {k: v for k, v in result.items() if k != "curves"})
    print(f"saved {args.out / 'tuning.md'}, {', '.join(p.name for p in pngs)}")
    return 0
