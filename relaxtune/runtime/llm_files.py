"""The files of a language-model artifact and its manifest, read without the compiler.

``NAME.so`` (the functions: embed, prefill, decode, create_paged_kv_cache), ``NAME.json`` (the
manifest: ``"kind": "llm"``, the model's sizes, which weights each function takes, the tokenizer's
ids and chat form, the compiled bounds), ``NAME.weights.safetensors`` (`weights`), and
``NAME.tokenizer.json`` (a `tokenizers` document) when the model has a tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

FORMAT = 1
KIND = "llm"
FUNCTIONS = ("embed", "prefill", "decode")


@dataclass(frozen=True)
class LLMFiles:
    library: Path
    manifest: Path
    weights: Path
    tokenizer: Path


def files(so_path: str | Path) -> LLMFiles:
    so_path = Path(so_path)
    stem = so_path.with_suffix("")

    def beside(suffix: str) -> Path:
        return stem.with_name(stem.name + suffix)

    return LLMFiles(so_path, beside(".json"), beside(".weights.safetensors"), beside(".tokenizer.json"))


def read_manifest(so_path: str | Path) -> tuple[LLMFiles, dict]:
    """The artifact's files and manifest, checked to be a language model of this format; UserError otherwise."""
    found = files(so_path)
    for path in (found.library, found.manifest):
        if not path.exists():
            raise UserError(
                f"artifact file {path} does not exist (a language-model artifact is NAME.so, NAME.json, "
                "NAME.weights.safetensors and NAME.tokenizer.json, written by relaxtune compile gguf:...)"
            )
    try:
        manifest = json.loads(found.manifest.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"artifact manifest {found.manifest} is damaged: {err.msg} at line {err.lineno}") from None
    if manifest.get("kind") != KIND:
        raise UserError(
            f"{found.library} is not a language model (its manifest has no kind {KIND!r}): run it with relaxtune run"
        )
    if manifest.get("format") != FORMAT:
        raise UserError(
            f"artifact manifest {found.manifest} has format {manifest.get('format')!r}; "
            f"this relaxtune reads format {FORMAT}"
        )
    if not found.weights.exists():
        raise UserError(f"artifact file {found.weights} does not exist: compile the model again")
    return found, manifest
