"""The `llama-block` built-in: symbolic export, bounds, and numerics against the torch reference."""

import numpy as np
import pytest
import tvm

from relaxtune.errors import UserError
from relaxtune.workloads import load

SMALL = {"hidden": "64", "heads": "4", "kv_heads": "2", "ffn": "128", "max_seq": "64"}
TARGET = {"kind": "llvm", "num-cores": 2}


def sharpen(params):
    """Linear weights 10x the 0.02 init, so attention is far from uniform and RoPE matters."""
    return {k: v * 10 if v.ndim == 2 else v for k, v in params.items()}


@pytest.fixture(scope="module")
def small():
    workload = load("llama-block", SMALL)
    ex = tvm.compile(workload.mod, target=tvm.target.Target(TARGET))
    return workload, ex, sharpen(workload.params)


def test_default_export_is_symbolic_and_bounded():
    workload = load("llama-block")
    main = workload.mod["main"]
    assert len(main.params) == 1 + len(workload.params)  # x is the only input: cos/sin are in-graph
    b, n, hidden = main.params[0].ty.shape.values
    assert isinstance(b, tvm.tirx.Var) and b.name == "b"
    assert isinstance(n, tvm.tirx.Var) and n.name == "n"
    assert int(hidden) == 256
    assert {k: int(v) for k, v in main.attrs["tir_var_upper_bound"].items()} == {"b": 4, "n": 1024}
    assert {k: int(v) for k, v in main.attrs["tir_var_lower_bound"].items()} == {"b": 1, "n": 1}
    assert int(main.attrs["num_input"]) == 1
    assert [p.name for p in main.params[1:]] == list(workload.params)
    assert workload.params["self_attn.k_proj.weight"].shape == (128, 256)  # 2 kv heads of 64
    assert workload.params["mlp.gate_proj.weight"].shape == (704, 256)
    assert "rope_cos_sin" in [gv.name_hint for gv in workload.mod.get_global_vars()]
    assert workload.config["rope_theta"] == 10000.0 and workload.config["eps"] == 1e-5
    assert (workload.dims["b"].representative, workload.dims["n"].representative) == (1, 128)


@pytest.mark.parametrize("b,n", [(1, 1), (2, 1), (1, 23), (2, 23), (1, 64), (2, 64)])
def test_matches_torch(small, b, n, run_vm):
    workload, ex, params = small
    inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
    out = run_vm(ex, workload, inputs, params)
    ref = workload.reference(inputs, params)
    assert out.shape == ref.shape == (b, n, 64)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_rope_theta_reaches_the_graph():
    """A reference with another rope_theta disagrees, so the comparison above checks RoPE."""
    base = load("llama-block", {**SMALL, "max_seq": "16"})
    other = load("llama-block", {**SMALL, "max_seq": "16", "rope_theta": "500"})
    params = sharpen(base.params)
    inputs = base.random_inputs({"b": 1, "n": 16})
    assert np.abs(base.reference(inputs, params) - other.reference(inputs, params)).max() > 1e-2


def test_flops_grow_quadratically_in_n():
    workload = load("llama-block")
    linear = workload.flops({"b": 1, "n": 1})
    assert linear > 2 * 256 * (2 * 256 + 2 * 128) + 6 * 256 * 704
    assert workload.flops({"b": 1, "n": 1024}) > 1024 * linear
    assert workload.flops({"b": 2, "n": 64}) == pytest.approx(2 * workload.flops({"b": 1, "n": 64}))


@pytest.mark.parametrize(
    "config,named",
    [
        ({"kv_heads": "3"}, "kv_heads=3"),
        ({"hidden": "250"}, "hidden=250"),
        ({"hidden": "12", "heads": "4", "kv_heads": "1"}, "hidden=12"),  # odd head_dim
        ({"max_seq": "0"}, "max_seq=0"),
    ],
)
def test_rejects_inconsistent_config(config, named):
    with pytest.raises(UserError, match=named):
        load("llama-block", config)
