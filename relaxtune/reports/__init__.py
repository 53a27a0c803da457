"""Reports: `relaxtune report NAME ...`. Each report is one module here with `add_arguments(parser)`
and `run(args) -> int`, listed in REPORTS; it prints markdown, writes `--json PATH` when given,
and draws its plots as PNG beside the markdown."""

REPORTS: dict[str, str] = {  # name -> one-line description; module relaxtune.reports.<name>
    "memory": "activation memory plan at one shape: per tensor lifetime, size, offset; peaks vs TVM and the lower bound",
    "fusion": "kernels per call, the ops each holds and intermediate bytes at one shape: stock FuseOps vs relaxtune fusion",
    "tuning": "where tuning time went: best latency vs wall time per task and model, trials/s, failures, cost-model ranking",
}


def at_shape(args):
    """(target, workload, values) for a report at one shape: `--shape` values, every other
    dimension at its representative value, checked against the bounds."""
    from .. import targets
    from ..cli import common

    target = targets.resolve(args.target)
    workload = common.load_workload(args)
    given = {k: v[0] for k, v in common.parse_shapes(args.shape, many=False).items()}
    values = {d.name: given.get(d.name, d.representative) for d in workload.dims.values()}
    workload.check_shape({**values, **given})
    return target, workload, values


def save_markdown(args, report: str, workload, values: dict, text: str):
    """Print `text`, write it to `--out` as REPORT-WORKLOAD-<shape>.md; returns that path without suffix."""
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"{report}-{workload.name}-" + "-".join(f"{k}{v}" for k, v in values.items()))
    stem.with_suffix(".md").write_text(text)
    return stem
