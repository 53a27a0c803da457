"""Every transformers architecture relaxtune's operators should cover: compiled and checked against torch, or
refused in one line (the message a user gets). One process per family, so a crash is a row too.

    python benchmarks/arch_table.py [--families llama,bert] [--json build/arch_table.json] [--out docs-table.md]

Each family is a tiny random model (`hf:TYPE`: hidden 64, 2 layers, 4 heads, vocab 128, n <= 64, b <= 2),
built with rule-based schedules (no cache), checked the way `relaxtune compile` checks before it writes an
artifact (`compiler.build.verify`), then against torch eager at (b, n) = (1, 1), (2, 7), (1, 64).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "opt",
    "bloom", "falcon", "stablelm", "starcoder2", "olmo", "bert", "roberta", "distilbert",
)  # fmt: skip
POINTS = ((1, 1), (2, 7), (1, 64))
CONFIG = {"max_seq": "64", "max_batch": "2"}


def check(family: str) -> dict:
    """One family's row (runs in this process)."""
    import numpy as np
    import tvm

    from relaxtune import api, targets, threads
    from relaxtune.compiler.build import verify
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.errors import UserError
    from relaxtune.measure.vm import VMRunner
    from relaxtune.runtime.artifact import relative_error
    from relaxtune.workloads import load

    threads.configure()
    row: dict = {"family": family}
    start = time.perf_counter()
    try:
        workload = load(f"hf:{family}", dict(CONFIG))
        executable, _, _ = api.build(
            workload, targets.resolve("cpu"), JobConfig(compile=CompileConfig(use_cache=False))
        )
        verify(executable, workload)
        runner = VMRunner.for_workload(executable, tvm.cpu(), workload)
        worst = 0.0
        for b, n in POINTS:
            inputs = workload.random_inputs({d: (n if d == "n" else b) for d in workload.dims})
            worst = max(worst, relative_error(runner.outputs(inputs), workload.reference(inputs, workload.params)))
        row.update(status="compiled", max_rel_error=worst, dims=sorted(workload.dims))
        row["checked"] = bool(np.isfinite(worst) and worst <= 1e-3)
    except UserError as err:
        row.update(status="refused", message=str(err))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| family | result | max error vs torch | s |", "|---|---|---|---|"]
    for r in rows:
        if r["status"] == "compiled":
            result = "compiled, checked" if r["checked"] else "compiled, WRONG"
            error = f"{r['max_rel_error']:.1e}"
        else:
            result, error = "refused: " + r.get("message", r["status"]).replace("|", "/"), "-"
        lines.append(f"| {r['family']} | {result} | {error} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's family
    args = parser.parse_args()
    if args.one:
        print(json.dumps(check(args.one)))
        return
    rows = []
    for family in [f for f in args.families.split(",") if f]:
        done = subprocess.run([sys.executable, __file__, "--one", family], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            rows.append(json.loads(lines[-1]))
        else:  # the process died: what it said last is the row
            tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            rows.append(
                {
                    "family": family,
                    "status": "crashed",
                    "message": f"exit {done.returncode}: {tail[:200]}",
                    "seconds": 0,
                }
            )
        print(json.dumps(rows[-1])[:300], flush=True)
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
