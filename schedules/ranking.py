"""Ranking quality of a cost model: pairwise accuracy and top-k recall of scores against costs.

Pure numpy (no TVM import), so `relaxtune report tuning` can compute it from the events files.
MetaSchedule's scores are normalised throughput (higher is faster); costs are seconds.
"""

from __future__ import annotations

import numpy as np

FAILED_COST = 1e10  # MetaSchedule's cost of a candidate that did not build or run


# -- ranking quality -----------------------------------------------------------------------------
def pairwise_accuracy(scores, costs) -> tuple[float, int]:
    """(correctly ordered pairs, pairs) over pairs with different costs: a higher score must go
    with a lower cost. A tie in score counts half (a coin flip). Failed candidates count at their
    failure cost, so ranking them last is right."""
    scores, costs = np.asarray(scores, float), np.asarray(costs, float)
    i, j = np.triu_indices(len(costs), k=1)
    keep = costs[i] != costs[j]
    i, j = i[keep], j[keep]
    agree = np.sign(scores[j] - scores[i]) * np.sign(costs[i] - costs[j])  # 1 right, -1 wrong, 0 tie
    return float(np.sum(agree > 0) + 0.5 * np.sum(agree == 0)), int(len(i))


def top_k_recall(scores, costs, k: int) -> float:
    """Of the k truly fastest candidates, the fraction among the k best scored."""
    scores, costs = np.asarray(scores, float), np.asarray(costs, float)
    k = min(k, len(costs))
    if k == 0:
        return float("nan")
    best = set(np.argsort(costs, kind="stable")[:k].tolist())
    chosen = set(np.argsort(-scores, kind="stable")[:k].tolist())
    return len(best & chosen) / k


def summarize(batches: list[dict], k: int = 2) -> dict:
    """Ranking quality over held-out batches `{"scores": [...], "costs": [...]}` (costs in seconds,
    FAILED_COST for failures): pooled pairwise accuracy and mean top-k recall."""
    right = pairs = 0
    recalls = []
    for batch in batches:
        r, p = pairwise_accuracy(batch["scores"], batch["costs"])
        right, pairs = right + r, pairs + p
        if len(batch["costs"]) > k:
            recalls.append(top_k_recall(batch["scores"], batch["costs"], k))
    return {
        "batches": len(batches),
        "pairs": pairs,
        "pairwise_accuracy": right / pairs if pairs else None,
        f"top{k}_recall": float(np.mean(recalls)) if recalls else None,
    }
