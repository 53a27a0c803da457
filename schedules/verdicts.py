"""Per-bucket verdicts (`buckets.jsonl`): do a bucket's tuned records beat its rules in the block?

A record is applied where its static kernel measured faster than the rule-based schedule, but
that kernel-level win need not survive in the compiled block: the record is re-applied to the
symbolic kernel (padded, or with smaller row tiles), borrowed from a neighbouring bucket, and
measured at another time on a shared machine. Measured on llama-block (128 trials, 2 cores):
the n=65..128 bucket ran 3.8 ms with rules and 8.8 ms with its records. So after tuning,
`relaxtune.bucket_check` builds the block with and without records, times every bucket side by
side, and appends one line per bucket:

    {"signature": "...", "bucket": "main_n65_128_b1_4", "verdict": "rules",
     "records_ms": 8.75, "rules_ms": 3.80, "at": [{"b": 4, "n": 128}, {"b": 2, "n": 91}]}

`signature` digests the bucket's function and the records ApplyTunedSchedules applies in it
(kernel keys and the records' measured times), so a verdict holds for exactly that block and set: after more tuning
changes a
bucket's records, the bucket gets its records again until it is checked again. Append-only, a
later line for the same signature wins; a damaged line is reported and skipped.

The function enters by `function_digest`: its structure with every kernel it calls named by the
kernel's own structure, so a compiler change that only renumbers kernels (a new pass fusing one
group first turned gpt2's `fused_matmul2_add3_gelu_tanh` into `fused_matmul5_add5_gelu_tanh2`)
keeps the verdicts, while a changed kernel or graph does not. Lines written before (the hash of the
function with its kernels' names, `legacy_digest`) are still found when nothing was renamed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .database import append_lines, read_lines

logger = logging.getLogger(__name__)

FILE = "buckets.jsonl"
VERDICTS = ("records", "rules")


def signature(items: list[tuple[str, float]]) -> str:
    """Digest of (key, us) items: the bucket function's hash, and (kernel key, record time in us) per record."""
    text = "|".join(f"{key}:{us:.4f}" for key, us in sorted(items))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@mutator
class _NamedByContent(PyExprMutator):
    """Each GlobalVar a function refers to becomes one named by the structure of what it names."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod

    def visit_global_var_(self, gv):
        callee = self.mod[gv]
        if callee.attrs is not None and "global_symbol" in callee.attrs:
            callee = callee.without_attr("global_symbol")
        named = tvm.ir.GlobalVar(f"k{tvm_ffi.structural_hash(callee, map_free_vars=True)}")
        relax.expr._update_type(named, gv.ty)
        return named


def function_digest(mod: tvm.IRModule, func: relax.Function) -> str:
    """The bucket function's structure, its kernels named by their structure (not their names)."""
    return str(tvm_ffi.structural_hash(_NamedByContent(mod).visit_expr(func), map_free_vars=True))


def legacy_digest(func: relax.Function) -> str:
    """The digest verdict lines written before function_digest used: kernel names included."""
    return str(tvm_ffi.structural_hash(func, map_free_vars=True))


def load(folder: Path | None) -> dict[str, dict]:
    entries: dict[str, dict] = {}
    path = Path(folder) / FILE if folder is not None else None
    for number, entry, _ in read_lines(path) if path is not None else []:
        try:
            if entry["verdict"] not in VERDICTS:
                raise ValueError(entry["verdict"])
            entries[str(entry["signature"])] = entry
        except (KeyError, TypeError, ValueError):  # None (not JSON), not an entry, or an unknown verdict
            logger.warning(
                "%s:%d: damaged bucket-verdict line skipped (verdict must be one of %s)",
                path,
                number,
                ", ".join(VERDICTS),
            )
    return entries


def append(folder: Path, entries: list[dict]) -> None:
    append_lines(folder, FILE, entries)


@dataclass
class Verdicts:
    """What ApplyTunedSchedules consults per bucket; it records each bucket's signature in `seen`.

    `entries` empty (the default) applies every bucket's records; so does `apply_all`, whatever
    `entries` say: that is how the check builds its "records" variant (and learns which of the
    signatures it sees have a verdict)."""

    entries: dict[str, dict] = field(default_factory=dict)
    seen: dict[str, tuple[str, dict]] = field(default_factory=dict)  # bucket function -> (signature, bucket)
    apply_all: bool = False  # the check's "records" build: every bucket's records, checked or not

    @staticmethod
    def from_folder(folder: Path | None) -> "Verdicts":
        return Verdicts(load(folder))

    def rules_win(
        self,
        bucket_function: str,
        bucket: dict,
        items: list[tuple[str, float]],
        legacy: list[tuple[str, float]] | None = None,
    ) -> bool:
        """`items`: the signature items; `legacy`: the same under the old function digest, whose
        verdict counts where none was written for `items` (a check then writes one for `items`)."""
        sig = signature(items)
        self.seen[bucket_function] = (sig, bucket)
        if sig not in self.entries and legacy is not None and signature(legacy) in self.entries:
            self.entries[sig] = self.entries[signature(legacy)]
        return not self.apply_all and self.entries.get(sig, {}).get("verdict") == "rules"

    def records_checked(self, bucket_function: str) -> bool:
        """Did a bucket check on the device run this bucket's records (the set `rules_win` just saw)
        and keep them? What a target the host cannot check a schedule on (cuda) requires."""
        sig = self.seen[bucket_function][0]
        return self.apply_all or self.entries.get(sig, {}).get("verdict") == "records"
