"""Where a relaxtune language model's prefill and decode time goes on the GPU: every kernel of one call, summed by
name, recorded with torch.profiler (CUPTI sees the TVM VM's kernels, cuBLAS and CUDA-graph replays).

    S=$(bash scripts/device_install.sh) && export PYTHONPATH=$S:$PWD/benchmarks && \\
        python3 benchmarks/gpu_llm_profile.py --out $OUT/llmprof [--prefill 128,512] [--context 1024] [--quantize q4f16]

The model is gpu_llm.py's (the SmolLM2-sized random checkpoint, written there) built as gpu_llm.py builds it, with
CUDA graphs. Per call (the fastest of --reps): the span on the GPU from the first kernel's start to the last
one's end, the time inside kernels, the gaps, and the kernels by name (total us, count, share of the span).
Writes llm_profile.json and llm_profile.md to --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from gpu_llm import GROUP, MODELS, build
from gpu_profile import trace

from relaxtune.models import random_checkpoint


def by_name(call: list[dict]) -> dict:
    """The call's span, time in kernels and gaps (us), and its kernels summed by name, largest first."""
    span = call[-1]["ts"] + call[-1]["dur"] - call[0]["ts"]
    busy = sum(k["dur"] for k in call)
    names: dict = defaultdict(lambda: [0.0, 0])
    for k in call:
        names[k["name"][:100]][0] += k["dur"]
        names[k["name"][:100]][1] += 1
    rows = sorted(names.items(), key=lambda item: -item[1][0])
    return {
        "span_us": round(span, 1),
        "kernels_us": round(busy, 1),
        "gaps_us": round(span - busy, 1),
        "kernels": len(call),
        "by_name": [{"name": n, "us": round(us, 1), "count": c, "share": round(us / span, 3)} for n, (us, c) in rows],
    }


def markdown(results: dict, top: int) -> str:
    lines = ["# relaxtune LLM kernels on the GPU", "", "| call | span us | in kernels us | gaps us | kernels |"]
    lines.append("|---|---|---|---|---|")
    for key, r in results.items():
        lines.append(f"| {key} | {r['span_us']} | {r['kernels_us']} | {r['gaps_us']} | {r['kernels']} |")
    for key, r in results.items():
        lines += ["", f"## {key}", "", "| kernel | us | count | share of span |", "|---|---|---|---|"]
        lines += [f"| {k['name']} | {k['us']} | {k['count']} | {k['share']:.1%} |" for k in r["by_name"][:top]]
    return "\n".join(lines) + "\n"


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
    args = parser.parse_args()
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

        calls = trace(run, llm.device.sync, args.reps, tmp)
        results[f"prefill {n}"] = min((by_name(c) for c in calls), key=lambda r: r["span_us"])
    ids = rng.integers(100, vocab, args.context).tolist()
    llm.reset(capacity)
    llm.prefill(ids)
    calls = trace(lambda: llm.decode(int(ids[-1])), llm.device.sync, args.reps, tmp)
    results[f"decode @{args.context}"] = min((by_name(c) for c in calls), key=lambda r: r["span_us"])
    results = {f"{k} {args.quantize}".strip(): v for k, v in results.items()}
    (args.out / "llm_profile.json").write_text(json.dumps({"group": GROUP, "calls": results}, indent=1))
    (args.out / "llm_profile.md").write_text(markdown(results, args.top))
    print(markdown(results, args.top))


if __name__ == "__main__":
    main()
