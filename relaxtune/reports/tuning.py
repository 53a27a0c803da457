"""relaxtune report tuning [--cache DIR] [--target T] --out DIR: where the tuning time went.

Reads the events files the tuning jobs append (`<cache>/<target folder>/events/*.jsonl`, one
line per measured batch: time, task, each candidate's time or error, the cost model's held-out
scores; see `schedules/progress.py`) and writes markdown plus two PNG plots to --out:

- `tuning-latency.png`: best latency versus wall time per task, and for the whole model (the sum
  over tuned tasks of expected calls x best time, a task without a measurement yet at its
  rule-based time);
- `tuning-throughput.png`: trials done versus wall time, and failed builds and runs by reason.

Per kernel searched in the rules' design space (`schedules/space.py`): the rule's time (its own
schedule, the task's first measured candidate), the tuned time (the best), their ratio, the
decisions the best changed from the rule's (`rule: tuned`), and the search cost: trials and wall
time (from its job's start) to reach the rule's time and the final best.

Jobs are laid end to end on the time axis in the order they ran. `--json PATH` holds
`{"tasks": [{"name", "trials", "best_us", "rules_us", "wall_s", "rule_us", "tuned_over_rule", "changed",
"best_decisions", "trials_to_rule", "trials_to_best", "s_to_rule", "s_to_best"}], "trials_per_s", "failed_builds",
"failed_runs", "failures", "ranking", "jobs", "model_us", "tuned_over_rule_geomean"}`; `rules_us` is the task's
rule-based time from its job's start event (what the bucket check and the model time weigh a record against),
`rule_us` the rule's own candidate as the search measured it. A task's `wall_s` is the
wall time from the job's previous measured batch to its own. That attribution is approximate: MetaSchedule
collects a batch's results when it next picks the task (or at the end), so a batch reported
late carries the search and builds of other tasks' batches done meanwhile. The rule's fields are null
for a kernel searched in the generic space.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path

from ..errors import UserError

logger = logging.getLogger(__name__)


def event_files(cache: Path, target: str | None) -> list[Path]:
    if not Path(cache).is_dir():
        raise UserError(f"cache directory {cache} does not exist: give --cache DIR of a tuning cache")
    if target is not None:
        from .. import targets
        from ..schedules.cache import folder_for

        folders = [folder_for(cache, targets.resolve(target))]
    else:
        folders = sorted(p for p in Path(cache).iterdir() if p.is_dir())
    files = sorted(f for folder in folders for f in (folder / "events").glob("*.jsonl"))
    if not files:
        raise UserError(
            f"no tuning events under {', '.join(str(f) for f in folders) or cache}: run `relaxtune tune ... --cache "
            f"{cache}` first"
        )
    return files


def read_job(path: Path) -> dict | None:
    """One job's events; None for a file without its start line. Damaged lines are skipped."""
    lines = []
    for number, raw in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            logger.warning("%s:%d: damaged events line skipped", path, number)
    start = next((e for e in lines if e.get("ev") == "start"), None)
    if start is None:
        return None
    end = next((e for e in lines if e.get("ev") == "end"), None)
    batches = [e for e in lines if e.get("ev") == "batch"]
    seeds = {t["name"]: t for e in lines if e.get("ev") == "seeds" for t in e.get("tasks", [])}
    last = end["t"] if end else max([e["t"] for e in batches], default=start["t"])
    return {
        "file": path.name,
        "start": start,
        "end": end,
        "batches": batches,
        "seeds": seeds,
        "wall_s": last - start["t"],
    }


class _Kernel:
    """One kernel's candidates in measured order: the rule's time and decisions, the best, the search cost."""

    def __init__(self):
        self.rule_decisions = None
        self.rule_us = None
        self.best = (float("inf"), None, 0, 0.0)  # us, decisions, trials to it, seconds to it
        self.trials = 0
        self.to_rule = None  # (trials, seconds) to reach the rule's time

    def add(self, us, chosen, seconds: float) -> None:
        self.trials += 1
        if us is None:
            return
        if self.rule_us is None and self.rule_decisions is not None and chosen == self.rule_decisions:
            self.rule_us = us
        if us < self.best[0]:
            self.best = (us, chosen, self.trials, seconds)
        if self.to_rule is None and self.rule_us is not None and us <= self.rule_us:
            self.to_rule = (self.trials, seconds)

    def row(self) -> dict:
        best_us, chosen, trials, seconds = self.best
        rule, found = self.rule_decisions, best_us < float("inf")
        changed = {k: f"{rule.get(k)}: {v}" for k, v in chosen.items() if rule.get(k) != v} if rule and chosen else {}
        return {
            "rule_us": self.rule_us,
            "tuned_over_rule": best_us / self.rule_us if self.rule_us and found else None,
            "best_decisions": chosen,
            "changed": changed if rule and chosen else None,
            "trials_to_rule": self.to_rule[0] if self.to_rule else None,
            "s_to_rule": round(self.to_rule[1], 2) if self.to_rule else None,
            "trials_to_best": trials if found else None,
            "s_to_best": round(seconds, 2) if found else None,
        }


def analyse(jobs: list[dict]) -> dict:
    from ..schedules.ranking import FAILED_COST, summarize

    tasks: dict[str, dict] = {}
    weights: dict[str, float] = {}
    rules: dict[str, float] = {}
    failures: Counter = Counter()
    held_out = []
    curve, model_curve, trials_curve = [], [], []  # (wall s, task, best us) / (wall s, model us) / (wall s, trials)
    offset = total = 0.0
    trials_done = 0
    kernels: dict[str, _Kernel] = {}
    for job in jobs:
        for t in job["start"].get("tasks", []):
            weights[t["name"]] = t.get("weight") or 0.0
            if t.get("rule_us"):
                rules[t["name"]] = t["rule_us"]
        for name, seeds in job["seeds"].items():
            if seeds.get("rule_decisions") is not None:
                kernels.setdefault(name, _Kernel()).rule_decisions = seeds["rule_decisions"]
        previous = job["start"]["t"]
        for batch in job["batches"]:
            name = batch["task"]
            entry = tasks.setdefault(name, {"name": name, "trials": 0, "best_us": float("inf"), "wall_s": 0.0})
            entry["trials"] += len(batch["us"])
            chosen = batch.get("decisions") or [None] * len(batch["us"])
            sent = batch.get("sent") or batch["t"]  # when the batch was sent: its results come in up to a round later
            for us, picked in zip(batch["us"], chosen):
                kernels.setdefault(name, _Kernel()).add(us, picked, offset + sent - job["start"]["t"])
            valid = [u for u in batch["us"] if u is not None]
            entry["best_us"] = min([entry["best_us"], *valid])
            entry["wall_s"] += batch["t"] - previous
            previous = batch["t"]
            for kind, reason in batch.get("errors", []):
                failures[(kind, reason)] += 1
            if batch.get("scores"):
                held_out.append(
                    {
                        "scores": batch["scores"],
                        "costs": [u * 1e-6 if u is not None else FAILED_COST for u in batch["us"]],
                    }
                )
            now = offset + batch["t"] - job["start"]["t"]
            trials_done += len(batch["us"])
            curve.append((now, name, entry["best_us"]))
            trials_curve.append((now, trials_done))
            model = _model_us(tasks, weights, rules)
            if model is not None:
                model_curve.append((now, model))
        offset += job["wall_s"]
        total += job["wall_s"]
    rows = sorted(tasks.values(), key=lambda t: t["name"])
    for row in rows:
        row["best_us"] = row["best_us"] if row["best_us"] < float("inf") else None
        row["wall_s"] = round(row["wall_s"], 2)
        row["rules_us"] = rules.get(row["name"])  # the kernel's rule-based schedule, which a record must beat
        row.update(kernels[row["name"]].row())
    ratios = [r["tuned_over_rule"] for r in rows if r["tuned_over_rule"]]
    return {
        "tuned_over_rule_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
        "tasks": rows,
        "trials_per_s": trials_done / total if total > 0 else 0.0,
        "trials": trials_done,
        "wall_s": round(total, 2),
        "failed_builds": sum(n for (kind, _), n in failures.items() if kind == "build"),
        "failed_runs": sum(n for (kind, _), n in failures.items() if kind == "run"),
        "failures": [{"kind": k, "reason": r, "count": n} for (k, r), n in failures.most_common()],
        "ranking": summarize(held_out),
        "model_us": model_curve[-1][1] if model_curve else None,
        "jobs": [
            {
                "file": j["file"],
                "workload": j["start"].get("workload"),
                "wall_s": round(j["wall_s"], 2),
                "warm_model": j["start"].get("warm_model"),
                "trials": sum(len(b["us"]) for b in j["batches"]),
                "profile": (j["end"] or {}).get("profile"),
                "stopped": (j["end"] or {}).get("stopped", []),
            }
            for j in jobs
        ],
        "curves": {"tasks": curve, "model": model_curve, "trials": trials_curve},
    }


def _model_us(tasks: dict, weights: dict, rules: dict) -> float | None:
    """Expected kernel time per model call over the tuned tasks: weight x (best, else rules)."""
    total = 0.0
    for name, weight in weights.items():
        best = tasks.get(name, {}).get("best_us", float("inf"))
        best = min(best, rules.get(name, float("inf")))
        if best == float("inf"):
            return None
        total += weight * best
    return total


def markdown(result: dict, sources: list[Path]) -> str:
    rank = result["ranking"]
    acc = (
        f"{rank['pairwise_accuracy']:.2f}"
        if rank["pairwise_accuracy"] is not None
        else "n/a (no batch scored by a trained model)"
    )
    recall = f"{rank['top2_recall']:.2f}" if rank.get("top2_recall") is not None else "n/a"
    if rank.get("top2_chance") is not None:
        recall += f" (chance {rank['top2_chance']:.2f})"
    if rank.get("pairwise_accuracy_beyond_noise") is not None:
        acc += (
            f" ({rank['pairwise_accuracy_beyond_noise']:.2f} over the {rank['pairs_beyond_noise']} more than 3% apart)"
        )
    lines = [
        "# Tuning report",
        "",
        f"{len(result['jobs'])} job(s) from {', '.join(sorted({str(p.parent.parent.name) for p in sources}))}: "
        f"{result['trials']} trials in {result['wall_s']:.0f} s = {result['trials_per_s']:.2f} trials/s; "
        f"failed builds {result['failed_builds']}, failed runs {result['failed_runs']}.",
        "",
        f"Cost model on held-out batches (scored before it trained on them): pairwise ranking accuracy {acc} "
        f"over {rank['pairs']} pairs in {rank['batches']} batches, top-2 recall {recall}.",
        "",
        f"Tuned / rule (the rules' design space; the rule is each kernel's first candidate): geometric mean "
        f"{_num(result['tuned_over_rule_geomean'], '.3f')} over {sum(1 for t in result['tasks'] if t['rule_us'])} "
        "kernels.",
        "",
        "| task | trials | best us | rules us | tuned / rules | rule us | tuned / rule "
        "| decisions changed (rule: tuned) | trials, s to the rule | trials, s to the best | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in result["tasks"]:
        best = f"{t['best_us']:.1f}" if t["best_us"] is not None else "failed"
        ratio = t["best_us"] / t["rules_us"] if t["best_us"] is not None and t.get("rules_us") else None
        changed = ", ".join(f"{k} {v}" for k, v in (t["changed"] or {}).items()) or ("none" if t["rule_us"] else "-")
        lines.append(
            f"| {t['name']} | {t['trials']} | {best} | {_num(t.get('rules_us'), '.1f')} | {_num(ratio, '.2f')} "
            f"| {_num(t['rule_us'], '.1f')} | {_num(t['tuned_over_rule'], '.3f')} | {changed} "
            f"| {_num(t['trials_to_rule'], 'd')}, {_num(t['s_to_rule'], '.1f')} "
            f"| {_num(t['trials_to_best'], 'd')}, {_num(t['s_to_best'], '.1f')} | {t['wall_s']:.1f} |"
        )
    lines += [
        "",
        "| job | workload | warm model | trials | wall s | where the time went (s) | stopped early |",
        "|---|---|---|---|---|---|---|",
    ]
    for j in result["jobs"]:
        profile = ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in (j["profile"] or {}).items() if k != "wall_s")
        lines.append(
            f"| {j['file']} | {j['workload']} | {j['warm_model']} | {j['trials']} | {j['wall_s']:.0f} | {profile} | "
            f"{', '.join(j['stopped']) or '-'} |"
        )
    if result["failures"]:
        lines += ["", "| failed | reason | count |", "|---|---|---|"]
        lines += [f"| {f['kind']} | {f['reason'].replace('|', '/')} | {f['count']} |" for f in result["failures"]]
    return "\n".join(lines) + "\n"


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["curves"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    end = max((t for t, _, _ in curves["tasks"]), default=0.0)
    for name in sorted({n for _, n, _ in curves["tasks"]}):
        points = [(t, b) for t, n, b in curves["tasks"] if n == name and b < float("inf")]
        if points:  # held flat to the end of the last job, a marker per measured batch
            line = ax.step(*zip(*points, (end, points[-1][1])), where="post", label=name[:40])
            ax.plot(*zip(*points), "o", ms=3, color=line[0].get_color())
    ax.set(xlabel="wall time (s)", ylabel="best latency (us)", yscale="log", title="best latency per task")
    ax.legend(fontsize=6)
    if curves["model"]:
        bx.step(*zip(*curves["model"]), where="post", color="black")
    bx.set(xlabel="wall time (s)", ylabel="expected kernel time per model call (us)", title="whole model")
    fig.tight_layout()
    latency = out / "tuning-latency.png"
    fig.savefig(latency, dpi=110)
    plt.close(fig)

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    if curves["trials"]:
        ax.plot(*zip(*curves["trials"]), marker=".")
    ax.set(xlabel="wall time (s)", ylabel="trials measured", title=f"{result['trials_per_s']:.2f} trials/s")
    reasons = result["failures"][:8]
    bx.barh([f"{f['kind']}: {f['reason'][:50]}" for f in reasons] or ["none"], [f["count"] for f in reasons] or [0])
    bx.set(xlabel="candidates", title=f"failed builds {result['failed_builds']}, failed runs {result['failed_runs']}")
    bx.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    throughput = out / "tuning-throughput.png"
    fig.savefig(throughput, dpi=110)
    plt.close(fig)
    return [latency, throughput]
