"""The cache folder of one target: its database and its manifest (`tuning_logs/<target>/`)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import tempfile
from pathlib import Path

from ..errors import UserError
from ..targets import ResolvedTarget

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def folder_for(cache_dir: Path, target: ResolvedTarget) -> Path:
    return Path(cache_dir) / target.slug


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.exists():
        return {}
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(
            f"cache manifest {path} is damaged ({err.msg} at line {err.lineno}); it was left as is"
        ) from None
    if not isinstance(manifest, dict):
        raise UserError(f"cache manifest {path} is not a JSON object; it was left as is")
    return manifest


def check_compatible(folder: Path, target: ResolvedTarget) -> dict:
    """The manifest, after checking the folder was written for this target and this TVM."""
    import tvm

    manifest = read_manifest(folder)
    if manifest.get("target") and manifest["target"] != target.config:
        raise UserError(
            f"cache {folder} holds records for target {json.dumps(manifest['target'])}, "
            f"not {target.json}; use the folder of that target or another --cache"
        )
    if manifest.get("tvm_version") and manifest["tvm_version"] != tvm.__version__:
        raise UserError(
            f"cache {folder} was written by TVM {manifest['tvm_version']}, this is TVM {tvm.__version__}; "
            "records do not carry over between TVM versions: use another --cache"
        )
    return manifest


def write_manifest(folder: Path, target: ResolvedTarget, workload: str, entry: dict) -> None:
    """Record a job in the manifest, replacing the file atomically (never half-written)."""
    import tvm

    from .database import folder_lock

    with folder_lock(folder):
        _update_manifest(folder, target, workload, entry, tvm.__version__)


def _update_manifest(folder: Path, target: ResolvedTarget, workload: str, entry: dict, tvm_version: str) -> None:
    manifest = read_manifest(folder)
    manifest.setdefault("created", _now())
    manifest.update(tvm_version=tvm_version, target=target.config, updated=_now())
    workloads = manifest.setdefault("workloads", {})
    workloads[workload] = {**workloads.get(workload, {}), **entry, "updated": _now()}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".manifest.")
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
