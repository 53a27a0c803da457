"""`.onnx` files: a torch model exported with dynamic axes, imported with TVM's ONNX frontend.

The model is exported once (torch.onnx.export with dynamic_axes named batch/seq), loaded with
bounds from the config, compiled without tuning and compared with torch eager at several b, n.
"""

import numpy as np
import onnx
import pytest
import torch
import tvm
from onnx import TensorProto, helper
from tvm import relax

from relaxtune import api
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.errors import UserError
from relaxtune.runtime.artifact import prepare_params
from relaxtune.workloads import load

VOCAB, HIDDEN, MAX_SEQ = 50, 32, 40


class Tagger(torch.nn.Module):
    """Token embedding (masked), LayerNorm, causal softmax attention, GELU MLP: ids, mask -> (b, n, 8)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32)
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2) / HIDDEN**0.5).masked_fill(~causal, float("-inf"))
        x = x + torch.softmax(scores, dim=-1) @ v
        return self.head(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = Tagger().eval()
    path = tmp_path_factory.mktemp("onnx") / "tagger.onnx"
    ids, mask = torch.randint(0, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(
        model,
        (ids, mask),
        str(path),
        input_names=["input_ids", "attention_mask"],
        output_names=["tags"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "tags": axes},
    )
    return model, str(path)


@pytest.fixture(scope="module")
def compiled(exported, target):
    model, path = exported
    workload = load(path, {"max_seq": str(MAX_SEQ), "max_batch": "3"})
    ex = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]
    return model, workload, relax.VirtualMachine(ex, tvm.cpu())


def test_dynamic_axes_become_bounded_b_and_n(compiled):
    _, workload, _ = compiled
    main = workload.mod["main"]
    assert [str(p.ty.shape) for p in main.params[:2]] == ["R.shape([b, n])"] * 2
    assert {k: int(v) for k, v in main.attrs["tir_var_upper_bound"].items()} == {"b": 3, "n": MAX_SEQ}
    assert {k: int(v) for k, v in main.attrs["tir_var_lower_bound"].items()} == {"b": 1, "n": 1}
    assert int(main.attrs["num_input"]) == 2 and len(main.params) == 2 + len(workload.params)
    ids, mask = workload.inputs
    assert (ids.fill, ids.high, mask.fill) == ("index", VOCAB, "ones")
    assert workload.params["embed.weight"].shape == (VOCAB, HIDDEN)


@pytest.mark.parametrize("b,n", [(1, 1), (3, 1), (2, 19), (3, MAX_SEQ)])
def test_matches_torch_eager(compiled, b, n):
    model, workload, vm = compiled
    inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
    inputs["attention_mask"][0, : n // 3] = 0
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    out = vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs), *weights).numpy()
    with torch.no_grad():
        expected = model(torch.from_numpy(inputs["input_ids"]), torch.from_numpy(inputs["attention_mask"])).numpy()
    assert out.shape == (b, n, 8)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(workload.reference(inputs, workload.params), expected, rtol=1e-4, atol=1e-5)


def _det_model(path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", 2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq"])
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"])], "det", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_unsupported_operator_is_named(tmp_path):
    _det_model(tmp_path / "det.onnx")
    with pytest.raises(UserError, match="not supported for frontend ONNX: Det"):
        load(str(tmp_path / "det.onnx"))


def test_unknown_dynamic_axis_and_config(tmp_path, exported):
    _, path = exported
    with pytest.raises(
        UserError, match="unknown config key 'hidden'.*max_seq, min_seq, max_batch, batch_name, seq_name"
    ):
        load(path, {"hidden": "3"})
    model = onnx.load(path)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "tokens"
    onnx.save(model, str(tmp_path / "renamed.onnx"))
    with pytest.raises(UserError, match="dynamic axis 'tokens'.*seq_name=NAME"):
        load(str(tmp_path / "renamed.onnx"))
    with pytest.raises(UserError, match="ONNX file '/nonexistent.onnx' does not exist"):
        load("/nonexistent.onnx")


# --- Hugging Face exports: relaxtune's converters (relaxtune/workloads/onnx_fixes.py) -------------

HF_TINY = {"hidden": "32", "layers": "1", "heads": "2", "ffn": "64", "vocab": "64", "max_seq": "48"}


def _hf_onnx(family, tmp_path_factory, target):
    """hf:family (tiny, random weights) exported by torch.onnx.export with dynamic batch and seq, built."""
    module = load(f"hf:{family}", HF_TINY).torch_module()
    path = tmp_path_factory.mktemp("hf") / f"{family}.onnx"
    ids, mask = torch.randint(0, 64, (2, 7)), torch.ones(2, 7, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(
        module,
        (ids, mask),
        str(path),
        input_names=["input_ids", "attention_mask"],
        output_names=["out"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "out": axes},
    )
    workload = load(str(path), {"max_seq": HF_TINY["max_seq"], "max_batch": "2"})
    ex = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]
    return module, workload, relax.VirtualMachine(ex, tvm.cpu())


@pytest.fixture(scope="module")
def hf_llama_onnx(tmp_path_factory, target):
    return _hf_onnx("llama", tmp_path_factory, target)


@pytest.fixture(scope="module")
def hf_gpt2_onnx(tmp_path_factory, target):
    return _hf_onnx("gpt2", tmp_path_factory, target)


@pytest.mark.parametrize("b,n", [(1, 1), (2, 17), (1, 48)])
def test_hf_llama_export_matches_torch(hf_llama_onnx, b, n):
    module, workload, vm = hf_llama_onnx
    assert [str(p.ty.shape) for p in workload.mod["main"].params[:2]] == ["R.shape([b, n])"] * 2
    inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    out = vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs), *weights).numpy()
    with torch.no_grad():
        expected = module(torch.from_numpy(inputs["input_ids"]), torch.from_numpy(inputs["attention_mask"])).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_export_attention_is_fused_and_matches_onnx_with_left_padding(family, request, target):
    """The export's attention (GatherND key mask, its own kᵀ, Llama's NaN guard) becomes relaxtune's fused
    kernel reading the (b, n) key mask, and still matches ONNX's evaluator where rows see no key."""
    from relaxtune.relax_passes.pipeline import fuse

    _, workload, vm = request.getfixturevalue(f"hf_{family}_onnx")
    fused = fuse(workload.mod, target.target, api.bucket_plan(workload, JobConfig()))
    kernels = [f for gv, f in fused.functions_items() if gv.name_hint.startswith("fused_attention")]
    # q, k, v, key mask, out; Llama's RoPE applied on load (FuseAttentionPrologue): cos and sin tables too
    rope = family == "llama"
    assert kernels and all(
        len(f.params) == 5 + 2 * rope and f.attrs.get("relaxtune.rope", False) == rope for f in kernels
    )
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    for b, n in [(1, 1), (2, 1), (2, 17), (1, 48), (2, 48)]:
        inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
        inputs["attention_mask"][-1, : min(3, n)] = 0  # left padding in the last row (all of it at n = 1)
        out = vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs), *weights).numpy()
        expected = workload.reference(inputs, workload.params)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5, err_msg=f"{family} b={b} n={n}")


def _positions_model(path):
    """x + positions, the positions from Range(0, Squeeze(Shape(x)[1:2]), 1) — how exporters write arange(n)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 3])
    consts = [
        helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, dims, vals))
        for name, dims, vals in [("zero", [], [0]), ("one", [], [1]), ("axis0", [1], [0]), ("view", [3], [1, -1, 1])]
    ]
    nodes = consts + [
        helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
        helper.make_node("Squeeze", ["shape", "axis0"], ["seq"]),
        helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
        helper.make_node("Cast", ["positions"], ["fpositions"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["fpositions", "view"], ["column"]),
        helper.make_node("Add", ["x", "column"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "positions", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_range_keeps_the_sequence_dim(tmp_path, target, run_vm):
    from tvm.relax.frontend.onnx import from_onnx

    _positions_model(tmp_path / "pos.onnx")
    stock = from_onnx(onnx.load(str(tmp_path / "pos.onnx")))
    # TVM's own Range gives the positions a fresh length (range_len_0), and the sum loses its shape
    assert "range_len_0" in stock.script() and str(stock["main"].ret_ty) == 'R.Tensor(dtype="float32", ndim=3)'
    workload = load(str(tmp_path / "pos.onnx"))
    assert str(workload.mod["main"].ret_ty) == 'R.Tensor((b, n, 3), dtype="float32")'
    ex = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]
    for b, n in [(1, 1), (2, 5), (4, 128)]:
        inputs = workload.random_inputs({"b": b, "n": n}, seed=n)
        expected = inputs["x"] + np.arange(n, dtype="float32")[None, :, None]
        np.testing.assert_allclose(run_vm(ex, workload, inputs, {}), expected, rtol=1e-6)


def test_hf_llama_export_yields_tuning_tasks(hf_llama_onnx, target, tmp_path):
    """Kernels whose buffers ONNX shaped by an expression (`b * n`) keep their rules; the rest are tasks."""
    from relaxtune.config import TuneConfig

    _, workload, _ = hf_llama_onnx
    tasks = api.extract_tasks(workload, target, JobConfig(cache_dir=tmp_path, tune=TuneConfig(trials=8)))
    assert tasks and all(t.flops > 0 for t in tasks)
