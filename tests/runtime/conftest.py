"""One tiny compiled language model for the runtime's tests (relaxtune.models.tiny_gguf, one prefill bucket)."""

from __future__ import annotations

import pytest

MAX_PREFILL = 64


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    """The .so of a tiny GQA model compiled with max_prefill 64 (rules only, one prefill bucket)."""
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.models.tiny_gguf import TinyModel, write
    from relaxtune.workloads import load

    folder = tmp_path_factory.mktemp("tiny_llm")
    path = write(folder / "tiny.gguf", TinyModel(context=256))
    workload = load(f"gguf:{path}", {"max_prefill": str(MAX_PREFILL)})
    job = JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(single={"n": 32}))
    return api.compile(workload, targets.resolve("cpu"), job, folder / "tiny.so").path
