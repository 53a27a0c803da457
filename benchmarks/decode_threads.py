"""Decode time per token of a compiled language model under thread settings of TVM's runtime, run in turns
(one process per run, the settings alternating) so that load on a shared machine falls on all alike.

    python benchmarks/decode_threads.py build/smollm2.so [--turns 5] [--rounds 3] \\
        [--setting pinned:TVM_BIND_THREADS=1 --setting unpinned:TVM_BIND_THREADS=0 --setting one:TVM_NUM_THREADS=1]

Each run: a 128-token prompt prefilled, then --rounds times 32 decode steps timed (wall and process CPU time);
prints each setting's per-run medians in ms per token. Settings are NAME:VAR=VALUE[,VAR=VALUE]; TVM_NUM_THREADS
defaults to 2. Figures: docs/results.md ("Quantized weights (CPU)").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT = ("pinned:TVM_BIND_THREADS=1", "unpinned:TVM_BIND_THREADS=0", "one:TVM_NUM_THREADS=1")


def worker(artifact: str, rounds: int) -> None:
    import numpy as np

    from relaxtune import LLM

    llm = LLM(artifact)
    ids = np.random.default_rng(0).integers(100, int(llm.model["vocab_size"]) - 1000, 128).tolist()
    wall, cpu = [], []
    for _ in range(rounds):
        llm.reset(len(ids) + 33)
        llm.prefill(ids)
        start, start_cpu = time.perf_counter(), time.process_time()
        for token in ids[:32]:
            llm.decode(token)
        wall.append((time.perf_counter() - start) / 32 * 1e3)
        cpu.append((time.process_time() - start_cpu) / 32 * 1e3)
    print(json.dumps({"wall": statistics.median(wall), "cpu": statistics.median(cpu)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", action="append", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.artifact, args.rounds)
        return 0
    settings = {}
    for item in args.setting or DEFAULT:
        name, _, assigns = item.partition(":")
        settings[name] = {"TVM_NUM_THREADS": "2"} | dict(a.split("=", 1) for a in assigns.split(",") if a)
    results = {name: [] for name in settings}
    for _ in range(args.turns):
        for name, env in settings.items():
            command = [sys.executable, __file__, args.artifact, "--rounds", str(args.rounds), "--worker"]
            out = subprocess.run(command, env=os.environ | env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| setting | wall ms/token per run (sorted) | CPU ms/token |\n|---|---|---|")
    for name, runs in results.items():
        walls = " ".join(f"{r['wall']:.1f}" for r in sorted(runs, key=lambda r: r["wall"]))
        cpus = " ".join(f"{r['cpu']:.1f}" for r in sorted(runs, key=lambda r: r["wall"]))
        print(f"| {name} | {walls} | {cpus} |")
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
