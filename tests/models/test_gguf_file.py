"""Reading GGUF files: the config from metadata, tensors dequantized and un-permuted, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune.errors import UserError
from relaxtune.models.gguf_file import GGUFModel, permute_rows, unpermute_rows
from relaxtune.models.tiny_gguf import TinyModel, write


def test_config_from_metadata(tiny_gguf):
    c = GGUFModel(tiny_gguf("gqa_tied")).config
    assert (c.architecture, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama",
        64,
        2,
        4,
        2,
        16,
    )
    assert (c.intermediate_size, c.vocab_size, c.tie_embeddings, c.attention_bias) == (128, 350, True, False)
    assert c.rope_theta == 10000.0 and c.context_length == 2048
    untied = GGUFModel(tiny_gguf("mha_untied")).config
    assert untied.num_kv_heads == untied.num_heads == 4 and not untied.tie_embeddings
    assert GGUFModel(tiny_gguf("qwen2")).config.attention_bias


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(rows, 2), 2), rows)
    assert not np.array_equal(permute_rows(rows, 2), rows)


def test_tensors_match_gguf_dequantize_and_transformers(tiny_gguf, reference_model):
    """q/k rows come back in transformers' order (its GGUF loader un-permutes too); others as dequantized."""
    model = GGUFModel(tiny_gguf("gqa_tied"))
    hf = dict(reference_model("gqa_tied").named_parameters())
    assert model.quant_type("blk.0.attn_q.weight") == "Q4_1" and model.quant_type("token_embd.weight") == "Q8_0"
    pairs = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.1.attn_k.weight": "model.layers.1.self_attn.k_proj.weight",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
    }
    for ours, theirs in pairs.items():
        np.testing.assert_array_equal(model.tensor(ours), hf[theirs].detach().numpy())


def test_unsupported_architecture_is_one_line(tmp_path):
    path = write(tmp_path / "gemma.gguf", TinyModel(architecture="gemma"))
    with pytest.raises(
        UserError, match=r"architecture 'gemma' is not supported: use a GGUF of one of llama, mistral, qwen2"
    ):
        GGUFModel(path)


def test_not_a_gguf_file_and_truncated_file(tmp_path, tiny_gguf):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, this is not a model")
    with pytest.raises(UserError, match=r"is not a GGUF file: it starts with b'hell'"):
        GGUFModel(text)
    data = tiny_gguf("gqa_tied").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="is truncated or damaged"):
        GGUFModel(cut)
    with pytest.raises(UserError, match="does not exist"):
        GGUFModel(tmp_path / "missing.gguf")
