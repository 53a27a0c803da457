"""Target names → TVM targets, and the short name each target's cache folder is keyed by."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from .errors import UserError

NAMES = ("cpu", "cuda")


@dataclass(frozen=True)
class ResolvedTarget:
    """A TVM target plus the stable JSON and folder name that identify it in the cache."""

    target: object  # tvm.target.Target
    config: dict

    @property
    def kind(self) -> str:
        return self.config["kind"]

    @property
    def json(self) -> str:
        return json.dumps(self.config, sort_keys=True)

    @property
    def slug(self) -> str:
        """A folder name: kind, cpu/arch, and a hash of the full config so that no two targets share one."""
        label = self.config.get("mcpu") or self.config.get("arch") or "generic"
        digest = hashlib.sha1(self.json.encode()).hexdigest()[:8]
        return f"{self.kind}-{label}-{digest}"

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"


def host_cpu_config() -> dict:
    """This host's LLVM target: its CPU model (so its vector features) and its core count."""
    from tvm.target import codegen

    return {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": os.cpu_count() or 1}


def cuda_config(arch: str = "sm_90") -> dict:
    """An NVIDIA target with every limit MetaSchedule asks for (H100/H200 class by default)."""
    if arch not in ("sm_80", "sm_86", "sm_89", "sm_90"):
        raise UserError(f"unsupported CUDA arch {arch!r}: use one of sm_80, sm_86, sm_89, sm_90")
    smem = 49152
    return {
        "kind": "cuda",
        "arch": arch,
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": smem,
        "thread_warp_size": 32,
        "registers_per_block": 65536,
    }


def resolve(spec: str) -> ResolvedTarget:
    """`cpu`, `cuda`, `cuda:sm_80`, or a TVM target as JSON (`{"kind": "llvm", ...}`)."""
    import tvm

    spec = spec.strip()
    if spec == "cpu":
        config = host_cpu_config()
    elif spec == "cuda" or spec.startswith("cuda:"):
        config = cuda_config(spec.partition(":")[2] or "sm_90")
    elif spec.startswith("{"):
        try:
            config = json.loads(spec)
        except json.JSONDecodeError as err:
            raise UserError(
                f"target {spec!r} is not valid JSON ({err.msg}); give `cpu`, `cuda` or a JSON object"
            ) from None
        if not isinstance(config, dict) or "kind" not in config:
            raise UserError(f'target {spec!r} must be a JSON object with a "kind" key, e.g. {{"kind": "llvm"}}')
    else:
        raise UserError(
            f"unknown target {spec!r}: use one of {', '.join(NAMES)}, cuda:ARCH, or a TVM target JSON object"
        )
    try:
        target = tvm.target.Target(config)
    except Exception as err:  # TVM raises several types for a bad config
        raise UserError(f"TVM rejects target {json.dumps(config)}: {str(err).splitlines()[-1]}") from None
    return ResolvedTarget(target=target, config=config)
