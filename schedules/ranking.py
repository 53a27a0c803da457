"""Ranking quality of a cost model: pairwise accuracy and top-k recall of scores against costs.

Pure numpy (no TVM import), so `relaxtune report tuning` can compute it from the events files.
MetaSchedule's scores are normalised throughput (higher is faster); costs are seconds.

Two candidates whose measured times differ by a few percent are a tie as far as the measurement can tell (a
record must beat its rule by `NOISE_MARGIN` side by side to ship, `confirm.MARGIN`), so beside the accuracy over
every pair with different costs, `summarize` gives it over the pairs that differ by more than that margin, and
the top-k recall a random order would have (k / batch size, averaged over the batches).
"""

from __future__ import annotations

import numpy as np

FAILED_COST = 1e10  # MetaSchedule's cost of a candidate that did not build or run
NOISE_MARGIN = 0.03  # pairs closer than this (relative) are ties to the measurement (as confirm.MARGIN)


# -- ranking quality -----------------------------------------------------------------------------
def pairwise_accuracy(scores, costs, margin: float = 0.0) -> tuple[float, int]:
    """(correctly ordered pairs, pairs) over pairs with different costs (the slower more than `margin`
    slower, relative): a higher score must go with a lower cost. A tie in score counts half (a coin
    flip). Failed candidates count at their failure cost, so ranking them last is right."""
    scores, costs = np.asarray(scores, float), np.asarray(costs, float)
    i, j = np.triu_indices(len(costs), k=1)
    keep = np.maximum(costs[i], costs[j]) > np.minimum(costs[i], costs[j]) * (1 + margin)
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
    FAILED_COST for failures): pooled pairwise accuracy (over every pair with different costs, and over
    the pairs more than `NOISE_MARGIN` apart), mean top-k recall and its chance level."""
    right = pairs = right_far = far = 0
    recalls, chance = [], []
    for batch in batches:
        r, p = pairwise_accuracy(batch["scores"], batch["costs"])
        right, pairs = right + r, pairs + p
        r, p = pairwise_accuracy(batch["scores"], batch["costs"], NOISE_MARGIN)
        right_far, far = right_far + r, far + p
        if len(batch["costs"]) > k:
            recalls.append(top_k_recall(batch["scores"], batch["costs"], k))
            chance.append(k / len(batch["costs"]))
    return {
        "batches": len(batches),
        "pairs": pairs,
        "pairwise_accuracy": right / pairs if pairs else None,
        "pairs_beyond_noise": far,
        "pairwise_accuracy_beyond_noise": right_far / far if far else None,
        f"top{k}_recall": float(np.mean(recalls)) if recalls else None,
        f"top{k}_chance": float(np.mean(chance)) if chance else None,
    }
