"""The XGBoost cost model that persists: one file per target folder of the cache, warm-started.

Stock MetaSchedule creates a fresh `XGBModel` per job, returns random scores until 100 samples
are measured, and never saves it. Here the model guides from the first trial
(`num_warmup_samples=0`), is loaded from `<cache>/<target folder>/cost_model.tar` when a job
starts (so what every earlier job of every task and workload measured on this target trains it),
and is saved there when the job ends: written to a temporary file in the same folder and renamed
over the old one, so a reader never sees a half-written file. The file is MetaSchedule's own
`XGBModel.save` tar: the booster plus every measured feature vector and cost, grouped by workload.

Its features are MetaSchedule's per-store features for a candidate of the generic space, the
rule's decisions for one of the rules' space (`features.py`). A saved model whose data has another
feature width (saved by a relaxtune before the decision features) is not loaded: the job starts a
fresh model, saved over it at the end.

A target folder without a model of its own starts from the prior (`cost_prior.npz`, written by
`benchmarks/cost_prior.py`): candidates of the rules' space measured on matmul shapes that no workload
uses, with the float32 SIMD lanes of the machine that measured them; it applies where the target's
lanes are the same (otherwise the model starts empty). A model trained on the prior ranks a job's first
batches from what the decisions did elsewhere rather than from the few batches the job has measured.
The model retrains after every batch (stock: only once the data grew by a fifth, which with the
prior's rows would have left a job's first batches out of it).

A damaged file is reported in one line and kept, renamed to `cost_model.tar.damaged`, before a
fresh model is saved in its place.

`RankedModel` wraps the model for a job: it times `predict` (the search scoring candidates:
feature extraction and inference) and `update` (feature extraction and training), and before each
update it scores the batch just measured, which the model has not seen yet: those held-out
(score, cost) pairs give the ranking quality (`ranking.py`).
"""

from __future__ import annotations

import logging
import os
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .features import EXTRA, PER_STORE, DecisionFeatures
from .ranking import FAILED_COST, pairwise_accuracy, summarize, top_k_recall  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

MODEL_FILE = "cost_model.tar"
PRIOR = Path(__file__).with_name("cost_prior.npz")  # benchmarks/cost_prior.py


WIDTH = PER_STORE + EXTRA  # MetaSchedule's per-store features, then a rule's decisions (features.py)
EARLY_STOPPING_ROUNDS = 10  # stock 50: training ran ~100 rounds of Python objective per batch
# XGBoost threads. Stock uses every physical core; its training is ~100 small rounds, each a
# barrier across the threads, so one busy core stalls every round. Measured on the 2-core box with
# another job running, retraining on 64 samples: 0.045-0.068 s with one thread, 0.41-1.16 s with
# two (whole jobs had seen 11 s and 70 s of updates for 40 trials). The data is small (a few
# thousand rows at most): one thread is also the faster choice on a quiet machine.
XGB_THREADS = 1


def new_model() -> "ms.cost_model.XGBModel":
    """An XGBoost model that ranks from the first measured batch (no random warm-up), and stops
    training after 10 rounds without gain (stock: 50, 4-5 s per batch on 2 cores, for a best
    round that came at 20-50), on one thread (`XGB_THREADS`), on per-store features plus each
    candidate's rule decisions (`features.py`)."""
    from tvm.s_tir.meta_schedule.cost_model.xgb_model import XGBConfig

    return ms.cost_model.XGBModel(
        extractor=DecisionFeatures(),
        num_warmup_samples=0,
        early_stopping_rounds=EARLY_STOPPING_ROUNDS,
        config=XGBConfig(nthread=XGB_THREADS),
        adaptive_training=False,
    )


def from_prior(target=None, path: Path = PRIOR) -> tuple["ms.cost_model.XGBModel", bool]:
    """(model, trained): a new model trained on the prior at `path` where it was measured with `target`'s float32
    SIMD lanes (module docstring); an untrained one otherwise (no target, no file, other lanes)."""
    from tvm.s_tir.meta_schedule.cost_model.xgb_model import FeatureGroup

    from .rules._utils import lanes

    model = new_model()
    if target is None or target.kind.name != "llvm" or not Path(path).exists():
        return model, False
    prior = np.load(path)
    if int(prior["lanes"]) != lanes(target, "float32"):
        logger.info("cost model prior measured with %d lanes, this target has others: not used", int(prior["lanes"]))
        return model, False
    rows, costs, groups = prior["rows"], prior["costs"], prior["group"]
    for number in np.unique(groups):
        pick = groups == number
        features = [np.concatenate([np.zeros(PER_STORE, "float32"), row])[None, :] for row in rows[pick]]
        model.data[f"prior-{number}"] = FeatureGroup(f"prior-{number}", features, costs[pick].astype("float32"))
    model.data_size = len(costs)
    model._train(  # pylint: disable=protected-access  # what XGBModel.update trains on
        xs=[f for g in model.data.values() for f in g.features],
        ys=np.concatenate([g.min_cost / g.costs for g in model.data.values()]),
    )
    logger.info(
        "cost model: a fresh model trained on the prior's %d candidates of %d kernels", len(costs), len(model.data)
    )
    return model, True


def feature_width(model) -> int | None:
    """The feature width of the model's training data (None when it holds none)."""
    for group in model.data.values():
        for features in group.features:
            return int(features.shape[1])
    return None


def load(folder: Path, target=None) -> tuple["ms.cost_model.XGBModel", bool]:
    """(model, warm): the folder's saved model, or a fresh one when there is none (trained on the prior for
    `target`, `from_prior`: warm then) or it is damaged."""
    model = new_model()
    path = Path(folder) / MODEL_FILE
    if not path.exists():
        return from_prior(target)
    try:
        with tarfile.open(path) as tar:
            names = set(tar.getnames())
        if "model.bin" not in names or "data.npy" not in names:
            raise ValueError(f"holds {sorted(names)}, not model.bin and data.npy")
        model.load(str(path))
        width = feature_width(model)
        if width is not None and width != WIDTH:
            logger.warning(
                "cost model %s was trained on %d features per store, not this relaxtune's %d: starting from a fresh "
                "model, saved over it when this job ends",
                path,
                width,
                WIDTH,
            )
            return new_model(), False
    except Exception as err:  # tarfile, numpy and xgboost raise several types on a damaged file
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        logger.warning(
            "cost model %s is damaged (%s): starting from a fresh model; the file is moved to %s.damaged, not "
            "overwritten, when this job saves",
            path,
            reason[:160],
            path.name,
        )
        return new_model(), False
    logger.info(
        "cost model %s: warm start from %d measured candidates of %d workloads", path, model.data_size, len(model.data)
    )
    return model, True


def save(model: "ms.cost_model.XGBModel", folder: Path) -> Path | None:
    """Write the model to the folder atomically; None when it has never been trained."""
    if model.booster is None:
        return None
    folder = Path(folder)
    path = folder / MODEL_FILE
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cost_model.", suffix=".tar")
    os.close(fd)
    try:
        model.save(tmp)
        if path.exists() and not _readable(path):
            os.replace(path, path.with_name(path.name + ".damaged"))
            logger.warning("damaged cost model moved to %s before saving the new one", path.name + ".damaged")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _readable(path: Path) -> bool:
    try:
        with tarfile.open(path) as tar:
            return {"model.bin", "data.npy"} <= set(tar.getnames())
    except (tarfile.TarError, OSError):
        return False


def _cost(result) -> float:
    if result.error_msg or not result.run_secs:
        return FAILED_COST
    return float(np.mean([float(s) for s in result.run_secs]))  # as the events file and the cache report it


@derived_object
class RankedModel(ms.cost_model.PyCostModel):
    """Delegates to an XGBModel; times it and scores each measured batch before training on it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seconds = {"predict": 0.0, "update": 0.0}
        self.held_out: list[dict] = []  # one per batch the model was trained before: scores, costs

    def load(self, path: str) -> None:
        self.inner.load(path)

    def save(self, path: str) -> None:
        self.inner.save(path)

    def update(self, context, candidates, results) -> None:
        start = time.perf_counter()
        if self.inner.booster is not None and len(candidates) > 1:
            scores = self.inner.predict(context, candidates)
            self.held_out.append({"scores": [float(s) for s in scores], "costs": [_cost(r) for r in results]})
        self.inner.update(context, candidates, results)
        self.seconds["update"] += time.perf_counter() - start

    def predict(self, context, candidates) -> np.ndarray:
        start = time.perf_counter()
        out = self.inner.predict(context, candidates)
        self.seconds["predict"] += time.perf_counter() - start
        return out
