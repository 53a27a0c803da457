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


TINY_LLAMA = {"hidden": "64", "heads": "2", "kv_heads": "1", "ffn": "128", "max_seq": "32", "max_batch": "2"}
TWO_BUCKETS = {"n": (1, 32), "b": (2,)}  # a decode bucket and one more: the test stays in the fast tier


def test_q4f16_llama_block_on_llvm_matches_the_dequantized_reference():
    """q4f16: float16 activations and 4-bit weights; on llvm the kernels compute in float32 (quant_tir.linear reads
    x as float32 and rounds the product once to float16), the rest of the block in float16."""
    from tvm import relax

    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.runtime.artifact import prepare_params

    work = load("llama-block", TINY_LLAMA, quantize=QuantizeConfig("q4f16", 32))
    assert work.config["dtype"] == "float16" and work.config["quantize"] == "q4f16"
    assert sorted(k for k in work.params if k.endswith(".qweight")) == [
        f"{p}.weight.qweight" for p in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")
    ] + [f"self_attn.{p}_proj.weight.qweight" for p in "koqv"]
    job = JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(edges=TWO_BUCKETS))
    ex = api.build(work, targets.resolve("cpu"), job)[0]
    vm = relax.VirtualMachine(ex, tvm.cpu())
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in work.params.values()])
    for b, n in ((1, 1), (2, 1), (1, 2), (2, 17), (1, 32)):
        inputs = work.random_inputs({"b": b, "n": n}, seed=n)
        out = (
            vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in work.inputs), *weights).numpy().astype(np.float32)
        )
        ref = np.asarray(work.reference(inputs, work.params), dtype=np.float32)  # float32 on the dequantized weights
        assert np.abs(out - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max()), (b, n)


def test_q4f16_names_its_dtype_and_refuses_another():
    with pytest.raises(UserError, match=r"--quantize q4f16 computes in float16: --dtype float32 is not allowed"):
        load("mlp", SMALL, dtype="float32", quantize=QuantizeConfig("q4f16", 32))
    assert load("mlp", SMALL, dtype="float16", quantize=QuantizeConfig("q4f16", 32)).config["dtype"] == "float16"
    with pytest.raises(UserError, match=r"--quantize q4f16 is for --target cuda: on the CPU use auto, f32, q4f32"):
        load("smollm2", quantize=QuantizeConfig("q4f16", 32))  # a language model's CPU build: float32 activations
