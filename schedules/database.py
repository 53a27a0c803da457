"""The tuning cache: MetaSchedule's JSON database files, read tolerantly and written append-only.

The files are the ones `ms.database.JSONDatabase` writes (`database_workload.json`: one
`[structural_hash, base64 IR]` per line; `database_tuning_record.json`: one
`[workload_line, [trace, run_secs, target, args_info]]` per line), so stock MetaSchedule can read
them. What this class adds:

- a damaged line (an interrupted write, a hand edit) is reported with its file and line number and
  skipped; every other record stays usable. The file is never rewritten or truncated;
- each record is appended and flushed to disk as soon as it is measured, so an interrupted job
  keeps every record committed before the interrupt; a half-written last line is closed with a
  newline before anything new is appended;
- several jobs may write one folder at once: each append holds the folder's lock for that line,
  and a workload another job already wrote is reused, never written twice;
- a folder may hold the two files packed (`NAME.xz`, `xz -9`: the workload file is base64 of
  indented IR JSON and packs ~28x, 270 KB to 9.5 KB for the committed cuda cache, whose files
  travel with every GPU-machine call): read as they are, and unpacked in place (`NAME`, the
  `.xz` removed) by the first job that opens the folder to write.
"""

from __future__ import annotations

import fcntl
import json
import logging
import lzma
import os
from contextlib import contextmanager
from pathlib import Path

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.database import TuningRecord, Workload

logger = logging.getLogger(__name__)

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"


def _plain(obj):
    """TVM JSON containers → Python JSON; an IndexMap is kept as its IR JSON string, the way
    `Trace.as_json` writes one (the stock converter raises on it: layout-rewriting traces)."""
    import tvm

    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return obj.value
    if isinstance(obj, tvm.tirx.IndexMap):
        return tvm.ir.save_json(obj)
    if hasattr(obj, "items"):
        return {str(k): _plain(v) for k, v in obj.items()}
    return [_plain(x) for x in obj]


def record_json(record: TuningRecord) -> list:
    """A record as JSONDatabase writes it: [trace, run_secs, target, args_info]."""
    return [
        _plain(record.trace.as_json(remove_postproc=False)),
        [float(s) for s in record.run_secs] if record.run_secs is not None else None,
        _plain(record.target.export()) if record.target is not None else None,
        [_plain(a.as_json()) for a in record.args_info] if record.args_info is not None else None,
    ]


@contextmanager
def folder_lock(folder: Path):
    """The cache folder's lock, held for one append or one manifest update (never a whole job)."""
    with open(Path(folder) / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def packed(path: Path) -> Path:
    """Where the packed form of a cache file is kept (`NAME.xz`)."""
    return path.with_name(path.name + ".xz")


def read_lines(path: Path) -> list[tuple[int, object | None, str]]:
    """(line number, parsed JSON or None when damaged, raw text) for every non-empty line of
    `path`, or of its packed form where only that exists."""
    if not path.exists():
        if not packed(path).exists():
            return []
        opened = lzma.open(packed(path), "rt", encoding="utf-8", errors="replace")
    else:
        opened = open(path, encoding="utf-8", errors="replace")
    out = []
    with opened as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                out.append((number, json.loads(raw), raw))
            except json.JSONDecodeError:
                out.append((number, None, raw))
    return out


def append_lines(folder: Path, name: str, entries: list[dict]) -> None:
    """Append JSON lines to `folder/name` under the folder's lock, flushed to disk (the cache's
    side files: task index, bucket verdicts); nothing is ever rewritten."""
    if not entries:
        return
    with folder_lock(folder), open(Path(folder) / name, "a", encoding="utf-8") as f:
        for entry in entries:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


@derived_object
class CacheDatabase(ms.database.PyDatabase):
    """A MetaSchedule database over one cache folder (one target)."""

    def __init__(self, folder: Path, *, writable: bool = False):
        super().__init__()
        self.folder = Path(folder)
        self.writable = writable
        self.problems: list[str] = []  # one line per damaged or orphaned entry, in file order
        self._mem = ms.database.MemoryDatabase()
        self._index: dict[str, int] = {}  # structural hash → line index in the workload file
        self._workload_lines = 0  # non-empty lines in the workload file, damaged ones included
        self._workload_offset = 0  # bytes of the workload file already indexed
        if writable:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self._locked():
                for name in (WORKLOADS, RECORDS):
                    self._unpack(self.folder / name)
                    self._close_partial_line(self.folder / name)
        self._load()

    # -- loading -----------------------------------------------------------------------------
    def _load(self) -> None:
        workloads: list[Workload | None] = []
        for number, obj, _ in read_lines(self.folder / WORKLOADS):
            workload = None
            if obj is not None:
                try:
                    workload = Workload.from_json(obj)
                except Exception:  # TVM raises several types on a bad IR blob
                    workload = None
            if workload is None:
                self.problems.append(f"{self.folder / WORKLOADS}:{number}: damaged workload line skipped")
            else:
                self._index.setdefault(str(obj[0]), len(workloads))
                self._mem.commit_workload(workload.mod)
            workloads.append(workload)  # keep line positions: records refer to them
        self._workload_lines = len(workloads)
        path = self.folder / WORKLOADS
        self._workload_offset = path.stat().st_size if path.exists() else 0
        for number, obj, _ in read_lines(self.folder / RECORDS):
            where = f"{self.folder / RECORDS}:{number}"
            if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int)):
                self.problems.append(f"{where}: damaged record line skipped")
                continue
            if not 0 <= obj[0] < len(workloads) or workloads[obj[0]] is None:
                self.problems.append(f"{where}: record of missing workload line {obj[0] + 1} skipped")
                continue
            try:
                record = TuningRecord.from_json(obj[1], workloads[obj[0]])
            except Exception:
                self.problems.append(f"{where}: unreadable record skipped")
                continue
            self._mem.commit_tuning_record(record)
        for line in self.problems:
            logger.warning("%s", line)

    # -- writing: several jobs may append to one folder at once --------------------------------
    def _locked(self):
        return folder_lock(self.folder)

    @staticmethod
    def _unpack(path: Path) -> None:
        """A packed file becomes the plain one it was (appends go there); the plain one, where
        both exist, is the newer: the packed one is left alone."""
        if path.exists() or not packed(path).exists():
            return
        tmp = path.with_name(path.name + ".unpacking")
        with lzma.open(packed(path), "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read())
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
        packed(path).unlink()
        logger.info("%s unpacked to %s (a job writes the folder)", packed(path), path.name)

    @staticmethod
    def _close_partial_line(path: Path) -> None:
        """An interrupted append leaves a line without newline; end it so new lines stay whole."""
        if path.exists() and path.stat().st_size:
            with open(path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def _refresh_index(self) -> None:
        """Read workload lines other jobs appended since we last looked (call under the lock)."""
        path = self.folder / WORKLOADS
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self._workload_offset)
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # a line still being written: the lock makes this an interrupted one
                self._workload_offset += len(raw)
                if not raw.strip():
                    continue
                try:
                    key = str(json.loads(raw)[0])
                except (json.JSONDecodeError, IndexError, TypeError):
                    key = None
                if key is not None:
                    self._index.setdefault(key, self._workload_lines)
                self._workload_lines += 1

    def _append(self, name: str, line: object | None = None, workload_key: str | None = None) -> int:
        """Append one JSON line under the lock; for a workload, first reuse a line another job wrote."""
        if not self.writable:
            raise RuntimeError(f"cache {self.folder} was opened read-only")
        with self._locked():
            path = self.folder / name
            self._close_partial_line(path)
            if name == WORKLOADS:
                self._refresh_index()
                if workload_key in self._index:
                    return self._index[workload_key]
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
                f.flush()
                os.fsync(f.fileno())
            if name == WORKLOADS:
                self._refresh_index()
                return self._index[workload_key]
        return -1

    # -- the MetaSchedule Database interface ---------------------------------------------------
    def has_workload(self, mod) -> bool:
        return self._mem.has_workload(mod)

    def commit_workload(self, mod) -> Workload:
        workload = self._mem.commit_workload(mod)
        key = str(workload.as_json()[0])
        if key not in self._index:
            self._append(WORKLOADS, workload.as_json(), workload_key=key)
        return workload

    def commit_tuning_record(self, record: TuningRecord) -> None:
        workload = self.commit_workload(record.workload.mod)
        self._mem.commit_tuning_record(record)
        self._append(RECORDS, [self._index[str(workload.as_json()[0])], record_json(record)])

    def get_top_k(self, workload: Workload, top_k: int) -> list[TuningRecord]:
        return self._mem.get_top_k(workload, top_k)

    def get_all_tuning_records(self) -> list[TuningRecord]:
        return self._mem.get_all_tuning_records()

    def query_tuning_record(self, mod, target, workload_name):
        return self._mem.query_tuning_record(mod, target, workload_name)

    def query_schedule(self, mod, target, workload_name):
        return self._mem.query_schedule(mod, target, workload_name)

    def query_ir_module(self, mod, target, workload_name):
        return self._mem.query_ir_module(mod, target, workload_name)

    def __len__(self) -> int:
        return len(self._mem)

    # -- helpers for relaxtune -----------------------------------------------------------------
    def records_for(self, mod) -> list[TuningRecord]:
        """Every valid record of this workload, best first."""
        if not self._mem.has_workload(mod):
            return []
        return list(self._mem.get_top_k(self._mem.commit_workload(mod), 1 << 20))

    def records_per_workload(self) -> list[tuple[Workload, int]]:
        """Every workload with records and how many it has (failed builds and runs included)."""
        counts: dict[int, list] = {}  # records of one workload share its object
        for record in self.get_all_tuning_records():
            counts.setdefault(hash(record.workload), [record.workload, 0])[1] += 1
        return [(workload, count) for workload, count in counts.values()]
