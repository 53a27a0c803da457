"""The decode GEMVs over quantized weights (SmolLM2's shapes) as the QuantGemv rule schedules them, one
kernel at a time: CPU time per call (time.process_time, best of --rounds rounds of --number calls, warm
caches) and the weight bytes read per second.

    TVM_NUM_THREADS=1 python benchmarks/bench_quant_gemv.py [--rounds 7] [--number 200]

Figures: docs/results.md ("Quantized weights (CPU)").
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

SHAPES = (  # (format, out features, in features): SmolLM2-135M's qkv, o, gate/up, down, tied output
    ("q4_1", 960, 576),
    ("q4_1", 576, 576),
    ("q4_1", 3072, 576),
    ("q4_1", 576, 1536),
    ("q8_0", 49152, 576),
)


def kernel(name: str, rows: int, cols: int, target):
    import tvm
    from tvm import te

    from relaxtune.kernels import quant_formats as qf
    from relaxtune.kernels import quant_tir
    from relaxtune.schedules.rules import apply_cpu_rules

    fmt = qf.format_named(name)
    x = te.placeholder((1, 1, cols), "float32", name="x")
    parts = {p: te.placeholder(s, d, name=p) for p, (s, d) in fmt.shapes(rows, cols).items()}
    func = te.create_prim_func([x, *parts.values(), quant_tir.linear(fmt, x, parts)]).with_attr("global_symbol", "main")
    mod = apply_cpu_rules(tvm.IRModule({"main": func}), target)
    return tvm.compile(mod, target=target)["main"], fmt


def cpu_seconds(fn, args, number: int, rounds: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(number):
            fn(*args)
        best = min(best, (time.process_time() - start) / number)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=200)
    args = parser.parse_args()
    import tvm
    from tvm.target import codegen

    from relaxtune import threads
    from relaxtune.kernels import quant_formats as qf

    threads.configure()
    target = tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": 2})
    rng = np.random.default_rng(0)
    print("| kernel | us per call (CPU) | weight GB/s |\n|---|---|---|")
    for name, rows, cols in SHAPES:
        fn, fmt = kernel(name, rows, cols, target)
        bits, group = (4, 32) if name.startswith("q4") else (8, 32)
        parts = qf.quantize(qf.own_format(bits, group), rng.standard_normal((rows, cols)))
        if fmt.has_min:  # Q4_1: the symmetric blocks plus a zero min, the same bytes and arithmetic
            parts = {**parts, "min": np.zeros_like(parts["scale"])}
        tensors = [tvm.runtime.tensor(rng.standard_normal((1, 1, cols)).astype("float32"))]
        tensors += [tvm.runtime.tensor(parts[p]) for p in fmt.part_names]
        tensors.append(tvm.runtime.tensor(np.zeros((1, 1, rows), "float32")))
        number = max(3, args.number * 576 * 3072 // (rows * cols))
        seconds = cpu_seconds(fn, tensors, number, args.rounds)
        nbytes = fmt.nbytes(rows, cols)
        print(f"| {name} {rows} x {cols} | {seconds * 1e6:.1f} | {nbytes / seconds / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
