"""The cost model's features: MetaSchedule's per-store features plus the candidate's rule decisions.

MetaSchedule's XGBoost model sees each candidate as one row of features per buffer store (loop
extents, vectorisation, access patterns, arithmetic intensity, ...), a prediction per row, summed.
The rules' design space (`space.py`) is a handful of named decisions per kernel (rows and vectors
per register tile, packing, unrolling: `rules/decisions.py`), and how a decision value tends to
fare (a 6-row tile over a 3-row one, say) carries from one kernel to the next where the per-store
features differ in every loop extent. So every store row also gets the candidate's decisions
(`DECISIONS`, 0 where a decision is absent), its rule (`RULES`: 1 + its index; 0 for a candidate of
the generic space) and the tile's accumulator vectors (rows x units), so one model, trained across
both spaces and every kernel of the target, can rank a new kernel's candidates from its first batch.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .rules import decisions

RULES = ("Matmul", "Gemv", "NormGemv")
DECISIONS = ("rows", "units", "pack_b", "k_unroll", "k_lanes", "cols")
EXTRA = 2 + len(DECISIONS)  # rule, decisions, rows x units


def decision_row(trace) -> np.ndarray:
    """The extra features of a candidate (module docstring)."""
    found = decisions.read(trace)
    row = np.zeros(EXTRA, dtype="float32")
    if found is None:
        return row
    rule, values = found
    row[0] = 1 + RULES.index(rule) if rule in RULES else len(RULES) + 1
    for i, name in enumerate(DECISIONS):
        row[1 + i] = float(values.get(name, 0))
    row[-1] = float(values.get("rows", 0) * values.get("units", 0))
    return row


@derived_object
class DecisionFeatures(ms.feature_extractor.PyFeatureExtractor):
    """`PerStoreFeature` with the candidate's rule decisions appended to each store's row."""

    def __init__(self):
        super().__init__()
        self.inner = ms.feature_extractor.PerStoreFeature()

    def extract_from(self, context, candidates) -> list:
        out = []
        for candidate, stores in zip(candidates, self.inner.extract_from(context, candidates)):
            stores = stores.numpy()
            extra = np.broadcast_to(decision_row(candidate.sch.trace), (stores.shape[0], EXTRA))
            out.append(tvm.runtime.tensor(np.concatenate([stores, extra], axis=1).astype("float32")))
        return out
