"""What `relaxtune cache ls | show | merge | prune` does, on cache folders (one per target).

`merge` appends through `CacheDatabase` (so it is as safe as a tuning job: locked appends, a
workload written once) and skips records the destination already has. `prune` is the one
operation that rewrites files: it writes the pruned copy beside the originals, keeps the
originals as `*.bak`, and swaps the files in atomically.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from ..errors import UserError
from . import task_index
from .cache import MANIFEST, read_manifest
from .database import RECORDS, WORKLOADS, CacheDatabase, folder_lock, packed, record_json
from .tasks import workload_key

logger = logging.getLogger(__name__)


def target_folders(cache_dir: Path) -> list[Path]:
    """The target folders under a cache root (or the folder itself if it is one)."""
    cache_dir = Path(cache_dir)
    if not cache_dir.exists():
        raise UserError(f"cache {cache_dir} does not exist")
    if (cache_dir / WORKLOADS).exists() or (cache_dir / MANIFEST).exists():
        return [cache_dir]
    return sorted(
        p for p in cache_dir.iterdir() if p.is_dir() and ((p / WORKLOADS).exists() or (p / MANIFEST).exists())
    )


def _secs(record) -> float:
    return sum(float(s) for s in record.run_secs) / len(record.run_secs)


def _by_workload(db: CacheDatabase) -> dict[str, list]:
    groups: dict[str, list] = {}
    for record in db.get_all_tuning_records():
        groups.setdefault(workload_key(record.workload.mod), []).append(record)
    return groups


def list_records(cache_dir: Path) -> list[dict]:
    """One row per tuned kernel: kernel, target, bucket, best and rule-based time, trials."""
    rows = []
    for folder in target_folders(cache_dir):
        target = read_manifest(folder).get("target")
        index = task_index.load(folder)
        for key, records in _by_workload(CacheDatabase(folder)).items():
            entry = index.get(key, {})
            valid = [r for r in records if _secs(r) < 1e9]
            rows.append(
                {
                    "key": key,
                    "kernel": entry.get("kernel", "?"),
                    "workload": entry.get("workload", "?"),
                    "target": target,
                    "folder": folder.name,
                    "bucket": entry.get("bucket"),
                    "best_us": min(_secs(r) for r in valid) * 1e6 if valid else None,
                    "rule_us": entry.get("rule_us"),
                    "trials": len(records),
                }
            )
    return sorted(rows, key=lambda r: (r["folder"], r["workload"], r["kernel"], str(r["bucket"])))


def show(cache_dir: Path, key: str) -> str:
    """The best record of a kernel (by key prefix or kernel name): its trace and its static IR."""
    matches = [r for r in list_records(cache_dir) if r["key"].startswith(key) or r["kernel"] == key]
    if not matches:
        raise UserError(f"no kernel {key!r} in {cache_dir}: `relaxtune cache ls` lists the keys and kernels")
    row = matches[0]
    db = CacheDatabase(Path(cache_dir) if row["folder"] == Path(cache_dir).name else Path(cache_dir) / row["folder"])
    best = min(_by_workload(db)[row["key"]], key=_secs)
    lines = [
        f"# {row['kernel']} ({row['workload']}, bucket {row['bucket']}): best {row['best_us']} us, rules "
        f"{row['rule_us']} us, {row['trials']} trials"
    ]
    lines += ["## trace", *best.trace.as_python(), "## kernel", best.workload.mod.script()]
    return "\n".join(lines)


def merge(sources: list[Path], dest: Path) -> int:
    """Union of caches into `dest`, folder by folder (one per target); returns records added."""
    added = 0
    for source_root in sources:
        for source in target_folders(source_root):
            target_dir = Path(dest) / source.name
            target_dir.mkdir(parents=True, exist_ok=True)
            source_manifest, dest_manifest = read_manifest(source), read_manifest(target_dir)
            if (
                dest_manifest.get("target")
                and source_manifest.get("target")
                and dest_manifest["target"] != source_manifest["target"]
            ):
                raise UserError(f"cannot merge {source}: its target differs from the one in {target_dir}")
            into = CacheDatabase(target_dir, writable=True)
            seen = {json.dumps(record_json(r), sort_keys=True) for r in into.get_all_tuning_records()}
            for record in CacheDatabase(source).get_all_tuning_records():
                text = json.dumps(record_json(record), sort_keys=True)
                if text not in seen:
                    into.commit_tuning_record(record)
                    seen.add(text)
                    added += 1
            known = task_index.load(target_dir)
            task_index.append(target_dir, [e for k, e in task_index.load(source).items() if k not in known])
            if not dest_manifest and source_manifest:
                shutil.copyfile(source / MANIFEST, target_dir / MANIFEST)
    return added


def prune(cache_dir: Path, keep: int = 1) -> tuple[int, int]:
    """Keep the `keep` best records per kernel; returns (records before, after)."""
    if keep < 1:
        raise UserError(f"--keep {keep} must be at least 1")
    before = after = 0
    for folder in target_folders(cache_dir):
        with folder_lock(folder):
            db = CacheDatabase(folder)
            groups = _by_workload(db)
            kept = [r for records in groups.values() for r in sorted(records, key=_secs)[:keep]]
            before += sum(len(v) for v in groups.values())
            after += len(kept)
            tmp = folder / ".prune"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            fresh = CacheDatabase(tmp, writable=True)
            for record in kept:
                fresh.commit_tuning_record(record)
            for name in (WORKLOADS, RECORDS):
                (tmp / name).touch()
                for kept in (folder / name, packed(folder / name)):
                    if kept.exists():
                        shutil.copyfile(kept, kept.with_name(kept.name + ".bak"))
                os.replace(tmp / name, folder / name)
                packed(folder / name).unlink(missing_ok=True)  # the plain file holds what is kept
            shutil.rmtree(tmp)
    return before, after
