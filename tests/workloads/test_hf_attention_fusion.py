"""The fusion patterns of the built-in llama-block fire on the Hugging Face import of the same
architecture (`hf:llama`, and `hf:qwen2`, whose attention is the same plus q/k/v biases): the
key-mask attention kernel reads q, k, v in place from the merged projection and rotates q, k on
load (FuseAttentionPrologue), with the cos/sin tables computed at compile time (LiftPositionTables).
Whole pipeline against torch at n = 1, a middle value and the bound, b = 1 and 2 (left padding)."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx

from relaxtune import api
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.kernels.attention_spec import ATTR, KEY_MASK_ATTR, KIND, ROPE_ATTR
from relaxtune.relax_passes.pipeline import fuse
from relaxtune.runtime.artifact import prepare_params
from relaxtune.workloads import load

MAX_SEQ = 48
LAYERS = 2


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def imported(request, target):
    workload = load(f"hf:{request.param}", {"max_seq": str(MAX_SEQ), "layers": str(LAYERS)})
    ex = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]
    return request.param, workload, relax.VirtualMachine(ex, tvm.cpu())


def test_attention_reads_in_place_and_rotates_with_constant_tables(imported, target):
    _, workload, _ = imported
    fused = fuse(workload.mod, target.target, api.bucket_plan(workload, JobConfig()))
    kernels = {gv: f for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)}
    attention = [f for f in kernels.values() if f.attrs.get(ATTR, None) == KIND]  # the layers share one kernel
    assert attention and all(f.attrs.get(ROPE_ATTR, False) and f.attrs[KEY_MASK_ATTR] == "zero" for f in attention)
    called = set()
    for _, func in fused.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func,
                lambda e: (
                    called.add(e.args[0])
                    if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.call_tir"
                    else None
                ),
            )
    per_call = [kernels[gv] for gv in called if gv in kernels]
    assert not any("T.cos(" in f.script() or "T.sin(" in f.script() for f in per_call)  # the tables are constants


@pytest.mark.parametrize("b", [1, 2])
def test_matches_torch_with_left_padding(imported, b):
    family, workload, vm = imported
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    model = workload.torch_module()
    for n in (1, 23, MAX_SEQ):
        inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
        if b > 1 and n > 2:
            inputs["attention_mask"][-1, :2] = 0  # left padding in the last row
        with torch.no_grad():
            expected = model(*(torch.from_numpy(inputs[t.name]) for t in workload.inputs)).numpy()
        out = vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs), *weights).numpy()
        np.testing.assert_allclose(
            out, expected, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(expected).max()), err_msg=f"{family} b={b} n={n}"
        )
