"""Where a tuning job's time went: seconds per part of the job (`TuneResult.profile`), which `relaxtune report
tuning` draws, and MetaSchedule's own timers of the evolutionary search and the wait for the runner.
"""

from __future__ import annotations


def phases(profiler) -> dict:
    """MetaSchedule's own timers, where this job opened the profiler: the evolutionary search
    (sampling, mutation, postprocessing and the cost model's scoring of the population, inside
    `search_and_measure_s` and `cost_model_predict_s`) and the wait for the runner."""
    if not hasattr(profiler, "get"):
        return {}
    timers = {str(k): float(v) for k, v in profiler.get().items()}
    search = sum(v for k, v in timers.items() if k.startswith("EvoSearch/") and k.count("/") == 1)
    return {
        "ms_evolutionary_search_s": round(search, 2),
        "ms_wait_for_runner_s": round(timers.get("JoinRunnerFutures", 0.0), 2),
    }


def profile(wall_s: float, setup_s: float, transfer_s: float, builder, model) -> dict:
    """Seconds per part of the job (they add up to `wall_s`). `transfer_s`: making the seeds (the rules'
    schedules, similar tasks' traces adapted; measured with the search's batches); `search_and_measure_s` is the
    rest: candidate generation (sampling,
    mutation, postprocessing) and waiting for the runner (which overlaps the search). Not a part:
    `worker_start_s`, the first build batch's excess over the median batch (workers start then)."""
    batches = builder.stats["batch_seconds"]
    median = sorted(batches[1:])[len(batches[1:]) // 2] if len(batches) > 1 else 0.0
    parts = {
        "setup_s": setup_s,
        "transfer_s": transfer_s,
        "build_s": builder.stats["seconds"],
        "cost_model_predict_s": model.seconds["predict"],
        "cost_model_update_s": model.seconds["update"],
    }
    rest = wall_s - sum(parts.values())
    out = {
        "wall_s": wall_s,
        **parts,
        "search_and_measure_s": max(0.0, rest),
        "worker_start_s": max(0.0, batches[0] - median) if batches else 0.0,
    }
    return {k: round(v, 2) for k, v in out.items()}
