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
- one writer at a time: a job that writes holds an exclusive lock on the folder.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.database import TuningRecord, Workload
from tvm.ir.utils import derived_object

from ..errors import UserError

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


def _read_lines(path: Path) -> list[tuple[int, object | None, str]]:
    """(line number, parsed JSON or None when damaged, raw text) for every non-empty line."""
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                out.append((number, json.loads(raw), raw))
            except json.JSONDecodeError:
                out.append((number, None, raw))
    return out


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
        self._lock_file = None
        if writable:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock()
            for name in (WORKLOADS, RECORDS):
                self._close_partial_line(self.folder / name)
        self._load()

    # -- loading -----------------------------------------------------------------------------
    def _load(self) -> None:
        workloads: list[Workload | None] = []
        for number, obj, _ in _read_lines(self.folder / WORKLOADS):
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
        for number, obj, _ in _read_lines(self.folder / RECORDS):
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

    # -- writing -----------------------------------------------------------------------------
    def _lock(self) -> None:
        self._lock_file = open(self.folder / ".lock", "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "another process"
            raise UserError(f"cache {self.folder} is being written by {holder}; wait for that job or use another --cache") from None
        self._lock_file.truncate(0)
        self._lock_file.write(f"pid {os.getpid()}\n")
        self._lock_file.flush()

    def close(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    @staticmethod
    def _close_partial_line(path: Path) -> None:
        """An interrupted append leaves a line without newline; end it so new lines stay whole."""
        if path.exists() and path.stat().st_size:
            with open(path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def _append(self, name: str, obj: object) -> None:
        if not self.writable:
            raise RuntimeError(f"cache {self.folder} was opened read-only")
        with open(self.folder / name, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # -- the MetaSchedule Database interface ---------------------------------------------------
    def has_workload(self, mod) -> bool:
        return self._mem.has_workload(mod)

    def commit_workload(self, mod) -> Workload:
        workload = self._mem.commit_workload(mod)
        key = str(workload.as_json()[0])
        if key not in self._index:
            self._append(WORKLOADS, workload.as_json())
            self._index[key] = self._workload_lines
            self._workload_lines += 1
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
