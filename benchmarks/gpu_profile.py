"""Every kernel of one 7B llama-block call, in sequence, on the GPU: relaxtune artifacts vs torch.compile.

    S=$(bash .device/install.sh) && export PYTHONPATH=$S:$PWD && \\
        python3 benchmarks/gpu_profile.py --art DIR --out $OUT --names llama7b-rf-cublas-flash-graph --n 2048

`--q4`: the q4f16 block (e.g. `--names llama7b-q4-rf-cublas-flash-graph --n 1`), torch on its weights dequantized.

`gpu_job.py run` times each kernel alone (re-run on its own arguments); this records the kernels of
back-to-back calls with torch.profiler (CUPTI sees the TVM VM's kernels, library calls and CUDA-graph
replays too) and reports, per system, the span of one call on the GPU, the time inside kernels, the
gaps between them, and each kernel's duration, with the torch.compile'd block (the same weights) for
comparison. Writes `profile.json` and `profile.md` to --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import gpu_job_common as common  # noqa: E402
from gpu_job_llama import Llama7B  # noqa: E402
from gpu_job_variants import Q4_GROUP  # noqa: E402


def trace_events(fn, sync, reps: int, tmp: Path) -> list[dict]:
    """The chrome-trace events of `reps` back-to-back calls of `fn` (after warm-up), each call inside a
    "relaxtune call" annotation: the kernels on the GPU, and the CUDA runtime / driver calls on the host."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            with record_function(CALL):
                fn()
        sync()
    path = tmp / "trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


CALL = "relaxtune call"


def host_calls(events: list[dict]) -> list[dict]:
    """Per call (its annotation), the host's time: wall us, us inside CUDA runtime / driver calls (by name, with
    counts), and the rest (the caller's own code: the VM, the runtime, Python)."""
    calls = sorted(
        (e for e in events if e.get("name") == CALL and e.get("cat") == "user_annotation" and "dur" in e),
        key=lambda e: e["ts"],
    )  # the host's annotations (the GPU's copies of them are "gpu_user_annotation")
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    result = []
    for c in calls:
        inside = [e for e in api if c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"]]
        names: dict = {}
        for e in inside:
            us, count = names.get(e["name"], (0.0, 0))
            names[e["name"]] = (us + e["dur"], count + 1)
        in_api = sum(e["dur"] for e in inside)
        result.append(
            {
                "wall_us": round(c["dur"], 1),
                "api_us": round(in_api, 1),
                "other_us": round(c["dur"] - in_api, 1),
                "api_calls": len(inside),
                "api_by_name": [
                    {"name": n, "us": round(us, 1), "count": k}
                    for n, (us, k) in sorted(names.items(), key=lambda item: -item[1][0])
                ],
            }
        )
    return result


def kernel_calls(events: list[dict], reps: int) -> list[list[dict]]:
    """The kernels (and copies) of the events, in order, split into `reps` calls of equal count."""
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
        key=lambda e: e["ts"],
    )
    per = len(kernels) // reps
    return [
        [{"name": e["name"], "ts": e["ts"], "dur": e["dur"]} for e in kernels[i * per : (i + 1) * per]]
        for i in range(reps)
    ]


def trace(fn, sync, reps: int, tmp: Path) -> list[list[dict]]:
    """The kernels of `reps` back-to-back calls of `fn` (after warm-up), split per call."""
    return kernel_calls(trace_events(fn, sync, reps, tmp), reps)


def totals(call: list[dict]) -> dict:
    """One call's span on the GPU (first kernel's start to last kernel's end), time in kernels and gaps (us)."""
    span = call[-1]["ts"] + call[-1]["dur"] - call[0]["ts"]
    busy = sum(k["dur"] for k in call)
    return {
        "span_us": round(span, 1),
        "kernels_us": round(busy, 1),
        "gaps_us": round(span - busy, 1),
        "kernels": len(call),
    }


def summary(calls: list[list[dict]]) -> dict:
    """The median call's span, time in kernels and gaps (us), and its kernels in order."""
    rows = [totals(call) for call in calls]
    order = sorted(range(len(rows)), key=lambda i: rows[i]["span_us"])
    median, pick = rows[order[len(order) // 2]], calls[order[len(order) // 2]]
    median["list"] = [
        {
            "name": k["name"][:90],
            "us": round(k["dur"], 1),
            "gap_before_us": round(k["ts"] - prev["ts"] - prev["dur"], 1) if i else 0.0,
        }
        for i, (k, prev) in enumerate(zip(pick, [pick[0], *pick[:-1]]))
    ]
    return median


def markdown(results: dict) -> str:
    lines = [
        "# in-sequence kernel profile",
        "",
        "| system | n | span us | in kernels us | gaps us | kernels |",
        "|---|---|---|---|---|---|",
    ]
    for (name, n), r in ((tuple(k.split("@")), v) for k, v in results.items()):
        lines.append(f"| {name} | {n} | {r['span_us']} | {r['kernels_us']} | {r['gaps_us']} | {r['kernels']} |")
    for key, r in results.items():
        lines += ["", f"## {key}", "", "| kernel | us | gap before |", "|---|---|---|"]
        lines += [f"| {k['name']} | {k['us']} | {k['gap_before_us']} |" for k in r["list"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--art", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--names", default="llama7b-rf-cublas-flash-graph", help="comma-separated artifacts in --art")
    parser.add_argument("--n", default="2048", help="comma-separated sequence lengths")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--q4", action="store_true", help="the q4f16 block (gpu_job_variants.Q4_VARIANTS' weights)")
    args = parser.parse_args()
    import torch

    from relaxtune.config import QuantizeConfig

    seqs = tuple(int(n) for n in args.n.split(","))
    common.SEQS = seqs
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    model = Llama7B(args.art, tmp, quantize=QuantizeConfig("q4f16", Q4_GROUP) if args.q4 else None)
    results = {}
    for name in [s for s in args.names.split(",") if s]:
        vm, params, dev = model.vm(name)
        main_fn = vm["main"]
        for n in seqs:
            x = model.tvm_args(n, dev)
            results[f"{name}@{n}"] = summary(trace(lambda: main_fn(x, *params), dev.sync, args.reps, tmp))  # noqa: F821 (del below)
            common.log(name, n, {k: v for k, v in results[f"{name}@{n}"].items() if k != "list"})
        del vm, params
    compiled = torch.compile(model.block, dynamic=False)
    with torch.no_grad():
        for n in seqs:
            results[f"torch.compile@{n}"] = summary(
                trace(lambda: compiled(model.x[n]), torch.cuda.synchronize, args.reps, tmp)
            )
            common.log("torch.compile", n, {k: v for k, v in results[f"torch.compile@{n}"].items() if k != "list"})
    (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    (args.out / "profile.md").write_text(markdown(results))
    common.log(markdown(results))


if __name__ == "__main__":
    main()
