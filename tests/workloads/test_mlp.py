"""The `mlp` built-in: symbolic export, bounds, and numerics against the torch reference."""

import numpy as np
import pytest
import torch
import tvm

from relaxtune.errors import UserError
from relaxtune.workloads import load

SMALL = {"hidden": "64", "ffn": "128", "max_seq": "64"}
TARGET = {"kind": "llvm", "num-cores": 2}


@pytest.fixture(scope="module")
def small():
    workload = load("mlp", SMALL)
    # Larger weights than the 0.02 init so that the output is O(1) and errors are visible.
    params = {k: v * 10 for k, v in workload.params.items()}
    return workload, tvm.compile(workload.mod, target=tvm.target.Target(TARGET)), params


def test_default_export_is_symbolic_and_bounded():
    workload = load("mlp")
    main = workload.mod["main"]
    b, n, hidden = main.params[0].ty.shape.values
    assert isinstance(b, tvm.tirx.Var) and b.name == "b"
    assert isinstance(n, tvm.tirx.Var) and n.name == "n"
    assert int(hidden) == 256
    assert {k: int(v) for k, v in main.attrs["tir_var_upper_bound"].items()} == {"b": 4, "n": 1024}
    assert {k: int(v) for k, v in main.attrs["tir_var_lower_bound"].items()} == {"b": 1, "n": 1}
    assert int(main.attrs["num_input"]) == 1
    assert list(workload.params) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert workload.params["gate_proj.weight"].shape == (704, 256)
    assert [p.name for p in main.params[1:]] == list(workload.params)
    assert (workload.dims["b"].representative, workload.dims["n"].representative) == (1, 128)


@pytest.mark.parametrize("b,n", [(1, 1), (2, 1), (1, 23), (2, 23), (1, 64), (2, 64)])
def test_matches_torch(small, b, n, run_vm):
    workload, ex, params = small
    inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
    out = run_vm(ex, workload, inputs, params)
    ref = workload.reference(inputs, params)
    assert out.shape == ref.shape == (b, n, 64)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_torch_module_uses_the_workload_weights(small):
    workload, _, _ = small
    inputs = workload.random_inputs({"b": 1, "n": 5})
    with torch.no_grad():
        out = workload.torch_module()(torch.from_numpy(inputs["x"])).numpy()
    np.testing.assert_allclose(out, workload.reference(inputs, workload.params), rtol=1e-6, atol=1e-7)


def test_float16_compiles_and_runs(run_vm):
    workload = load("mlp", {"hidden": "32", "ffn": "64", "max_seq": "16"}, dtype="float16")
    assert workload.inputs[0].dtype == "float16"
    assert all(p.dtype == np.float16 for p in workload.params.values())
    params = {k: v * 10 for k, v in workload.params.items()}
    ex = tvm.compile(workload.mod, target=tvm.target.Target(TARGET))
    inputs = workload.random_inputs({"b": 2, "n": 16})
    out = run_vm(ex, workload, inputs, params)
    ref = workload.reference(inputs, params)
    assert out.dtype == ref.dtype == np.float16
    np.testing.assert_allclose(out.astype("float32"), ref.astype("float32"), rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_flops():
    workload = load("mlp")
    assert workload.flops({"b": 1, "n": 1}) == pytest.approx(6 * 256 * 704, rel=0.01)
    assert workload.flops({"b": 2, "n": 128}) == pytest.approx(256 * workload.flops({"b": 1, "n": 1}))


def test_rejects_nonpositive_size():
    with pytest.raises(UserError, match="ffn=0"):
        load("mlp", {"ffn": "0"})
