"""The tokenizer built from GGUF metadata, and the chat template reduced to the text around one message."""

from __future__ import annotations

import pytest

from relaxtune.models import tokenizer
from relaxtune.models.chat_template import wrap_parts
from relaxtune.models.gguf_file import GGUFModel
from relaxtune.models.tiny_gguf import CHATML

TEXTS = [
    "The capital of France is",
    "Once upon a time, there was a model.",
    "  spaces   and\nnew lines\t!",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_tokens_match_transformers_gguf_tokenizer(tiny_gguf):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    path = tiny_gguf("gqa_tied")
    spec = tokenizer.from_gguf(GGUFModel(path))
    ours = Tokenizer.from_str(spec.document)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False), text
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_smollm_pre_tokenizer_splits_digits_as_llama_cpp(tiny_gguf):
    """tokenizer.ggml.pre = smollm: llama.cpp isolates every digit (\\p{N}) before the GPT-2 split."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(tokenizer.from_gguf(GGUFModel(tiny_gguf("gqa_tied"))).document)
    pieces = ours.encode("in 2025", add_special_tokens=False).tokens
    assert pieces[-4:] == ["2", "0", "2", "5"]


def test_special_ids_and_stop_tokens(tiny_gguf):
    spec = tokenizer.from_gguf(GGUFModel(tiny_gguf("gqa_tied")))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(spec.document)
    assert spec.stop_ids == (tok.token_to_id("<|im_end|>"),)
    assert spec.bos_id == tok.token_to_id("<|endoftext|>") and not spec.add_bos
    assert spec.chat_template == CHATML


def test_chat_template_parts():
    assert wrap_parts(CHATML, {}) == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    smollm = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + "
        "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    before, after = wrap_parts(smollm, {})
    assert before.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and before.endswith(
        "<|im_start|>user\n"
    )
    assert after == "<|im_end|>\n<|im_start|>assistant\n"
    assert wrap_parts(None, {}) is None
    assert wrap_parts("{{ raise_exception('no') }}", {}) is None
