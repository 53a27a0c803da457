"""`hf:MODEL_TYPE`: tiny random transformers models (no download) through relaxtune's pipeline.

Each family is imported with a dynamic batch and sequence where torch allows it, compiled once
without tuning, and compared with the torch model at n = 1, a middle value and the bound.
"""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from relaxtune import api
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.errors import UserError
from relaxtune.runtime.artifact import prepare_params
from relaxtune.workloads import load

MAX_SEQ = 48
# family -> (output width, has a dynamic batch). One layer keeps the file short; numerics are
# checked here for two decoders and the encoder, benchmarks/import_table.py checks every family at two.
FAMILIES = {"llama": (128, True), "bert": (64, True), "gpt2": (128, True)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def compiled(request, target):
    workload = load(f"hf:{request.param}", {"max_seq": str(MAX_SEQ), "layers": "1"})
    ex = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))[0]
    return request.param, workload, relax.VirtualMachine(ex, tvm.cpu())


def test_imports_and_matches_torch_eager(compiled):
    family, workload, vm = compiled
    width, dynamic_batch = FAMILIES[family]
    main = workload.mod["main"]
    assert [t.name for t in workload.inputs] == ["input_ids", "attention_mask"]
    assert [p.name for p in main.params[:2]] == ["input_ids", "attention_mask"]
    assert int(main.attrs["num_input"]) == 2 and len(main.params) == 2 + len(workload.params)
    assert sorted(workload.dims) == (["b", "n"] if dynamic_batch else ["n"])
    assert int(main.attrs["tir_var_upper_bound"]["n"]) == MAX_SEQ
    assert "b * n" not in main.script() and "ndim=" not in main.script()  # unflattened, every shape known
    weights = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    model = workload.torch_module()
    batch = 2 if dynamic_batch else 1
    for n in (1, 23, MAX_SEQ):
        point = {"b": batch, "n": n} if dynamic_batch else {"n": n}
        inputs = workload.random_inputs(point, seed=n)
        assert inputs["input_ids"].max() < 128 and (inputs["attention_mask"] == 1).all()
        if n > 2:
            inputs["attention_mask"][-1, :2] = 0  # left padding in the last row
        with torch.no_grad():
            expected = model(*(torch.from_numpy(inputs[t.name]) for t in workload.inputs)).numpy()
        out = vm["main"](*(tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs), *weights).numpy()
        assert out.shape == (batch, n, width)
        np.testing.assert_allclose(
            out, expected, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(expected).max()), err_msg=f"{family} n={n}"
        )


def test_gpt2_gets_a_dynamic_batch_through_eager_attention():
    """torch's SDPA decomposition rejects GPT-2 with a dynamic batch: the import retries with attn=eager."""
    workload = load("hf:gpt2", {"layers": "1", "max_seq": "32"})
    main = workload.mod["main"]
    assert sorted(workload.dims) == ["b", "n"] and workload.config["attn"] == "eager"
    assert [str(p.ty.shape) for p in main.params[:2]] == ["R.shape([b, n])"] * 2
    assert "ndim=" not in main.script()  # every tensor has a known (symbolic) shape
    assert workload.torch_module().model.config.bos_token_id == 0  # 50256 is outside the vocabulary


def test_config_maps_onto_a_relative():
    qwen = load(
        "hf:qwen2", {"hidden": "32", "heads": "2", "kv_heads": "1", "ffn": "48", "max_seq": "16", "layers": "1"}
    )
    cfg = qwen.torch_module().model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (32, 2, 1, 48)
    assert qwen.params["p_model_model_layers_0_self_attn_k_proj_weight"].shape == (16, 32)
    assert "p_model_model_layers_1_self_attn_k_proj_weight" not in qwen.params
    main = qwen.mod["main"]
    assert [str(p.ty.shape) for p in main.params[:2]] == ["R.shape([b, n])"] * 2
    assert str(main.ret_ty.shape) == "R.shape([b, n, 128])" and "ndim=" not in main.script()


def test_local_weights_directory(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(5)
    original = LlamaForCausalLM(cfg).eval()
    original.save_pretrained(tmp_path)
    workload = load("hf:llama", {"weights": str(tmp_path), "max_seq": "16", "max_batch": "1"})
    np.testing.assert_array_equal(
        workload.params["p_model_model_embed_tokens_weight"], original.model.embed_tokens.weight.detach().numpy()
    )
    assert workload.inputs[0].high == 96 and sorted(workload.dims) == ["n"]
    inputs = workload.random_inputs({"n": 7})
    with torch.no_grad():
        expected = original(input_ids=torch.from_numpy(inputs["input_ids"])).logits.numpy()
    np.testing.assert_allclose(workload.reference(inputs, workload.params), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match="holds a llama model, not hf:gpt2"):
        load("hf:gpt2", {"weights": str(tmp_path)})
    with pytest.raises(UserError, match="max_seq=128 exceeds the model's max_position_embeddings=64"):
        load("hf:llama", {"weights": str(tmp_path), "max_seq": "128"})


@pytest.mark.parametrize(
    "spec,config,message",
    [
        ("hf:nosuchmodel", {}, "unknown Hugging Face model type 'nosuchmodel'"),
        ("hf:llama", {"depth": "3"}, "unknown config key 'depth' for hf:llama: valid keys are hidden, layers"),
        ("hf:bert", {"kv_heads": "2"}, "config key 'kv_heads' does not apply to hf:bert"),
        ("hf:llama", {"head": "cls"}, "config head='cls' is invalid"),
        ("hf:llama", {"weights": "/nonexistent/dir"}, "is not a local transformers model directory"),
    ],
)
def test_bad_configs_are_user_errors(spec, config, message):
    with pytest.raises(UserError, match=message):
        load(spec, config)
