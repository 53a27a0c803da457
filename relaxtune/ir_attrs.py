"""Names of the IR attributes one stage writes and a later stage (in another layer) reads."""

# on each bucket function (relax_passes/bucket_dispatch.py): {dim: [lo, hi, tune_at]}; read by
# task extraction (schedules/tasks.py), the library rewrites and the reports
BUCKET_ATTR = "relaxtune.bucket"
