"""PlanMemory: plans that pass the verifier for every shape in the bounds, near the lower bound, same results."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax, tirx

from relaxtune import api
from relaxtune.artifact import prepare_params
from relaxtune.config import BucketConfig, CompileConfig, JobConfig
from relaxtune.errors import UserError
from relaxtune.relax_passes.bucket_dispatch import BUCKET_ATTR
from relaxtune.relax_passes import plan_memory
from relaxtune.relax_passes.pipeline import explicit_allocation_passes, fusion_passes, lowering_passes, memory_planning, rule_schedules
from relaxtune.relax_passes.plan_memory import PlanMemory, plan_function
from relaxtune.relax_passes.verify_memory_plan import verify
from relaxtune.workloads import load

SMALL = {
    "llama-block": {"hidden": "64", "heads": "4", "kv_heads": "2", "ffn": "128", "max_seq": "64", "max_batch": "2"},
    "gpt2-block": {"hidden": "64", "heads": "4", "ffn": "128", "max_seq": "64", "max_batch": "2"},
    "mlp": {"hidden": "64", "ffn": "128", "max_seq": "64", "max_batch": "2"},
}


def _explicit(mod, target, plan):
    with target:
        return tvm.transform.Sequential([*fusion_passes(plan), rule_schedules(target), *explicit_allocation_passes()])(mod)


def _allocs(func, name="relax.builtin.alloc_tensor") -> list[str]:
    return [
        b.var.name
        for block in func.body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name == name
    ]


@pytest.fixture(scope="module")
def explicit(target):
    out = {}
    for name, config in SMALL.items():
        workload = load(name, dict(config))
        out[name] = _explicit(workload.mod, target.target, api.bucket_plan(workload, JobConfig()))
    return out


@pytest.mark.parametrize("name", sorted(SMALL))
def test_builtin_plans_pass_the_verifier_near_the_lower_bound(name, explicit, target):
    mod = explicit[name]
    with target.target:
        planned = PlanMemory(check=False)(mod)
    buckets = [(gv.name_hint, f.attrs[BUCKET_ATTR]) for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs and BUCKET_ATTR in f.attrs]
    assert len(buckets) > 2
    checked = 0
    for fname, ranges in buckets:
        plan = plan_function(mod[fname], mod, fname)
        lo, hi = int(ranges["n"][0]), int(ranges["n"][1])
        for n, b in itertools.product(sorted({lo, (lo + hi) // 2, hi}), (1, 2)):
            assert verify(planned[fname], {"n": n, "b": b}, mod) == [], (fname, n, b)
            at = plan.at({"n": n, "b": b})
            assert at["arena"] <= 1.05 * at["lower_bound"], (fname, n, b, at["arena"], at["lower_bound"])
            assert at["arena"] <= at["allocated"] == plan.at({"n": hi, "b": 2})["arena"]  # one size: the VM pool reuses it
            checked += 1
    assert checked >= 2 * len(buckets)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_one_arena_and_outputs_params_untouched(name, explicit, target):
    mod = explicit[name]
    with target.target:
        planned = PlanMemory()(mod)
    fname = next(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs and BUCKET_ATTR in f.attrs)
    before, after = mod[fname], planned[fname]
    assert len(_allocs(after, "relax.memory.alloc_storage")) == 1
    left = _allocs(after)
    assert len(left) == 1 and len(_allocs(after, "relax.memory.alloc_tensor")) == len(_allocs(before)) - 1
    # the one allocation left to the VM is the returned tensor; params are the same objects
    returned = after.body.body
    assert isinstance(returned, relax.Var)
    assert all(p.same_as(q) for p, q in zip(before.params, after.params))
    plan = plan_function(before, mod, fname)
    assert left[0] not in {t.name for t in plan.tensors}


def test_inplace_for_an_elementwise_kernel_whose_input_dies(explicit):
    mod = explicit["mlp"]
    fname = next(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs and BUCKET_ATTR in f.attrs)
    plan = plan_function(mod[fname], mod, fname)
    # up = x @ Wup dies in down-input = silu(x @ Wgate) * up: both share one slot
    assert len(plan.tensors) == 2 and plan.tensors[0].slot == plan.tensors[1].slot
    at = plan.at({"n": 7, "b": 2})
    assert at["arena"] == at["tensors"][0][3] == at["lower_bound"] // 2


def test_reuse_across_binding_blocks(target):
    """A tensor that dies in the first block gives its bytes to one allocated in the second."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 32), "float32"))
    w = relax.Var("w", relax.TensorType((32, 32), "float32"))
    with bb.function("main", [x, w], attrs={"tir_var_upper_bound": {"n": 128}}):
        with bb.dataflow():
            out = x
            for _ in range(4):
                out = bb.emit(relax.op.matmul(out, w))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    with target.target:
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), *explicit_allocation_passes()])(bb.get())
    func = mod["main"]
    bindings = list(func.body.blocks[0].bindings)
    half = len(bindings) // 2
    blocks = [relax.BindingBlock(bindings[:half]), relax.BindingBlock(bindings[half:])]
    mod["main"] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure, func.attrs)
    plan = plan_function(mod["main"], mod)
    at = plan.at({"n": 100})
    assert len(plan.tensors) == 3 and at["arena"] == 2 * 100 * 32 * 4 == at["lower_bound"] < at["no_reuse"]
    with target.target:
        ours, theirs = PlanMemory()(mod), relax.transform.StaticPlanBlockMemory()(mod)
    assert verify(ours["main"], {"n": 100}, mod) == [] and verify(theirs["main"], {"n": 100}, mod) == []
    assert len(_allocs(ours["main"], "relax.memory.alloc_storage")) == 1
    assert len(_allocs(ours["main"])) == 1  # only the returned tensor is left to the VM
    assert len(_allocs(theirs["main"])) > 1  # TVM plans per block: tensors crossing the boundary are left out


_OPS = ("add", "multiply", "subtract", "tanh", "sigmoid", "matmul")


@st.composite
def graphs(draw):
    """A random DAG over (n, 16) tensors: element-wise ops and matmuls, 1-2 outputs."""
    steps = [("matmul", 0, 0)]  # every graph reads the weight
    steps += [(draw(st.sampled_from(_OPS)), draw(st.integers(0, i)), draw(st.integers(0, i))) for i in range(1, draw(st.integers(2, 8)))]
    extra = draw(st.none() | st.integers(0, len(steps)))
    return steps, extra, draw(st.booleans())


def _build(steps, extra, upper=64):
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    w = relax.Var("w", relax.TensorType((16, 16), "float32"))
    bounds = {"tir_var_upper_bound": {"n": upper}, "tir_var_lower_bound": {"n": 1}} if upper else {}
    with bb.function("main", [x, w], attrs={**bounds, "num_input": 1}):
        with bb.dataflow():
            values = [x]
            for op, i, j in steps:
                a, b = values[i], values[j]
                unary = {"tanh": relax.op.tanh, "sigmoid": relax.op.sigmoid}
                binary = {"add": relax.op.add, "multiply": relax.op.multiply, "subtract": relax.op.subtract}
                expr = unary[op](a) if op in unary else binary[op](a, b) if op in binary else relax.op.matmul(a, w)
                values.append(bb.emit(expr))
            out = values[-1] if extra is None else relax.Tuple([values[-1], values[extra]])
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def _reference(steps, extra, x, w):
    values = [x]
    for op, i, j in steps:
        a, b = values[i], values[j]
        values.append(
            {"add": lambda: a + b, "multiply": lambda: a * b, "subtract": lambda: a - b, "tanh": lambda: np.tanh(a),
             "sigmoid": lambda: 1 / (1 + np.exp(-a)), "matmul": lambda: a @ w}[op]()
        )
    return [values[-1]] if extra is None else [values[-1], values[extra]]


@settings(max_examples=25, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_random_graphs_pass_the_verifier_at_every_checked_n(target, graph):
    steps, extra, fused = graph
    bounded = len(steps) % 2 == 0  # half of them without bounds: the plan must hold for any n
    mod = _build(steps, extra, upper=64 if bounded else None)
    prep = [relax.transform.LegalizeOps()]
    if fused:
        prep += [relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target.target:
        mod = tvm.transform.Sequential([*prep, *explicit_allocation_passes()])(mod)
        planned = PlanMemory()(mod)  # also checks itself at n = 1, 32, 64
    plan = plan_function(mod["main"], mod)
    for n in (1, 2, 31, 64) if bounded else (0, 1, 31, 5000):
        assert verify(planned["main"], {"n": n}, mod) == []
        if plan is not None and n:
            at = plan.at({"n": n})
            assert at["arena"] <= 1.05 * at["lower_bound"] + 64 * len(plan.tensors)


@settings(max_examples=8, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_random_graphs_compute_the_same_values(target, graph):
    steps, extra, fused = graph
    prep = [relax.transform.LegalizeOps()]
    if fused:
        prep += [relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    passes = tvm.transform.Sequential([*prep, *explicit_allocation_passes(), PlanMemory(), *lowering_passes()])
    vm = relax.VirtualMachine(tvm.compile(_build(steps, extra), target=target.target, relax_pipeline=passes), tvm.cpu())
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 16)) * 0.25).astype("float32")
    for n in (1, 13, 64):
        x = rng.standard_normal((n, 16)).astype("float32")
        out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
        outs = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
        for got, want in zip(outs, _reference(steps, extra, x.astype("float64"), w.astype("float64"))):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))


def test_run_time_choice_between_layouts(explicit, target, monkeypatch):
    """Three layouts kept where one would do: the smallest arena is picked per call, for every offset alike."""
    original = plan_memory._choose

    def three(layouts):
        chosen, _ = original(layouts)
        kept = (chosen + [c for c in layouts if all(c is not k for k in chosen)])[:3]
        return kept, [min(r) for r in zip(*(c[2] for c in kept))]

    monkeypatch.setattr(plan_memory, "_choose", three)
    mod = explicit["gpt2-block"]
    with target.target:
        planned = PlanMemory()(mod)
    fname = next(gv.name_hint for gv, f in mod.functions_items() if f.attrs and BUCKET_ATTR in f.attrs and int(f.attrs[BUCKET_ATTR]["n"][1]) == 64)
    assert "T.Select" in planned[fname].script()
    for n, b in itertools.product(range(33, 65, 3), (1, 2)):
        assert verify(planned[fname], {"n": n, "b": b}, mod) == []
    # and the VM evaluates the choice right: attention-like sizes, n x 16 against n x n, run at several n
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    w = relax.Var("w", relax.TensorType((16, 16), "float32"))
    with bb.function("main", [x, w], attrs={"tir_var_upper_bound": {"n": 64}}):
        a = bb.emit(relax.op.matmul(x, w))
        p = bb.emit(relax.op.nn.softmax(relax.op.matmul(a, relax.op.permute_dims(a)), axis=-1))
        bb.emit_func_output(bb.emit(relax.op.add(relax.op.matmul(p, a), relax.op.tanh(a))))
    with target.target:
        small = tvm.transform.Sequential([relax.transform.LegalizeOps(), *explicit_allocation_passes(), PlanMemory()])(bb.get())
    assert "T.Select" in small["main"].script()
    vm = relax.VirtualMachine(tvm.compile(small, target=target.target, relax_pipeline=tvm.transform.Sequential(lowering_passes())), tvm.cpu())
    rng = np.random.default_rng(1)
    wv = (rng.standard_normal((16, 16)) * 0.25).astype("float32")
    for rows in (1, 5, 16, 40, 64):
        xv = rng.standard_normal((rows, 16)).astype("float32")
        av = xv.astype("float64") @ wv
        scores = av @ av.T
        pv = np.exp(scores - scores.max(-1, keepdims=True))
        want = (pv / pv.sum(-1, keepdims=True)) @ av + np.tanh(av)
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(wv)).numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_results_unchanged_against_torch(name, target):
    workload = load(name, dict(SMALL[name]))
    job = JobConfig(buckets=BucketConfig({"n": (1, 64)}), compile=CompileConfig(use_cache=False, memory_planner="relaxtune"))
    executable, _, _ = api.build(workload, target, job)  # buckets n=1 and n=2..64
    vm = relax.VirtualMachine(executable, tvm.cpu())
    params = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    for b, n in [(1, 1), (2, 1), (1, 2), (2, 5), (1, 31), (2, 48), (1, 64)]:
        inputs = workload.random_inputs({"b": b, "n": n})
        out = vm["main"](*[tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs], *params).numpy()
        expected = workload.reference(inputs, workload.params)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(expected).max())))


def test_planner_choice(target):
    assert memory_planning("relaxtune").info.name == "PlanMemory"
    assert memory_planning("tvm").info.name == "StaticPlanBlockMemory"
    assert CompileConfig().memory_planner == "tvm"  # relaxtune's is opt-in for now
    with pytest.raises(UserError, match=r"'fifo'.*relaxtune, tvm"):
        CompileConfig(memory_planner="fifo")
