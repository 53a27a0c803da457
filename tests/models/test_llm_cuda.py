"""On an NVIDIA GPU (`python -m pytest -m gpu`; benchmarks/gpu_llm.sh OUT tests runs it): a tiny language model
built for cuda (float16, TVM's CUDA KV-cache kernels, relaxtune's GEMV and cuBLAS calls) against the llvm build
of the same checkpoint (float32): next-token logits at every step, greedy tokens, prefill lengths across the buckets."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _has_nvcc() -> bool:
    from relaxtune.errors import UserError
    from relaxtune.kernels.device_code import find_nvcc

    try:
        return bool(find_nvcc()) and shutil.which("g++") is not None
    except UserError:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not _has_nvcc(), reason="no nvcc / g++ (the CUDA toolkit)"),
]

MAX_PREFILL = 64
TOPS = (1, 2, 16, MAX_PREFILL)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{"cpu": LLM, "cuda": LLM} of one tiny GQA model (head_dim 64, a random float32 checkpoint: no gguf
    package on the GPU machine)."""
    from relaxtune import LLM, api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.models import random_checkpoint
    from relaxtune.workloads import load

    folder = tmp_path_factory.mktemp("llm_cuda")
    random_checkpoint.write(folder / "hf", random_checkpoint.TINY, "float32", seed=3)
    out = {}
    for device, spec in (("cpu", "cpu"), ("cuda", "cuda:sm_{}{}".format(*torch.cuda.get_device_capability()))):
        target = targets.resolve(spec)
        workload = load(f"hf:{folder / 'hf'}", {"max_prefill": str(MAX_PREFILL)}, target=target)
        job = JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(edges={"n": TOPS}))
        out[device] = LLM(api.compile(workload, target, job, folder / f"{device}.so").path, device=device)
    return out


def _teacher_forced(llm, prompt: list[int], fed: list[int]) -> np.ndarray:
    llm.reset(len(prompt) + len(fed) + 1)
    steps = [llm.prefill(prompt)] + [llm.decode(t) for t in fed]
    return np.stack([s.numpy().reshape(-1).astype(np.float32) for s in steps])


def test_cuda_logits_and_greedy_tokens_match_the_llvm_build(builds):
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 64, 11]
    fed = np.random.default_rng(0).integers(10, 500, 31).tolist()  # random tokens: a fresh state at every step
    want = _teacher_forced(builds["cpu"], prompt, fed)
    got = _teacher_forced(builds["cuda"], prompt, fed)
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    assert err.max() < 2e-2, f"float16 logits off by {err.max():.2e} of the largest"
    margin = 4 * np.abs(got - want).max()  # a top-2 gap wider than this float16 cannot flip
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > margin
    assert clear.sum() >= len(fed) // 2
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()
    greedy = list(builds["cpu"].generate_tokens(prompt, max_tokens=16, stop=False))
    own = list(builds["cuda"].generate_tokens(prompt, max_tokens=16, stop=False))
    top2 = np.sort(_teacher_forced(builds["cpu"], prompt, greedy[:-1]), axis=-1)[:, -2:]
    unsure = (top2[:, 1] - top2[:, 0]) <= margin
    sure = int(np.argmax(unsure)) if unsure.any() else len(greedy)
    assert own[:sure] == greedy[:sure]  # the greedy tokens, up to the first step float16 could flip


@pytest.mark.parametrize("length", [1, 2, 3, 17, 64, 100])  # bucket edges 1|2|3..16|17..64; 100: two chunks
def test_prefill_lengths_across_buckets(builds, length):
    ids = np.random.default_rng(length).integers(10, 300, length).tolist()
    logits = {}
    for device, llm in builds.items():
        llm.reset(length + 2)
        first = llm.prefill(ids).numpy().astype(np.float32).reshape(-1)
        logits[device] = np.stack([first, llm.decode(7).numpy().astype(np.float32).reshape(-1)])
    err = np.abs(logits["cuda"] - logits["cpu"]).max() / np.abs(logits["cpu"]).max()
    assert err < 2e-2, f"prefill of {length}: {err:.2e}"


def test_q4f16_decode_with_the_fused_mlp_matches_the_five_kernels(tmp_path):
    """--quantize q4f16 on a model whose sizes the fused 4-bit MLP takes (hidden 256, ffn 512: 8 and 16 groups a
    row): decode with relaxtune_q4mlp_i8 (the default) against the same build with CudaLibraries(q4_mlp=False), both
    with int8 activations, teacher-forced through 16 steps of the KV cache."""
    from relaxtune import LLM, api, targets
    from relaxtune.config import BucketConfig, CompileConfig, CudaLibraries, JobConfig, QuantizeConfig
    from relaxtune.models import random_checkpoint
    from relaxtune.workloads import load

    config = random_checkpoint.TINY | {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    random_checkpoint.write(tmp_path / "hf", config | {"num_key_value_heads": 2}, "float16", seed=5)
    target = targets.resolve("cuda:sm_{}{}".format(*torch.cuda.get_device_capability()))
    workload = load(f"hf:{tmp_path / 'hf'}", {"max_prefill": "16"}, None, QuantizeConfig("q4f16", 32), target)
    llms = {}
    for fused in (True, False):
        compile_config = CompileConfig(use_cache=False, cublas=CudaLibraries(q4_mlp=fused))
        job = JobConfig(compile=compile_config, buckets=BucketConfig(edges={"n": (1, 16)}))
        llms[fused] = LLM(api.compile(workload, target, job, tmp_path / f"q4-{fused}.so").path, device="cuda")
    prompt, fed = [5, 17, 42, 99, 3], np.random.default_rng(1).integers(10, 500, 16).tolist()
    got, want = (_teacher_forced(llms[fused], prompt, fed) for fused in (True, False))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-2, f"the fused MLP's logits off by {err:.2e} of the largest"
