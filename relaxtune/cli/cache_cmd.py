"""relaxtune cache ls | show | merge | prune"""

from __future__ import annotations

from pathlib import Path

from . import common


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("ls", help="one line per tuned kernel: target, bucket, best and rule-based time")
    ls.add_argument("--cache", type=Path, default=None, help=common.CACHE_HELP)
    ls.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    show = sub.add_parser("show", help="the best record of a kernel: its trace and IR")
    show.add_argument("kernel", help="a key (or its prefix) or a kernel name from `cache ls`")
    show.add_argument("--cache", type=Path, default=None, help=common.CACHE_HELP)
    merge = sub.add_parser("merge", help="union of caches into one, without duplicates")
    merge.add_argument("sources", type=Path, nargs="+", help="cache folders to read")
    merge.add_argument("--into", type=Path, required=True, help="the cache to add them to")
    prune = sub.add_parser("prune", help="keep the best records per kernel (the originals stay as *.bak)")
    prune.add_argument("--cache", type=Path, default=None, help=common.CACHE_HELP)
    prune.add_argument("--keep", type=int, default=1)


def run(args) -> int:
    from ..schedules import cache_tools

    if args.action in ("ls", "show", "prune"):
        args.cache = common.cache_dir(args)
    if args.action == "ls":
        rows = cache_tools.list_records(args.cache)
        print(f"{'kernel':40} {'workload':12} {'bucket':28} {'best us':>10} {'rules us':>10} {'trials':>6}  key")
        for r in rows:
            best = f"{r['best_us']:.1f}" if r["best_us"] is not None else "-"
            rule = f"{r['rule_us']:.1f}" if r["rule_us"] is not None else "-"
            bucket = ",".join(f"{d}{lo}..{hi}" for d, (lo, hi, _) in (r["bucket"] or {}).items()) or "?"
            print(f"{r['kernel']:40} {r['workload']:12} {bucket:28} {best:>10} {rule:>10} {r['trials']:>6}  {r['key']}")
        print(f"{len(rows)} kernels in {args.cache}")
        common.write_json(args.json, {"records": rows})
    elif args.action == "show":
        print(cache_tools.show(args.cache, args.kernel))
    elif args.action == "merge":
        added = cache_tools.merge(args.sources, args.into)
        print(f"merged {len(args.sources)} cache(s) into {args.into}: {added} new records")
    else:
        before, after = cache_tools.prune(args.cache, args.keep)
        print(
            f"pruned {args.cache}: {before} records -> {after} (best {args.keep} per kernel; originals kept as *.bak)"
        )
    return 0
