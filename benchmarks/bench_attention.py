"""Fused vs decomposed attention, rule-based schedules only: interleaved A/B medians.

For each built-in block (`llama-block`, `gpt2-block`) and each n, two things are timed:
* `attention`: a module holding only the block's attention (q, k, v in; for llama the GQA
  `repeat` of k and v as the block has it), through the whole relaxtune pipeline;
* `block`: the whole block.
"fused" is the pipeline as is (FuseAttention: one online-softmax kernel); "decomposed" is the same
pipeline on the module with DecomposeAttention applied first (matmul / causal bias / softmax /
matmul kernels), so everything else is identical. A and B are called alternately, in rounds, and
the medians of each are compared in the same run (a loaded 2-core box: compare, do not quote).

    python benchmarks/bench_attention.py --n 1,128,512,1024 --json build/bench/attention.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, tirx

from relaxtune import api
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.measure.bench import interleaved
from relaxtune.relax_passes.decompose_attention import DecomposeAttention
from relaxtune.runtime.artifact import prepare_params
from relaxtune.targets import resolve
from relaxtune.workloads import load
from relaxtune.workloads.base import TensorSpec


def attention_only(workload):
    """The block's attention as its own workload: inputs q, k, v of the block's shapes."""
    cfg = workload.config
    heads = int(cfg["heads"])
    kv_heads = int(cfg.get("kv_heads", heads))
    head_dim = int(cfg["hidden"]) // heads
    dtype = str(cfg["dtype"])
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    q = relax.Var("q", relax.TensorType((b, n, heads, head_dim), dtype))
    k = relax.Var("k", relax.TensorType((b, n, kv_heads, head_dim), dtype))
    v = relax.Var("v", relax.TensorType((b, n, kv_heads, head_dim), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = k, v
            if kv_heads != heads:
                kk = bb.emit(relax.op.repeat(k, heads // kv_heads, axis=2))
                vv = bb.emit(relax.op.repeat(v, heads // kv_heads, axis=2))
            out = bb.emit_output(relax.op.nn.attention(q, kk, vv, causal_mask="TopLeft"))
        bb.emit_func_output(out)
    dims = workload.dims
    bounds = {"b": dims["b"].upper, "n": dims["n"].upper}
    lower = {"b": dims["b"].lower, "n": dims["n"].lower}
    func = bb.get()["main"].with_attrs({"tir_var_upper_bound": bounds, "tir_var_lower_bound": lower, "num_input": 3})
    inputs = (
        TensorSpec("q", ("b", "n", heads, head_dim), dtype),
        TensorSpec("k", ("b", "n", kv_heads, head_dim), dtype),
        TensorSpec("v", ("b", "n", kv_heads, head_dim), dtype),
    )
    return dataclasses.replace(
        workload, name=f"{workload.name}-attention", mod=tvm.IRModule({"main": func}), params={}, inputs=inputs
    )


def decomposed(workload):
    return dataclasses.replace(workload, mod=DecomposeAttention()(workload.mod))


def runner(executable, workload, values):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    inputs = workload.random_inputs(values, seed=0)
    args = [tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs]
    args += prepare_params(vm, [tvm.runtime.tensor(p) for p in workload.params.values()])
    return lambda: vm["main"](*args).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="llama-block,gpt2-block")
    parser.add_argument("--n", default="1,128,512,1024")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0, help="time per system per n, spread over the rounds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target = resolve("cpu")
    job = JobConfig(compile=CompileConfig(use_cache=False))
    rows = []
    for name in args.workloads.split(","):
        block = load(name)
        for part, workload in (("attention", attention_only(block)), ("block", block)):
            fused_ex, _, _ = api.build(workload, target, job)
            dec = decomposed(workload)
            dec_ex, _, _ = api.build(dec, target, job)
            for n in (int(v) for v in args.n.split(",")):
                values = {"b": 1, "n": n}
                fused, dec_fn = runner(fused_ex, workload, values), runner(dec_ex, dec, values)
                err = float(np.abs(fused() - dec_fn()).max())
                ms = interleaved({"fused": fused, "decomposed": dec_fn}, args.rounds, args.seconds / args.rounds)
                t_fused, t_dec = ms["fused"], ms["decomposed"]
                row = {
                    "workload": name,
                    "part": part,
                    "n": n,
                    "fused_ms": round(t_fused, 4),
                    "decomposed_ms": round(t_dec, 4),
                    "fused/decomposed": round(t_fused / t_dec, 3),
                    "max_abs_diff": err,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    print("\n| workload | part | n | fused ms | decomposed ms | fused/decomposed |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['part']} | {r['n']} | {r['fused_ms']:.3f} | {r['decomposed_ms']:.3f} | "
            f"{r['fused/decomposed']:.2f} |"
        )


if __name__ == "__main__":
    main()
