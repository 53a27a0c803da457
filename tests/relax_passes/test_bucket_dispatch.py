"""BucketDispatch: the bucket plan, the structure it builds, and the numbers it computes."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relaxtune.errors import UserError
from relaxtune.relax_passes.bucket_dispatch import BUCKET_ATTR, Bucket, BucketDispatch, plan_buckets


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("b", "n", 16), "float32"), w: R.Tensor((16, 8), "float32")) -> R.Tensor(
        ("b", "n", 8), "float32"
    ):
        R.func_attr({"tir_var_upper_bound": {"n": 64, "b": 4}, "num_input": 1})
        with R.dataflow():
            y = R.nn.gelu(R.matmul(x, w))
            R.output(y)
        return y


def test_default_plan_powers_of_two_for_wide_ranges():
    plan = plan_buckets({"b": (1, 4, 1), "n": (1, 40, 32)}, {})
    assert plan["b"] == [Bucket(1, 4, 1)]
    assert plan["n"] == [
        Bucket(1, 1, 1),
        Bucket(2, 2, 2),
        Bucket(3, 4, 4),
        Bucket(5, 8, 8),
        Bucket(9, 16, 16),
        Bucket(17, 32, 32),
        Bucket(33, 40, 40),
    ]


def test_explicit_tops_cover_the_range():
    plan = plan_buckets({"n": (1, 64, 32)}, {"n": (1, 16)})
    assert plan["n"] == [Bucket(1, 1, 1), Bucket(2, 16, 16), Bucket(17, 64, 64)]


@pytest.mark.parametrize("edges, word", [({"m": (4,)}, "'m'"), ({"n": (128,)}, "n=128")])
def test_bad_buckets_are_named(edges, word):
    with pytest.raises(UserError, match=word):
        plan_buckets({"n": (1, 64, 32)}, edges)


def test_structure_one_function_per_bucket():
    mod = BucketDispatch(plan_buckets({"b": (1, 4, 1), "n": (1, 64, 32)}, {"n": (1, 64)}))(Before)
    variants = {gv.name_hint: f for gv, f in mod.functions_items() if gv.name_hint != "main"}
    assert sorted(variants) == ["main_n1_b1_4", "main_n2_64_b1_4"]
    decode = variants["main_n1_b1_4"]
    assert [int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in decode.params[0].ty.shape.values] == [
        "b",
        1,
        16,
    ]
    assert [int(v) for v in decode.attrs[BUCKET_ATTR]["n"]] == [1, 1, 1]
    rest = variants["main_n2_64_b1_4"]
    assert int(rest.attrs["tir_var_upper_bound"]["n"]) == 64 and int(rest.attrs["tir_var_lower_bound"]["n"]) == 2
    assert [int(v) for v in rest.attrs[BUCKET_ATTR]["n"]] == [2, 64, 64]
    assert "R.assert_op" in mod["main"].script() and "if" in mod["main"].script()


def test_numerics_and_bounds_at_every_boundary():
    mod = BucketDispatch(plan_buckets({"b": (1, 4, 1), "n": (1, 64, 32)}, {"n": (1, 8, 16)}))(Before)
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype("float32")
    for b, n in [(1, 1), (2, 2), (1, 8), (3, 9), (1, 16), (4, 17), (1, 64)]:
        x = rng.standard_normal((b, n, 16)).astype("float32")
        h = x @ w
        expected = 0.5 * h * (1 + np.vectorize(__import__("math").erf)(h / np.sqrt(2)))
        out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"n=65 \(allowed 1..64\)"):
        vm["main"](tvm.runtime.tensor(np.zeros((1, 65, 16), "float32")), tvm.runtime.tensor(w))
