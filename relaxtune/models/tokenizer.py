"""The tokenizer of a model as a `tokenizers` JSON document, so the deploy host needs only the
`tokenizers` package: built from a GGUF file's metadata, or copied from a checkpoint's
``tokenizer.json``.

GGUF files carry GPT-2 style byte-level BPE tokenizers (``tokenizer.ggml.model = gpt2``) as their
vocabulary (``tokens``), ``merges`` and token types (control tokens become special tokens, so
``<|im_start|>`` in a chat prompt is one token). The text is split before BPE as llama.cpp splits
it for the file's ``tokenizer.ggml.pre`` (`PRE_TOKENIZERS`): SmolLM's, for example, isolates every
digit first. A file with another tokenizer model (SentencePiece's ``llama``) gets no tokenizer: the
model still compiles, and `relaxtune generate` says the artifact has none.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4
_GPT2_SPLIT = "gpt2"
_DIGITS_THEN_GPT2 = "digits"
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = _QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")  # numbers in runs of up to 3 digits
# tokenizer.ggml.pre -> how llama.cpp (llama-vocab.cpp) splits the text before BPE
PRE_TOKENIZERS = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "mpt": _GPT2_SPLIT,
    "olmo": _GPT2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "qwen2": _QWEN2_REGEX,
    "stablelm2": _QWEN2_REGEX,
    "llama-bpe": _LLAMA3_REGEX,
    "llama3": _LLAMA3_REGEX,
}


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer and the token ids generation needs. `document` is None when the source has none."""

    document: str | None
    bos_id: int | None = None
    stop_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None
    special: dict[str, str] = field(default_factory=dict)  # bos_token / eos_token text, for chat templates


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == _GPT2_SPLIT:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(kind), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def from_gguf(model) -> TokenizerSpec:
    """The tokenizer in a `GGUFModel`'s metadata (see the module docstring)."""
    kind = model.field("tokenizer.ggml.model")
    tokens = model.field("tokenizer.ggml.tokens")
    if kind != "gpt2" or not tokens:
        logger.warning(
            "%s: tokenizer %r is not a GPT-2 BPE tokenizer (tokenizer.ggml.model = gpt2): the artifact gets none",
            model.path,
            kind,
        )
        return TokenizerSpec(None)
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pre = model.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        logger.warning(
            "%s: pre-tokenizer %r is not known here: the text is split as GPT-2 does (known: %s)",
            model.path,
            pre,
            ", ".join(sorted(PRE_TOKENIZERS)),
        )
    types = model.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in model.field("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS.get(pre, _GPT2_SPLIT))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )
    bos, eos, eot = (model.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot"))
    stops = tuple(sorted({int(i) for i in (eos, eot) if i is not None}))
    special = {
        k: tokens[int(i)] for k, i in (("bos_token", bos), ("eos_token", eos)) if i is not None and int(i) < len(tokens)
    }
    return TokenizerSpec(
        tokenizer.to_str(),
        None if bos is None else int(bos),
        stops,
        bool(model.field("tokenizer.ggml.add_bos_token", False)),
        model.field("tokenizer.chat_template"),
        special,
    )


def from_folder(folder: Path, hf_config: dict) -> TokenizerSpec:
    """A checkpoint folder's ``tokenizer.json`` and the ids and template of its ``tokenizer_config.json``."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        logger.warning("%s has no tokenizer.json: the artifact gets no tokenizer", folder)
        return TokenizerSpec(None)
    document = path.read_text()
    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(document)

    def text(value):  # tokenizer_config names a token as a string or as {"content": ...}
        return value.get("content") if isinstance(value, dict) else value

    special = {k: text(settings[k]) for k in ("bos_token", "eos_token") if text(settings.get(k))}
    eos = hf_config.get("eos_token_id")
    stops = {*(eos if isinstance(eos, list) else [eos])} - {None}
    if "eos_token" in special and tokenizer.token_to_id(special["eos_token"]) is not None:
        stops.add(tokenizer.token_to_id(special["eos_token"]))
    bos = hf_config.get("bos_token_id")
    return TokenizerSpec(
        document,
        bos,
        tuple(sorted(int(i) for i in stops)),
        bool(settings.get("add_bos_token", False)),
        settings.get("chat_template"),
        special,
    )
