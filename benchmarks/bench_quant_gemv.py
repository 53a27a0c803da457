"""The decode GEMVs over quantized weights (SmolLM2's shapes), one kernel at a time: as the QuantGemv rule
schedules them (float32 FMAs on dequantized registers) and, where the host has VNNI, the int8 kernel
(`kernels/quant_dot_tir.py`: activations quantized per 32, ``vpdpbusd``). CPU time per call
(time.process_time, best of --rounds rounds of --number calls, the two kernels alternating round by
round, warm caches) and the weight bytes read per second.

    TVM_NUM_THREADS=1 python benchmarks/bench_quant_gemv.py [--rounds 7] [--number 200] [--tile 4]

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


def kernel(name: str, rows: int, cols: int, target, int8: bool = False, tile: int = 4):
    import tvm
    from tvm import te

    from relaxtune.kernels import quant_formats as qf
    from relaxtune.kernels import quant_tir
    from relaxtune.schedules.rules import apply_cpu_rules

    fmt = qf.format_named(name)
    if int8:
        from relaxtune.kernels import quant_dot_tir

        func = quant_dot_tir.gemv(fmt, rows, cols, tile, form=quant_dot_tir.dot_form(target))
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.compile(mod, target=target)["main"], fmt
    x = te.placeholder((1, 1, cols), "float32", name="x")
    parts = {p: te.placeholder(s, d, name=p) for p, (s, d) in fmt.shapes(rows, cols).items()}
    func = te.create_prim_func([x, *parts.values(), quant_tir.linear(fmt, x, parts)]).with_attr("global_symbol", "main")
    mod = apply_cpu_rules(tvm.IRModule({"main": func}), target)
    return tvm.compile(mod, target=target)["main"], fmt


def cpu_seconds(fns, args, number: int, rounds: int, clock=time.process_time) -> list[float]:
    """Best seconds (of `clock`) per call of each of `fns` on `args`, the functions alternating round by round."""
    for fn in fns:
        fn(*args)
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = clock()
            for _ in range(number):
                fn(*args)
            best[i] = min(best[i], (clock() - start) / number)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--tile", type=int, default=4, help="output rows per task of the int8 kernel")
    parser.add_argument("--wall", action="store_true", help="wall time (several threads), not CPU time")
    args = parser.parse_args()
    import tvm
    from tvm.target import codegen

    from relaxtune import threads
    from relaxtune.kernels import quant_dot_tir
    from relaxtune.kernels import quant_formats as qf

    threads.configure()
    target = tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": 2})
    rng = np.random.default_rng(0)
    form = quant_dot_tir.dot_form(target)  # vnni, or avx2 (4-bit weights only)
    print(f"int8 dot products: {form or 'none'}")
    unit = "wall" if args.wall else "CPU"
    print(
        f"| kernel | float32 us ({unit}) | GB/s | int8 us ({unit}) | GB/s | int8 / float32 |\n|---|---|---|---|---|---|"
    )
    for name, rows, cols in SHAPES:
        fn, fmt = kernel(name, rows, cols, target)
        int8 = form == "vnni" or (form == "avx2" and name.startswith("q4"))
        fns = [fn] + ([kernel(name, rows, cols, target, True, args.tile)[0]] if int8 else [])
        bits, group = (4, 32) if name.startswith("q4") else (8, 32)
        parts = qf.quantize(qf.own_format(bits, group), rng.standard_normal((rows, cols)))
        if fmt.has_min:  # Q4_1: the symmetric blocks plus a zero min, the same bytes and arithmetic
            parts = {**parts, "min": np.zeros_like(parts["scale"])}
        tensors = [tvm.runtime.tensor(rng.standard_normal((1, 1, cols)).astype("float32"))]
        tensors += [tvm.runtime.tensor(parts[p]) for p in fmt.part_names]
        tensors.append(tvm.runtime.tensor(np.zeros((1, 1, rows), "float32")))
        number = max(3, args.number * 576 * 3072 // (rows * cols))
        clock = time.perf_counter if args.wall else time.process_time
        seconds = cpu_seconds(fns, tensors, number, args.rounds, clock)
        nbytes = fmt.nbytes(rows, cols)
        cells = [f"{s * 1e6:.1f} | {nbytes / s / 1e9:.1f}" for s in seconds] + ["- | -"] * (2 - len(seconds))
        ratio = f"{seconds[1] / seconds[0]:.2f}" if len(seconds) == 2 else "-"
        print(f"| {name} {rows} x {cols} | {' | '.join(cells)} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
