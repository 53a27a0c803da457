"""Export a compiled language model: the library, the weights each function takes, the tokenizer and
the manifest (`runtime/llm_files.py` names the files).

The pipeline lifts weight-only work out of each function into ``f_transform_params`` (for a language
model compiled with `Workload.weights_nk` there is usually none: every weight is read as stored). The
weights are stored as the functions take them: each transform runs once here, an output that is one
of the model's weights unchanged is stored once under its name, any computed one under
``<function>.<index>`` (shared by functions whose transforms computed the same bytes). A GPU build's
transforms cannot run on the compiling host: its functions name their transform, which `relaxtune.LLM`
runs once at load, on the device (`device_transforms`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from ..runtime import llm_files, weight_file

logger = logging.getLogger(__name__)

PAGE_SIZE = 16  # the KV cache's tokens per page (TVM's CPU attention kernels are built for 16)


def device_transforms(executable, params: dict[str, np.ndarray]) -> tuple[dict[str, dict], dict[str, np.ndarray]]:
    """For a GPU build, which cannot run here: every function takes the weights as the model has them, and
    the lifted transform, where there is one, runs once at load on the device (relaxtune.LLM). With the
    weights kept (N, K) (KeepWeightsNK) a transform only reorders them: no copy."""
    text = executable.as_text()
    names = list(params)
    found = {f: f"{f}_transform_params" for f in llm_files.FUNCTIONS if f"@{f}_transform_params:" in text}
    return {f: {"weights": names, "transform": found.get(f)} for f in llm_files.FUNCTIONS}, params


def function_weights(executable, params: dict[str, np.ndarray]) -> tuple[dict[str, dict], dict[str, np.ndarray]]:
    """({function: {"weights": names of the weights it takes, in order}}, {name: array} of every weight stored)."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(executable, tvm.cpu())
    names = list(params)
    raw = [tvm.runtime.tensor(params[n]) for n in names]
    by_pointer = {t.data_ptr(): n for n, t in zip(names, raw)}
    stored: dict[str, np.ndarray] = {}
    digests: dict[bytes, str] = {}
    taken: dict[str, list[str]] = {}
    for func in llm_files.FUNCTIONS:
        try:
            transform = vm[f"{func}_transform_params"]
        except (AttributeError, KeyError, RuntimeError, ValueError):  # nothing lifted: it takes the weights as they are
            taken[func] = names
            stored.update(params)
            continue
        outputs = transform(raw)
        taken[func] = []
        for i, out in enumerate(outputs):
            name = by_pointer.get(out.data_ptr())
            if name is not None and tuple(out.shape) == params[name].shape:
                stored[name] = params[name]
            else:
                value = out.numpy()
                key = hashlib.sha256(value.tobytes()).digest() + str(value.shape).encode()
                name = digests.setdefault(key, f"{func}.{i}")
                stored[name] = value
            taken[func].append(name)
    return {f: {"weights": names} for f, names in taken.items()}, stored


def export(executable, workload, target, so_path: Path, plan, cache_fingerprint, schedules, info) -> dict:
    """Write the artifact of a language-model `workload` (`info`: its `workloads.language_model.ModelInfo`)."""
    import tvm

    from ..runtime.artifact import export_library

    found = llm_files.files(so_path)
    device_code = export_library(executable, target, found.library)
    weights = device_transforms if target.is_gpu else function_weights
    functions, stored = weights(executable, workload.params)
    size = weight_file.write(found.weights, stored, {"format": "relaxtune-llm"})
    tok = info.tokenizer
    if tok.document is not None:
        found.tokenizer.write_text(tok.document)
    elif found.tokenizer.exists():
        found.tokenizer.unlink()  # an older artifact's tokenizer is not this model's
    manifest = {
        "format": llm_files.FORMAT,
        "kind": llm_files.KIND,
        "workload": workload.name,
        "spec": workload.spec,
        "source": str(info.source),
        "model": dataclasses.asdict(info.config),
        "functions": functions,
        "weights": {"file": found.weights.name, "bytes": size, "tensors": len(stored)},
        "tokenizer": None
        if tok.document is None
        else {
            "file": found.tokenizer.name,
            "bos_id": tok.bos_id,
            "stop_ids": list(tok.stop_ids),
            "add_bos": tok.add_bos,
            "chat": None if info.chat is None else list(info.chat),
        },
        "max_prefill": info.max_prefill,
        "page_size": PAGE_SIZE,
        "buckets": {dim: [[b.lo, b.hi, b.tune_at] for b in buckets] for dim, buckets in plan.items()},
        "target": target.config,
        "device": "cuda" if target.is_gpu else "cpu",
        "dtype": str(workload.mod["decode"].params[0].ty.dtype),  # the activations' (the embeddings')
        "device_code": device_code,  # cuda: {"format": "fatbin", "arch": ..., "kernels": ..., "bytes": ...}
        "tvm_version": tvm.__version__,
        "cache_fingerprint": cache_fingerprint,
        "schedules": schedules,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    found.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("wrote %s: %d weights, %.1f MB", found.weights, len(stored), size / 1e6)
    return manifest
