"""Benchmark the CPU schedule rules against stock TVM and numpy.

Run: ``python benchmarks/bench_rules.py [--n 1 32 128] [--threads 1] [--numpy-threads K]``

For each kernel (a Relax module with a symbolic ``n``) and each ``n`` it prints the median time
(lowest median of 3 rounds of 15 samples, to see past other jobs on a shared machine) of
  * naive: stock ``tvm.compile`` (default pipeline: no fusion, no schedule), skipped when one call
    already takes so long that the repeats would exceed ~5 s,
  * rules: LegalizeOps -> AnnotateTIROpPattern -> FuseOps -> FuseTIR -> ``apply_cpu_rules`` -> compile,
  * numpy (float32, the same math),
as a markdown table with ratios against numpy (lower is better).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

logger = logging.getLogger(__name__)

HIDDEN, FFN, HEADS = 256, 704, 8
RMS_HIDDEN = 2048
NAIVE_BUDGET_S = 5.0
REPEAT, ROUNDS = 15, 3  # a time is the lowest of ROUNDS medians of REPEAT samples (shared, noisy CPUs)


def _matmul_mod():
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, HIDDEN), "float32"))
    w = relax.Var("w", relax.TensorType((HIDDEN, FFN), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(out)
    return bb.get()


def _softmax_mod():
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    s = relax.Var("s", relax.TensorType((1, HEADS, n, n), "float32"))
    mask = relax.Var("mask", relax.TensorType((n, n), "float32"))
    with bb.function("main", [s, mask]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(relax.op.add(s, mask), axis=-1))
        bb.emit_func_output(out)
    return bb.get()


def _rms_norm_mod():
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, RMS_HIDDEN), "float32"))
    g = relax.Var("g", relax.TensorType((RMS_HIDDEN,), "float32"))
    with bb.function("main", [x, g]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
        bb.emit_func_output(out)
    return bb.get()


def _np_softmax(s, mask):
    z = s + mask
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _np_rms_norm(x, g):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


KERNELS = {
    f"matmul 1xnx{HIDDEN} @ {HIDDEN}x{FFN}": (
        _matmul_mod,
        lambda n, rng: [rng.standard_normal((1, n, HIDDEN)), rng.standard_normal((HIDDEN, FFN))],
        lambda x, w: x @ w,
    ),
    f"softmax(s + mask) 1x{HEADS}xnxn": (
        _softmax_mod,
        lambda n, rng: [rng.standard_normal((1, HEADS, n, n)), np.triu(np.full((n, n), -1e9), 1)],
        _np_softmax,
    ),
    f"rms_norm 1xnx{RMS_HIDDEN}": (
        _rms_norm_mod,
        lambda n, rng: [rng.standard_normal((1, n, RMS_HIDDEN)), rng.standard_normal((RMS_HIDDEN,))],
        _np_rms_norm,
    ),
}


def _fuse(mod, target):
    import tvm
    from tvm import relax

    seq = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
        ]
    )
    with target:
        return seq(mod)


def _time_vm(vm, args, budget_s: float | None = None) -> float | None:
    """Median seconds of ``vm['main'](*args)``; None when one call exceeds the naive budget."""
    import tvm

    start = time.perf_counter()
    vm["main"](*args)
    once = time.perf_counter() - start
    if budget_s is not None and once * 5 > budget_s:
        return None if once > budget_s else once
    number = max(1, min(200, int(0.02 / max(once, 1e-7))))
    timer = vm.time_evaluator("main", tvm.cpu(), number=number, repeat=REPEAT)
    return min(float(np.median(timer(*args).results)) for _ in range(ROUNDS))


def _time_numpy(fn, args) -> float:
    fn(*args)
    start = time.perf_counter()
    fn(*args)
    once = time.perf_counter() - start
    number = max(1, min(200, int(0.02 / max(once, 1e-7))))
    medians = []
    for _ in range(ROUNDS):
        samples = []
        for _ in range(REPEAT):
            start = time.perf_counter()
            for _ in range(number):
                fn(*args)
            samples.append((time.perf_counter() - start) / number)
        medians.append(float(np.median(samples)))
    return min(medians)


def run(ns: list[int], target_config: dict) -> list[dict]:
    import tvm
    from tvm import relax

    from . import apply_cpu_rules

    target = tvm.target.Target(target_config)
    dev = tvm.cpu()
    rows = []
    for name, (make, inputs, ref) in KERNELS.items():
        cases = []
        for n in ns:
            np_args = [a.astype("float32") for a in inputs(n, np.random.default_rng(n))]
            cases.append((n, np_args, _time_numpy(ref, np_args)))
        mod = make()
        naive_vm = relax.VirtualMachine(tvm.compile(mod, target=target), dev)
        rules_vm = relax.VirtualMachine(tvm.compile(apply_cpu_rules(_fuse(mod, target), target), target=target), dev)
        naive_blown = False
        for n, np_args, np_time in cases:
            tvm_args = [tvm.runtime.tensor(a, dev) for a in np_args]
            expect = ref(*np_args)
            got = rules_vm["main"](*tvm_args).numpy()
            err = float(np.abs(got - expect).max() / max(1.0, np.abs(expect).max()))
            naive = None if naive_blown else _time_vm(naive_vm, tvm_args, NAIVE_BUDGET_S)
            naive_blown = naive is None
            rows.append(
                {
                    "kernel": name,
                    "n": n,
                    "naive": naive,
                    "rules": _time_vm(rules_vm, tvm_args),
                    "numpy": np_time,
                    "err": err,
                }
            )
            logger.info("%s n=%d done", name, n)
    return rows


def to_markdown(rows: list[dict]) -> str:
    def us(sec):
        return "skipped" if sec is None else f"{sec * 1e6:,.1f}"

    def ratio(a, b):
        return "-" if a is None else f"{a / b:.2f}x"

    lines = [
        "| kernel | n | naive (us) | rules (us) | numpy (us) | naive / numpy | rules / numpy | rel. err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['n']} | {us(r['naive'])} | {us(r['rules'])} | {us(r['numpy'])} | "
            f"{ratio(r['naive'], r['numpy'])} | {ratio(r['rules'], r['numpy'])} | {r['err']:.1e} |"
        )
    return "\n".join(lines)


def _set_numpy_threads(count: int) -> bool:
    """Best effort: cap numpy's bundled OpenBLAS at ``count`` threads (no threadpoolctl here)."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas*.so*"))
    for path in libs:
        lib = ctypes.CDLL(path)
        for symbol in (
            "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads",
            "openblas_set_num_threads",
        ):
            if hasattr(lib, symbol):
                getattr(lib, symbol)(ctypes.c_int(count))
                return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 32, 128], help="values of the symbolic n")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for TVM (num-cores) and numpy. Default 1: on a shared VM an idle "
        "vCPU took ~16 ms to wake, which made 2-thread OpenBLAS calls take 16 ms for seconds",
    )
    parser.add_argument(
        "--numpy-threads", type=int, default=None, help="OpenBLAS threads for numpy (default: same as --threads)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    np_threads = args.numpy_threads or args.threads
    capped = _set_numpy_threads(np_threads)
    from tvm.target import codegen

    config = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": args.threads}
    rows = run(args.n, config)
    blas = f"{np_threads} OpenBLAS threads" if capped else "default OpenBLAS threads"
    sys.stdout.write(
        f"target: {config}, TVM threads: {os.environ['TVM_NUM_THREADS']}, numpy: {blas}\n\n{to_markdown(rows)}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
