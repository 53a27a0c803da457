"""Reports: `relaxtune report NAME ...`. Each report is one module here with `add_arguments(parser)`
and `run(args) -> int`, listed in REPORTS; it prints markdown, writes `--json PATH` when given,
and draws its plots as PNG beside the markdown."""

REPORTS: dict[str, str] = {  # name -> one-line description; module relaxtune.reports.<name>
    "memory": "activation memory plan at one shape: per tensor lifetime, size, offset; peaks vs TVM and the lower bound",
    "fusion": "kernels per call, the ops each holds and intermediate bytes at one shape: stock FuseOps vs relaxtune fusion",
    "tuning": "where tuning time went: best latency vs wall time per task and model, trials/s, failures, cost-model ranking",
}
