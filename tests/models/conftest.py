"""Tiny random GGUF models (relaxtune.models.tiny_gguf), compiled once per session, and transformers'
fp32 model of the same file as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaxtune.models.tiny_gguf import TinyModel, write

# GQA with tied embeddings and quantized weights; MHA, untied, float32; qwen2 (q/k/v biases), GQA
TINY = {
    "gqa_tied": TinyModel(),
    "mha_untied": TinyModel(kv_heads=4, tied=False, quantized=False, seed=1),
    "qwen2": TinyModel(architecture="qwen2", seed=2),
}
MAX_PREFILL = 256
BUCKET_TOPS = (1, 16, 128, MAX_PREFILL)  # boundaries 1|2, 16|17, 128|129; longer prompts prefill in chunks


def compile_tiny(path: Path, out: Path, int8: bool = False) -> Path:
    """Compile a GGUF file as `relaxtune compile gguf:PATH` does (rules only, the test buckets); float32
    activations unless `int8` (int8 activations in decode are compared with their own tolerance)."""
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.workloads import load

    workload = load(f"gguf:{path}", {"max_prefill": str(MAX_PREFILL)})
    job = JobConfig(
        compile=CompileConfig(use_cache=False, int8_activations=int8), buckets=BucketConfig(edges={"n": BUCKET_TOPS})
    )
    return api.compile(workload, targets.resolve("cpu"), job, out).path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """name -> path of that tiny GGUF file (written on first use)."""
    folder = tmp_path_factory.mktemp("gguf")
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            paths[name] = write(folder / f"{name}.gguf", TINY[name])
        return paths[name]

    return get


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_gguf):
    """(name, int8=False) -> the .so of that tiny model, compiled on first use."""
    folder = tmp_path_factory.mktemp("artifacts")
    built: dict[tuple[str, bool], Path] = {}

    def get(name: str, int8: bool = False) -> Path:
        if (name, int8) not in built:
            built[name, int8] = compile_tiny(tiny_gguf(name), folder / f"{name}{'-int8' if int8 else ''}.so", int8)
        return built[name, int8]

    return get


@pytest.fixture(scope="session")
def reference_model(tiny_gguf):
    """name -> transformers' float32 model loaded from the same GGUF file (dequantized by transformers)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    models = {}

    def get(name: str):
        if name not in models:
            path = tiny_gguf(name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
            models[name] = model.eval()
        return models[name]

    return get
