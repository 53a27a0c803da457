"""The whole pipeline without a cache: every kernel gets a rule-based schedule, results match torch."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from relaxtune import api
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.relax_passes.pipeline import pipeline
from relaxtune.runtime.artifact import prepare_params
from relaxtune.workloads import load

SMALL = {
    "llama-block": {"hidden": "64", "heads": "4", "kv_heads": "2", "ffn": "128", "max_seq": "64", "max_batch": "2"},
    "gpt2-block": {"hidden": "64", "heads": "4", "ffn": "128", "max_seq": "64", "max_batch": "2"},
    "mlp": {"hidden": "64", "ffn": "128", "max_seq": "64", "max_batch": "2"},
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_rule_schedules_match_reference(name, target):
    workload = load(name, dict(SMALL[name]))
    job = JobConfig(compile=CompileConfig(use_cache=False))
    executable, _, _ = api.build(workload, target, job)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    params = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    for b, n in [(1, 1), (2, 1), (1, 2), (2, 31), (1, 64)]:
        inputs = workload.random_inputs({"b": b, "n": n})
        out = vm["main"](*[tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs], *params).numpy()
        expected = workload.reference(inputs, workload.params)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(expected).max())))


def test_no_kernel_is_left_unscheduled(target):
    workload = load("llama-block", dict(SMALL["llama-block"]))
    plan = api.bucket_plan(workload, JobConfig())
    passes = pipeline(target.target, plan)
    # stop before lowering: run the stages up to the rules and inspect every PrimFunc
    from relaxtune.relax_passes.pipeline import fusion_passes
    from relaxtune.schedules.rules import rule_schedules

    with target.target:
        mod = tvm.transform.Sequential([*fusion_passes(target.target, plan), rule_schedules(target.target)])(
            workload.mod
        )
    kernels = [(gv.name_hint, f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels
    unscheduled = [name for name, f in kernels if not (f.attrs and f.attrs.get("tirx.is_scheduled"))]
    assert unscheduled == []
    assert passes is not None
