"""The `gpt2-block` built-in: symbolic export, bounds, and numerics against the torch reference."""

import numpy as np
import pytest
import tvm

from relaxtune.errors import UserError
from relaxtune.workloads import load

SMALL = {"hidden": "64", "heads": "4", "ffn": "128", "max_seq": "64"}
TARGET = {"kind": "llvm", "num-cores": 2}


@pytest.fixture(scope="module")
def small():
    workload = load("gpt2-block", SMALL)
    ex = tvm.compile(workload.mod, target=tvm.target.Target(TARGET))
    # Linear weights 10x the 0.02 init so that attention is far from uniform.
    params = {k: v * 10 if v.ndim == 2 else v for k, v in workload.params.items()}
    return workload, ex, params


def test_default_export_is_symbolic_and_bounded():
    workload = load("gpt2-block")
    main = workload.mod["main"]
    b, n, hidden = main.params[0].ty.shape.values
    assert isinstance(b, tvm.tirx.Var) and b.name == "b"
    assert isinstance(n, tvm.tirx.Var) and n.name == "n"
    assert int(hidden) == 256
    assert {k: int(v) for k, v in main.attrs["tir_var_upper_bound"].items()} == {"b": 4, "n": 1024}
    assert {k: int(v) for k, v in main.attrs["tir_var_lower_bound"].items()} == {"b": 1, "n": 1}
    assert int(main.attrs["num_input"]) == 1
    assert [p.name for p in main.params[1:]] == list(workload.params)
    assert workload.params["attn.c_attn.weight"].shape == (768, 256)
    assert workload.params["attn.c_attn.bias"].shape == (768,)
    assert workload.params["mlp.c_fc.weight"].shape == (1024, 256)
    assert "R.nn.gelu_tanh(" in main.script()


@pytest.mark.parametrize("b,n", [(1, 1), (2, 1), (1, 23), (2, 23), (1, 64), (2, 64)])
def test_matches_torch(small, b, n, run_vm):
    workload, ex, params = small
    inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
    out = run_vm(ex, workload, inputs, params)
    ref = workload.reference(inputs, params)
    assert out.shape == ref.shape == (b, n, 64)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_flops():
    workload = load("gpt2-block")
    one = workload.flops({"b": 1, "n": 1})
    assert one > 2 * (4 * 256 * 256 + 2 * 256 * 1024)
    assert workload.flops({"b": 3, "n": 7}) == pytest.approx(3 * workload.flops({"b": 1, "n": 7}))


def test_rejects_heads_not_dividing_hidden():
    with pytest.raises(UserError, match="heads=3"):
        load("gpt2-block", {"heads": "3"})
