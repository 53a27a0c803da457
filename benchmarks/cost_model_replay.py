"""A job's cost model ranking replayed, with and without the prior: what the prior would have done.

    python benchmarks/cost_model_replay.py C/llvm-.../cost_model.tar [more.tar ...] [--prior schedules/cost_prior.npz]
        [--depth 10] [--min-child-weight 0]

A saved model (`schedules/cost_model.py`) holds every candidate it was trained on, grouped by kernel in the
order the job measured them. Each batch (`--batch` candidates of a group, in order) is scored by a fresh model
trained on the batches before it, plus the prior's candidates where `--prior` is given, as the job's model
scored it before training on it; pairwise accuracy and top-2 recall over those held-out batches
(`schedules/ranking.py`, as `relaxtune report tuning` computes them) are printed per file. The job's own
batches are replayed kernel after kernel, which is the job's order where each kernel had one batch.
"""

from __future__ import annotations

import argparse
import tarfile
import tempfile
from pathlib import Path

import numpy as np


def job_batches(path: Path, batch: int) -> list[tuple[str, list, np.ndarray]]:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(path) as tar:
            tar.extract("data.npy", tmp)
        data = np.load(Path(tmp) / "data.npy", allow_pickle=True)
    out = []
    for key, features, costs in data:
        if str(key).startswith("prior-"):  # a job warm-started from the prior saves the prior's candidates too
            continue
        for start in range(0, len(costs), batch):
            out.append((str(key), list(features[start : start + batch]), np.asarray(costs[start : start + batch])))
    return out


def prior_batches(path: Path) -> list[tuple[str, list, np.ndarray]]:
    from relaxtune.schedules.features import PER_STORE

    prior = np.load(path)
    out = []
    for number in np.unique(prior["group"]):
        pick = prior["group"] == number
        rows = [np.concatenate([np.zeros(PER_STORE, "float32"), r])[None, :] for r in prior["rows"][pick]]
        out.append((f"prior-{number}", rows, prior["costs"][pick]))
    return out


def replay(batches: list, prior: list, depth: int, min_child_weight: float) -> dict:
    from tvm.s_tir.meta_schedule.cost_model.xgb_model import FeatureGroup, XGBConfig

    from relaxtune.schedules import cost_model
    from relaxtune.schedules.ranking import summarize

    held_out = []
    for i, (_, features, costs) in enumerate(batches):
        groups: dict[str, FeatureGroup] = {}
        for key, rows, seen in prior + batches[:i]:
            if key in groups:
                groups[key].append(rows, seen.astype("float32"))
            else:
                groups[key] = FeatureGroup(key, list(rows), seen.astype("float32"))
        if not groups:
            continue
        model = cost_model.new_model()
        model.config = XGBConfig(nthread=1, max_depth=depth, min_child_weight=min_child_weight)
        model._train(  # pylint: disable=protected-access  # as XGBModel.update trains
            xs=[f for g in groups.values() for f in g.features],
            ys=np.concatenate([g.min_cost / g.costs for g in groups.values()]),
        )
        scores = model._predict(xs=features)  # pylint: disable=protected-access
        held_out.append({"scores": [float(s) for s in scores], "costs": [float(c) for c in costs]})
    return summarize(held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--prior", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--min-child-weight", type=float, default=0.0)
    args = parser.parse_args()
    prior = prior_batches(args.prior) if args.prior else []
    for path in args.models:
        found = replay(job_batches(path, args.batch), prior, args.depth, args.min_child_weight)
        print(
            f"{path}: {'with' if prior else 'without'} the prior: pairwise accuracy {found['pairwise_accuracy']:.3f} "
            f"over {found['pairs']} pairs ({found['pairwise_accuracy_beyond_noise']:.3f} over the "
            f"{found['pairs_beyond_noise']} more than 3% apart), top-2 recall {found['top2_recall']:.3f} (chance "
            f"{found['top2_chance']:.3f}), {found['batches']} batches"
        )


if __name__ == "__main__":
    main()
