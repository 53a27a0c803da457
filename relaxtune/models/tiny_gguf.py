"""Tiny random-weight GGUF files of the llama family, written with `gguf.GGUFWriter`: what CI compiles
and checks against transformers in place of a real model (no download).

The file is laid out as llama.cpp's converter writes one: q/k rows of llama models permuted for its
rotary form, weights in GGML's block formats (`quantized`: the embedding Q8_0, attention Q4_1, gate and
up Q4_0, down Q8_0; else all F32), an untied output projection in F16, and a GPT-2 byte-level BPE
tokenizer trained on a few sentences with a ChatML template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Once upon a time there was a model "
    "that wrote text one token at a time, 1234 tokens in 2025, and then it stopped. " * 4
)


@dataclass(frozen=True)
class TinyModel:
    """The sizes of a tiny model; `kv_heads` < `heads` for grouped-query attention."""

    architecture: str = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    context: int = 2048
    tied: bool = True
    quantized: bool = True
    seed: int = 0
    embed_scale: float = (
        0.3  # standard deviation of the embeddings (small: the layers, not the token, pick the next one)
    )
    weight_scale: float = 2.0  # projections: this / sqrt(in features)


def _vocabulary() -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    model = tokenizer.to_str()
    import json

    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(model)["model"]["merges"]]
    return tokens, merges


def write(path: str | Path, spec: TinyModel = TinyModel()) -> Path:
    """Write the tiny model `spec` as a GGUF file at `path`; returns the path."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from .gguf_file import permute_rows

    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, merges = _vocabulary()
    d = spec.hidden // spec.heads
    w = gguf.GGUFWriter(str(path), spec.architecture)
    w.add_name("tiny")
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(SPECIAL[0]))
    w.add_eos_token_id(tokens.index(SPECIAL[2]))
    w.add_chat_template(CHATML)

    def tensor(name: str, shape: tuple[int, ...], kind=Q.F32, scale: float | None = None, offset: float = 0.0):
        std = scale if scale is not None else spec.weight_scale / np.sqrt(shape[-1])
        value = (rng.standard_normal(shape) * std + offset).astype(np.float32)
        heads = {".attn_q.": spec.heads, ".attn_k.": spec.kv_heads}
        for key, count in heads.items():
            if key in name and spec.architecture in ("llama", "mistral"):
                value = permute_rows(value, count)  # as llama.cpp's converter stores them
        if not spec.quantized or kind == Q.F32:
            w.add_tensor(name, value)
        elif kind == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)

    tensor("token_embd.weight", (len(tokens), spec.hidden), Q.Q8_0, scale=spec.embed_scale)
    for i in range(spec.layers):
        tensor(f"blk.{i}.attn_norm.weight", (spec.hidden,), scale=0.1, offset=1.0)
        for part, rows in (("q", spec.heads * d), ("k", spec.kv_heads * d), ("v", spec.kv_heads * d)):
            tensor(f"blk.{i}.attn_{part}.weight", (rows, spec.hidden), Q.Q4_1)
            if spec.architecture == "qwen2":
                tensor(f"blk.{i}.attn_{part}.bias", (rows,), scale=0.1)
        tensor(f"blk.{i}.attn_output.weight", (spec.hidden, spec.heads * d), Q.Q4_1)
        tensor(f"blk.{i}.ffn_norm.weight", (spec.hidden,), scale=0.1, offset=1.0)
        tensor(f"blk.{i}.ffn_gate.weight", (spec.ffn, spec.hidden), Q.Q4_0)
        tensor(f"blk.{i}.ffn_up.weight", (spec.ffn, spec.hidden), Q.Q4_0)
        tensor(f"blk.{i}.ffn_down.weight", (spec.hidden, spec.ffn), Q.Q8_0)
    tensor("output_norm.weight", (spec.hidden,), scale=0.1, offset=1.0)
    if not spec.tied:
        tensor("output.weight", (len(tokens), spec.hidden), Q.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
