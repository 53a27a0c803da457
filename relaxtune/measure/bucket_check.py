"""After tuning: does each shape bucket run faster with its records than with its rules?

A record is applied where its static kernel measured faster than the rules, but the win need not
survive in the compiled block (schedules/verdicts.py says why, with the figure). This check
builds the workload twice — every bucket with its records, and rules only — and times each
bucket's call side by side, interleaved, at two points inside the bucket (its tuning point and
the geometric middle of its ranges), on the machine that measured the records: `ROUNDS` rounds of
back-to-back samples, the records' time taken as the rules' median times the median of the per-round
ratios (`timing.paired`: load that changes between rounds cancels). A bucket keeps its
records only where their outputs match the rules' (`TOLERANCE`; the only correctness check a cuda
schedule gets, since the host cannot run it) and they are faster by `MARGIN`; the verdicts go to the cache
(`<cache>/<target>/buckets.jsonl`) and `relaxtune compile` follows them.

Run by `api.tune` after the search (`TuneConfig.check_buckets`) on a local CPU target, or on a
CUDA target where a GPU is present; skipped with one line where the records were measured
elsewhere (RPC) or the device is missing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from ..compiler.build import build
from ..config import JobConfig
from ..targets import ResolvedTarget
from ..workloads import Workload
from .timing import paired
from .vm import VMRunner

logger = logging.getLogger(__name__)

MARGIN = 0.03  # records must be this much faster than the rules, over the bucket's two values
ROUNDS = 15  # interleaved samples per variant and value (5 gave verdicts at random at load 8 on 2 cores)
SAMPLE_S = 0.02  # seconds of calls per sample
TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 3e-2}  # max |records - rules| / max |rules|


def mismatch(got: list, want: list) -> float:
    """The largest error of `got` relative to each output's magnitude in `want`; inf where NaN/inf or shapes differ."""
    import numpy as np

    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape or not np.isfinite(a).all():
            return math.inf
        worst = max(worst, float(np.abs(a - b).max(initial=0.0)) / max(float(np.abs(b).max(initial=0.0)), 1e-30))
    return worst


def _device(target: ResolvedTarget):
    import tvm

    if not target.is_gpu:
        return tvm.cpu()
    device = tvm.cuda(0)
    return device if device.exist else None


def _points(bucket: dict[str, list[int]]) -> list[dict[str, int]]:
    """The bucket's tuning point, and the geometric middle of its ranges (one when they agree)."""
    tuned = {dim: at for dim, (_, _, at) in bucket.items()}
    middle = {dim: max(lo, min(hi, round(math.sqrt(lo * hi)))) for dim, (lo, hi, _) in bucket.items()}
    return [tuned] if middle == tuned else [tuned, middle]


def check_buckets(
    workload: Workload, target: ResolvedTarget, job: JobConfig, only_unchecked: bool = False
) -> list[dict]:
    """Time every bucket that has records, with and without them; append and return the verdicts.
    `only_unchecked`: nothing (one build) unless a bucket's record set has no verdict yet (a tuning
    job that ran no trial, over a cache whose verdicts predate the compiler that builds it now)."""
    from ..schedules import verdicts as store

    device = _device(target)
    if device is None:
        logger.info(
            "no %s device here: buckets not checked (their records are applied as tuned)", target.target.kind.name
        )
        return []
    from ..schedules.cache import folder_for

    every = store.Verdicts(store.load(folder_for(job.cache_dir, target)), apply_all=True)
    records, _, folder = build(
        workload, target, job, verdicts=every
    )  # every bucket's records; `seen`: their signatures
    if not every.seen or folder is None:
        return []
    if only_unchecked and all(sig in every.entries for sig, _ in every.seen.values()):
        logger.info("every bucket's records have a verdict: not checked again")
        return []
    rules, _, _ = build(workload, target, job.with_(compile=replace(job.compile, use_cache=False)))
    with_records, with_rules = (
        VMRunner.for_workload(records, device, workload),
        VMRunner.for_workload(rules, device, workload),
    )
    entries = []
    for name, (sig, bucket) in sorted(every.seen.items()):
        points = _points(bucket)
        records_ms = rules_ms = paired_ms = error = 0.0
        for point in points:
            inputs = workload.random_inputs(point)
            got, want = [with_records.outputs(inputs)], [with_rules.outputs(inputs)]
            allowed = max(TOLERANCE.get(str(w.dtype), TOLERANCE["float16"]) for w in want)
            error = max(error, mismatch(got, want) / allowed)  # in units of what the dtype allows
            ms, ratio = paired(
                {"rules": with_rules.caller(inputs), "records": with_records.caller(inputs)}, ROUNDS, SAMPLE_S
            )
            records_ms, rules_ms = records_ms + ms["records"], rules_ms + ms["rules"]
            paired_ms += ms["rules"] * ratio  # the records' time, from the rules' and the per-round ratios
        wrong = error > 1
        if wrong:
            logger.warning(
                "%s: its records' outputs differ from its rules' by %.3g x the allowed %s: rules",
                name,
                error,
                TOLERANCE,
            )
        verdict = "records" if paired_ms < (1 - MARGIN) * rules_ms and not wrong else "rules"
        entries.append(
            {
                "signature": sig,
                "bucket": name,
                "workload": workload.name,
                "verdict": verdict,
                "records_ms": round(records_ms, 4),
                "rules_ms": round(rules_ms, 4),
                "ratio": round(paired_ms / rules_ms, 4) if rules_ms else None,
                "at": points,
                "error": round(error, 4) if math.isfinite(error) else "inf",
            }
        )  # / TOLERANCE
        logger.info(
            "%s: records %.3f ms, rules %.3f ms (paired ratio %.3f) at %s: %s",
            name,
            records_ms,
            rules_ms,
            paired_ms / rules_ms if rules_ms else float("nan"),
            points,
            verdict,
        )
    store.append(folder, entries)
    return entries
