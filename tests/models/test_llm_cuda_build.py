"""A language model built for `--target cuda` on this CPU machine (no GPU, no nvcc needed to build): float16
weights and activations, TVM's paged KV cache with its own CUDA kernels, relaxtune's GEMV kernel in decode
and cuBLAS in prefill, every other kernel with a GPU schedule, no CPU kernel left."""

from __future__ import annotations

import re

import pytest

from relaxtune.errors import UserError

KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(")


@pytest.fixture(scope="module")
def cuda_build(tiny_gguf):
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.workloads import load

    target = targets.resolve("cuda")
    workload = load(f"gguf:{tiny_gguf('gqa_tied')}", {"max_prefill": "64"}, target=target)
    job = JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(edges={"n": (1, 16, 64)}))
    executable, _report, _folder = api.build(workload, target, job)
    return workload, executable


def test_weights_and_activations_are_float16(cuda_build):
    workload, _ = cuda_build
    assert workload.config["quantize"] == "f16"  # auto on cuda: the file's Q4/Q8 blocks dequantized
    assert {str(v.dtype) for v in workload.params.values()} == {"float16"}
    assert str(workload.mod["decode"].params[0].ty.dtype) == "float16"


def test_kernels_are_cuda_with_the_kv_cache_ones(cuda_build):
    from relaxtune.kernels.device_code import cuda_sources

    _, executable = cuda_build
    (source,) = cuda_sources(executable.mod)
    kernels = set(KERNEL.findall(source.decode()))
    # TVM's paged KV cache kernels, built for cuda (relaxtune's CPU ones replace them only on llvm)
    for name in KV_KERNELS:
        assert any(k.startswith(name) for k in kernels), f"{name} missing from {sorted(kernels)}"
    assert not [k for k in kernels if "cpu" in k]


def test_decode_calls_the_gemv_kernel_and_graphs_stop_at_the_cache(cuda_build):
    _, executable = cuda_build
    text = executable.as_text()
    decode = text[text.index("\n@decode:") : text.index("\n@", text.index("\n@decode:") + 2)]
    prefill = text[text.index("\n@prefill_n2_16:") :]
    assert "relaxtune_gemv_nk" in decode and "relaxtune_cublas_gemm_nk" not in decode
    # the norms before q/k/v, gate/up and the head, the SwiGLU between gate/up and down: in the GEMVs
    # (fuse_gemv_prologue_cuda.py; their calls sit in the decode's captured graphs)
    assert "relaxtune_gemv_nk_rms" in text and "relaxtune_gemv_nk_rms_glu" in text and "_swiglu" not in decode
    assert "relaxtune_cublas_gemm_nk" in prefill[: prefill.index("\n@", 2)]
    # the static stretches between the cache's attention calls are CUDA graphs; the builtin stays outside
    assert decode.count("attention_kv_cache_attention_with_fused_qkv") == 2  # one per layer (2 layers)
    assert decode.count("cuda_graph.run_or_capture") >= 2


def test_q4f16_decode_reads_the_4bit_weights_with_the_q4_gemv(tmp_path, caplog):
    """--quantize q4f16 on cuda: relaxtune's 4-bit groups (the tied embedding too), packed for the GPU at load;
    decode's projections and the output projection on relaxtune_q4gemv, prefill's on dequantize + cuBLAS; at sizes
    the fused kernel takes (hidden 256: 8 groups a row), each layer's decode MLP as one relaxtune_q4mlp_i8 call."""
    import logging

    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig, QuantizeConfig
    from relaxtune.models import random_checkpoint
    from relaxtune.workloads import load

    config = random_checkpoint.TINY | {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    random_checkpoint.write(tmp_path / "hf", config | {"num_key_value_heads": 2}, "float16")
    target = targets.resolve("cuda")
    workload = load(f"hf:{tmp_path / 'hf'}", {"max_prefill": "64"}, None, QuantizeConfig("q4f16", 32), target)
    assert workload.config["quantize"] == "q4f16" and workload.config["group_size"] == 32
    assert {str(v.dtype) for v in workload.params.values()} == {"uint8", "float16"}
    assert str(workload.mod["decode"].params[0].ty.dtype) == "float16"
    job = JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(edges={"n": (1, 64)}))
    with caplog.at_level(logging.INFO, logger="relaxtune.relax_passes"):
        executable = api.build(workload, target, job)[0]
    # 2 layers x (q/k/v, o, gate/up, down) + the tied output projection
    assert "decode: 9 4-bit projection(s) -> relaxtune_q4gemv" in caplog.text
    assert "prefill_n2_64: 9 4-bit projection(s) -> dequantize + cuBLAS" in caplog.text
    text = executable.as_text()
    decode = text[text.index("\n@decode:") : text.index("\n@", text.index("\n@decode:") + 2)]
    assert "relaxtune_q4gemv" in decode and "relaxtune_gemv_nk" not in decode
    assert "decode: 2 4-bit MLP(s) as one kernel each" in caplog.text and "relaxtune_q4mlp_i8" in decode


KV_KERNELS = (
    "batch_prefill_ragged_kv",
    "batch_prefill_paged_kv",
    "batch_decode_paged_kv",
    "tir_attention_merge_state",
    "tir_kv_cache_transpose_append",
    "fused_rope",
    "copy_single_page",
    "compact_kv_copy",
)


@pytest.mark.parametrize(
    "quantize, dtype, message",
    [
        ("q4f32", None, "--quantize q4f32 is not supported on cuda: use one of auto, f16, q4f16"),
        ("f32", None, "--quantize f32 is not supported on cuda"),
        ("auto", "float32", "--dtype float32: language models compile with float16 activations on cuda"),
    ],
)
def test_cuda_refuses_what_it_has_no_kernels_for(tiny_gguf, quantize, dtype, message):
    from relaxtune import targets
    from relaxtune.config import QuantizeConfig
    from relaxtune.workloads import load

    with pytest.raises(UserError, match=re.escape(message)):
        load(f"gguf:{tiny_gguf('gqa_tied')}", {}, dtype, QuantizeConfig(quantize), targets.resolve("cuda"))


def test_f16_is_for_cuda(tiny_gguf):
    from relaxtune.config import QuantizeConfig
    from relaxtune.workloads import load

    with pytest.raises(UserError, match="--quantize f16 is for --target cuda"):
        load(f"gguf:{tiny_gguf('gqa_tied')}", {}, None, QuantizeConfig("f16"))


def _nvcc() -> bool:
    from relaxtune.kernels.device_code import find_nvcc

    try:
        return bool(find_nvcc())
    except UserError:
        return False


@pytest.mark.skipif(not _nvcc(), reason="needs nvcc (the CUDA toolkit)")
def test_cli_cuda_artifact_and_its_device(tiny_gguf, tmp_path, capsys):
    import json

    from relaxtune import LLM
    from relaxtune.__main__ import main

    so = tmp_path / "tiny-cuda.so"
    args = ["compile", f"gguf:{tiny_gguf('gqa_tied')}", "--target", "cuda", "--config", "max_prefill=32"]
    assert main([*args, "--buckets", "n=1,32", "--no-cache", "-o", str(so)]) == 0
    manifest = json.loads(so.with_suffix(".json").read_text())
    assert manifest["device"] == "cuda" and manifest["dtype"] == "float16" and manifest["target"]["arch"] == "sm_90"
    assert manifest["device_code"]["format"] == "fatbin" and b"__global__" not in so.read_bytes()
    functions = manifest["functions"]
    assert functions["decode"]["transform"] == "decode_transform_params"  # run at load, on the GPU
    assert set(functions["decode"]["weights"]) == set(functions["prefill"]["weights"])
    capsys.readouterr()
    assert main(["generate", str(so), "--prompt", "hi", "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "was compiled for cuda (sm_90), not cpu: run it with --device cuda" in line
    import tvm

    if not tvm.cuda(0).exist:
        with pytest.raises(UserError, match="runs on cuda, but"):
            LLM(so)


@pytest.mark.slow
def test_the_flash_ragged_prefill_is_called_and_linked_by_default(tmp_path):
    """The default FlashAttention (paged_prefill on) on a model whose head_dim (64) the flash kernel takes."""
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, FlashAttention, JobConfig
    from relaxtune.kernels import flash_attention
    from relaxtune.models.tiny_gguf import TinyModel, write
    from relaxtune.workloads import load

    target = targets.resolve("cuda")
    path = write(tmp_path / "d64.gguf", TinyModel(hidden=256, layers=1, heads=4, kv_heads=2, ffn=256))
    workload = load(f"gguf:{path}", {"max_prefill": "64"}, target=target)
    options = CompileConfig(use_cache=False)
    assert options.flash_attention == FlashAttention(paged_prefill=True)
    job = JobConfig(compile=options, buckets=BucketConfig(edges={"n": (1, 16, 64)}))
    result = api.compile(workload, target, job, tmp_path / "model.so")
    # the flash object is linked in only where the executable calls a relaxtune_flash_attention* function
    # (artifact.export_library); a language model's attention has no other
    assert f"__tvm_ffi_{flash_attention.RAGGED_FUNCTION}".encode() in result.path.read_bytes()
