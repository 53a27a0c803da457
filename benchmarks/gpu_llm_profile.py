"""Where a relaxtune language model's prefill and decode time goes on the GPU: every kernel of one call, summed by
name, recorded with torch.profiler (CUPTI sees the TVM VM's kernels, cuBLAS and CUDA-graph replays).

    S=$(bash scripts/device_install.sh) && export PYTHONPATH=$S:$PWD/benchmarks && \\
        python3 benchmarks/gpu_llm_profile.py --out $OUT/llmprof [--prefill 128,512] [--context 1024] [--quantize q4f16]

The model is gpu_llm.py's (the SmolLM2-sized random checkpoint, written there) built as gpu_llm.py builds it, with
CUDA graphs. Per call (the fastest of --reps): the span on the GPU from the first kernel's start to the last
one's end, the time inside kernels, the gaps, and the kernels by name (total us, count, share of the span).
The host's side of each call (the fastest of --reps, inside a torch.profiler annotation): its wall time, the time
inside CUDA runtime / driver calls by name, and the rest (the VM, the runtime, Python).
Writes llm_profile.json, llm_profile.md and llm_profile.png (each call's span split into what its kernels do) to
--out; `--plot LABEL=JSON ...` draws profiles already taken (no GPU), e.g. before and after a change.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from gpu_llm import GROUP, MODELS, build
from gpu_profile import host_calls, kernel_calls, totals, trace_events

from relaxtune.models import random_checkpoint


def by_name(call: list[dict]) -> dict:
    """The call's span, time in kernels and gaps (us, gpu_profile.totals), and its kernels summed by name, largest
    first."""
    result = totals(call)
    span = call[-1]["ts"] + call[-1]["dur"] - call[0]["ts"]
    names: dict = defaultdict(lambda: [0.0, 0])
    for k in call:
        entry = names[k["name"][:100]]
        entry[0] += k["dur"]
        entry[1] += 1
    rows = sorted(names.items(), key=lambda item: -item[1][0])
    result["by_name"] = [
        {"name": n, "us": round(us, 1), "count": c, "share": round(us / span, 3)} for n, (us, c) in rows
    ]
    return result


def profiled(fn, sync, reps: int, tmp: Path) -> dict:
    """`by_name` of the call with the shortest GPU span, and `host`: the host's side of the call with the shortest
    wall time (gpu_profile.host_calls)."""
    events = trace_events(fn, sync, reps, tmp)
    result = min((by_name(c) for c in kernel_calls(events, reps)), key=lambda r: r["span_us"])
    host = host_calls(events)
    if host:
        result["host"] = min(host, key=lambda h: h["wall_us"])
    return result


def markdown(results: dict, top: int) -> str:
    lines = ["# relaxtune LLM kernels on the GPU", "", "| call | span us | in kernels us | gaps us | kernels |"]
    lines.append("|---|---|---|---|---|")
    for key, r in results.items():
        lines.append(f"| {key} | {r['span_us']} | {r['kernels_us']} | {r['gaps_us']} | {r['kernels']} |")
    lines += ["", "## The host", ""]
    lines.append("| call | wall us | in CUDA API calls us (calls) | the rest us | largest API calls |")
    lines.append("|---|---|---|---|---|")
    for key, r in results.items():
        if "host" in r:
            h = r["host"]
            largest = ", ".join(f"{a['name']} {a['us']} ({a['count']})" for a in h["api_by_name"][:4])
            lines.append(f"| {key} | {h['wall_us']} | {h['api_us']} ({h['api_calls']}) | {h['other_us']} | {largest} |")
    for key, r in results.items():
        lines += ["", f"## {key}", "", "| kernel | us | count | share of span |", "|---|---|---|---|"]
        lines += [f"| {k['name']} | {k['us']} | {k['count']} | {k['share']:.1%} |" for k in r["by_name"][:top]]
    return "\n".join(lines) + "\n"


# what a kernel does, by its name (TVM's, cuBLAS's and relaxtune's kernels), with its colour in the plot
KINDS = [
    ("prefill attention", ("batch_prefill", "relaxtune_flash"), "#d62728"),
    ("decode attention", ("batch_decode", "relaxtune_paged_decode"), "#ff9f40"),
    ("GEMM / GEMV", ("nvjet", "cublas", "gemm", "relaxtune_gemv", "relaxtune_q4"), "#1f77b4"),
    ("dequantize", ("dequantize",), "#9467bd"),
    ("other kernels", ("",), "#9e9e9e"),
]
GAPS = ("gaps (the host)", "#e0e0e0")


def kind(name: str) -> str:
    return next(label for label, prefixes, _ in KINDS if any(p in name for p in prefixes))


def plot(profiles: dict, path: Path) -> None:
    """One bar per (label, call): its span split into the time of each kind of kernel and the gaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{label}: {call}", r) for label, calls in profiles.items() for call, r in calls.items()]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    for y, (_, r) in enumerate(rows):
        left = 0.0
        for label, _, color in KINDS:
            us = sum(k["us"] for k in r["by_name"] if kind(k["name"]) == label)
            ax.barh(y, us / 1e3, left=left, color=color)
            left += us / 1e3
        ax.barh(y, r["gaps_us"] / 1e3, left=left, color=GAPS[1])
        ax.text(left + r["gaps_us"] / 1e3, y, f" {r['span_us'] / 1e3:.2f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms on the GPU per call (span: first kernel's start to last kernel's end)")
    handles = [matplotlib.patches.Patch(color=c, label=label) for label, _, c in KINDS]
    ax.legend(handles=[*handles, matplotlib.patches.Patch(color=GAPS[1], label=GAPS[0])], fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_llm"), help="checkpoint and artifacts")
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    parser.add_argument("--prefill", default="128,512", help="prompt lengths")
    parser.add_argument("--context", type=int, default=1024, help="the context before the profiled decode step")
    parser.add_argument("--quantize", default="", choices=("", "q4f16"), help="relaxtune's 4-bit build")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="kernel names listed per call")
    parser.add_argument("--plot", nargs="+", metavar="LABEL=JSON", help="draw these profiles into --out, no GPU")
    args = parser.parse_args()
    if args.plot:
        args.out.mkdir(parents=True, exist_ok=True)
        profiles = {}
        for spec in args.plot:
            label, sep, path = spec.partition("=")
            if not sep or not Path(path).is_file():
                parser.error(f"--plot {spec!r}: expected LABEL=JSON with JSON an llm_profile.json")
            profiles[label] = json.loads(Path(path).read_text())["calls"]
        plot(profiles, args.out / "llm_profile.png")
        return
    import numpy as np
    import torch  # noqa: F401 (CUDA initialised for the profiler)

    from relaxtune import LLM

    prefill = [int(n) for n in args.prefill.split(",") if n]
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.work / f"{args.model}-float16"
    if not (folder / "config.json").exists():
        random_checkpoint.write(folder, MODELS[args.model], "float16")
    tops = tuple(sorted({1, 16, *prefill, args.context}))
    artifact = build(folder, args.work, "cuda", True, tops, args.quantize)
    llm = LLM(artifact, device="cuda")
    capacity = max([*prefill, args.context]) + 64
    llm.reset(capacity)
    rng = np.random.default_rng(0)
    vocab = MODELS[args.model]["vocab_size"]
    tmp = Path(tempfile.mkdtemp())
    results = {}
    for n in prefill:
        ids = rng.integers(100, vocab, n).tolist()

        def run(ids=ids):
            llm.reset(len(ids) + 1)
            llm.prefill(ids)

        results[f"prefill {n}"] = profiled(run, llm.device.sync, args.reps, tmp)
    ids = rng.integers(100, vocab, args.context).tolist()
    llm.reset(capacity)
    llm.prefill(ids)
    results[f"decode @{args.context}"] = profiled(lambda: llm.decode(int(ids[-1])), llm.device.sync, args.reps, tmp)
    results = {f"{k} {args.quantize}".strip(): v for k, v in results.items()}
    (args.out / "llm_profile.json").write_text(json.dumps({"group": GROUP, "calls": results}, indent=1))
    (args.out / "llm_profile.md").write_text(markdown(results, args.top))
    plot({args.quantize or "f16": results}, args.out / "llm_profile.png")
    print(markdown(results, args.top))


if __name__ == "__main__":
    main()
