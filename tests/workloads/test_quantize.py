"""relaxtune's own weight-only quantization of a workload (`--quantize q4f32 | q8f32`, relaxtune/workloads/
quantize.py): the projections' weights become groups, each matmul one kernel dequantizing as it multiplies,
and the reference runs on the same dequantized weights."""

import numpy as np
import pytest
import tvm

from relaxtune.config import QuantizeConfig
from relaxtune.errors import UserError
from relaxtune.kernels import quant_formats as qf
from relaxtune.workloads import load

SMALL = {"hidden": "64", "ffn": "128", "max_seq": "64"}
TARGET = {"kind": "llvm", "num-cores": 2}


@pytest.mark.parametrize(("mode", "group"), [("q8f32", 32), ("q4f32", 32), ("q4f32", 64 * 2)])
def test_mlp_projections_quantized_against_the_dequantized_reference(mode, group, run_vm):
    plain = load("mlp", SMALL)
    work = load("mlp", SMALL, quantize=QuantizeConfig(mode, group))
    fmt = qf.own_format(int(mode[1]), group)
    quantized = sorted({k.rsplit(".", 1)[0] for k in work.params if k.endswith(".qweight")})
    # group 128: only the down projection (128 input features) divides; gate / up (64) stay float32
    assert quantized == (
        ["down_proj.weight"] if group == 128 else ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    )
    assert work.config["quantize"] == mode and work.config["group_size"] == group
    for name in quantized:
        parts = {p: work.params[f"{name}.{p}"] for p in fmt.part_names}
        step = np.repeat(np.abs(parts["scale"].astype(np.float32)), group, axis=1)
        assert np.all(np.abs(qf.dequantize(fmt, parts) - plain.params[name]) <= step * 1.01 + 1e-7)
    ex = tvm.compile(work.mod, target=tvm.target.Target(TARGET))
    for b, n in ((1, 1), (2, 7), (1, 64)):
        inputs = work.random_inputs({"b": b, "n": n}, seed=n)
        out = run_vm(ex, work, inputs, work.params)
        ref = work.reference(inputs, work.params)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        assert not np.allclose(out, plain.reference(inputs, plain.params), rtol=1e-6, atol=0)  # it did quantize


def test_no_projection_to_quantize_is_one_line():
    with pytest.raises(UserError, match=r"--quantize q4f32: mlp has no projection with a multiple of 128 input"):
        load("mlp", {"hidden": "96", "ffn": "96", "max_seq": "64"}, quantize=QuantizeConfig("q4f32", 128))
