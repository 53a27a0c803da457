"""hf:DIR: a local transformers checkpoint (config.json + safetensors) through the same builder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relaxtune.errors import UserError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_gguf):
    from relaxtune.models import tokenizer
    from relaxtune.models.gguf_file import GGUFModel

    folder = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=350,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # the default init's logits are near-uniform: greedy would hang on ties
    model.save_pretrained(folder, safe_serialization=True)
    spec = tokenizer.from_gguf(GGUFModel(tiny_gguf("gqa_tied")))  # any byte-level BPE will do
    (folder / "tokenizer.json").write_text(spec.document)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": spec.chat_template})
    )
    return folder, model


def test_checkpoint_compiles_and_matches_transformers(checkpoint, tmp_path):
    from relaxtune import LLM, api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.workloads import load

    folder, model = checkpoint
    workload = load(f"hf:{folder}", {"max_prefill": "32"})
    assert workload.entries == ("prefill",) and workload.config["model.tie_embeddings"] is False
    job = JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(single={"n": 16}))
    so = api.compile(workload, targets.resolve("cpu"), job, tmp_path / "hf.so").path
    llm = LLM(so)
    ids = [4, 8, 15, 16, 23, 42]
    with torch.no_grad():
        want = model(torch.tensor([ids + [7, 9]])).logits[0].numpy()
    llm.reset(8)
    got = [llm.prefill(ids)] + [llm.decode(t) for t in (7, 9)]
    for step, logits in enumerate(got):
        err = np.abs(logits.numpy().reshape(-1) - want[5 + step]).max() / np.abs(want[5 + step]).max()
        assert err < 1e-4, f"step {step}: {err:.2e}"
    assert llm.encode("hi", chat=True)[0] == llm.tokenizer.token_to_id("<|im_start|>")


def test_bad_checkpoint_folders(tmp_path):
    from relaxtune.workloads import load

    with pytest.raises(UserError, match="has no config.json"):
        load(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        UserError, match="model_type 'bert' is not supported: use a checkpoint of one of llama, mistral, qwen2"
    ):
        load(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="has no .safetensors file"):
        load(f"hf:{tmp_path}")
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(UserError, match="model.safetensors is damaged"):
        load(f"hf:{tmp_path}")


def test_rope_parameters_of_transformers_5(tmp_path):
    """transformers 5 saves rope_theta inside rope_parameters; a scaled rope_type is refused as rope_scaling is."""
    from relaxtune.models import random_checkpoint
    from relaxtune.models.hf_checkpoint import HFCheckpoint

    random_checkpoint.write(tmp_path, random_checkpoint.TINY)
    config = json.loads((tmp_path / "config.json").read_text())
    assert HFCheckpoint(tmp_path).config.rope_theta == 100000.0  # the legacy key
    del config["rope_theta"], config["rope_scaling"]
    config["rope_parameters"] = {"rope_theta": 50000.0, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert HFCheckpoint(tmp_path).config.rope_theta == 50000.0
    config["rope_parameters"] = {"rope_theta": 50000.0, "rope_type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="rope scaling .*'linear'.* is not supported: only unscaled rotary embeddings"):
        HFCheckpoint(tmp_path)
