"""Reports on a workload, the cache or a tuning job: each module measures (`measure` or `analyse`),
writes markdown and draws PNG plots; `relaxtune report NAME` (cli/report_cmd.py) runs them."""
