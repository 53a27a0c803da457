"""fast_math: the vectorizable exp / erf / tanh / sigmoid the rules substitute for libm calls."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from scipy.special import erf, expit
from tvm import s_tir
from tvm.script import tirx as T

from relaxtune.schedules.rules import fast_math

SIZE = 1 << 16


def _unary(op):
    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((SIZE,), "float32"), c: T.Buffer((SIZE,), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for i in range(SIZE):
            with T.sblock("c"):
                vi = T.axis.spatial(SIZE, i)
                c[vi] = op(a[vi])

    return func


@pytest.mark.parametrize(
    "op, ref, lo, hi, tol",
    [
        (T.exp, np.exp, -86.0, 88.7, 2e-7),  # relative; results below 2^-125 are flushed to 0
        (T.erf, erf, -6.0, 6.0, 5e-7),  # absolute (|erf| <= 1)
        (T.tanh, np.tanh, -12.0, 12.0, 5e-7),
        (T.sigmoid, expit, -30.0, 30.0, 5e-7),
    ],
)
def test_accuracy_against_float64(kit, cpu_target, op, ref, lo, hi, tol):
    func = fast_math.rewrite(_unary(op))
    assert op.__name__ not in func.script().split("c[vi] =")[1]  # the call itself is gone
    sch = s_tir.Schedule(func)
    (loop,) = sch.get_loops(sch.get_sblock("c"))
    sch.vectorize(sch.split(loop, [None, 16])[1])
    lib = tvm.compile(sch.mod, target=cpu_target)
    x = np.concatenate([np.linspace(lo, hi, SIZE // 2), np.random.default_rng(0).standard_normal(SIZE // 2) * 3])
    x = x.astype("float32")
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib["main"](tvm.runtime.tensor(x), out)
    want = ref(x.astype("float64"))
    err = np.abs(out.numpy() - want)
    if op is T.exp:
        err = err / want
    assert err.max() < tol


def test_leaves_float16_and_other_calls_alone():
    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((8,), "float16"), c: T.Buffer((8,), "float16")):
        for i in range(8):
            with T.sblock("c"):
                vi = T.axis.spatial(8, i)
                c[vi] = T.exp(a[vi]) + T.sqrt(a[vi])

    script = fast_math.rewrite(func).script()
    assert "T.exp" in script and "T.sqrt" in script
