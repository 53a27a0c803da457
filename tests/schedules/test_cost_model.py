"""The persistent XGBoost cost model: save/load/warm start, a damaged file, ranking metrics,
and per-task early stop in the measure callback."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from relaxtune.schedules import ranking


def _matmul(n: int):
    import tvm
    from tvm import te

    a = te.placeholder((n, 32), name="a")
    b = te.placeholder((32, 16), name="b")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((n, 16), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="matmul")
    func = te.create_prim_func([a, b, c]).with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


@pytest.fixture(scope="module")
def trained(target):
    """A model trained on 6 sampled schedules of a small matmul with made-up (but fixed) costs."""
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.schedules import cost_model

    mod = _matmul(16)
    args = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    candidates = []
    for seed in range(6):
        context = ms.TuneContext(
            mod=mod,
            target=target.target,
            space_generator="post-order-apply",
            search_strategy="evolutionary",
            task_name="mm",
            rand_state=seed + 1,
        )
        for sch in context.space_generator.generate_design_space(mod):
            candidates.append(ms.MeasureCandidate(sch, args))
    candidates = candidates[:6]
    results = [ms.runner.RunnerResult([1e-5 * (i + 1)], None) for i in range(len(candidates))]
    model = cost_model.new_model()
    model.update(context, candidates, results)
    return model, context, candidates


def test_ranking_metrics_on_known_orders():
    costs = [1.0, 2.0, 3.0, 4.0]
    assert ranking.pairwise_accuracy([4, 3, 2, 1], costs) == (6.0, 6)  # perfect order
    assert ranking.pairwise_accuracy([1, 2, 3, 4], costs) == (0.0, 6)  # reversed
    assert ranking.pairwise_accuracy([4, 3, 1, 2], costs) == (5.0, 6)  # one swapped pair
    assert ranking.pairwise_accuracy([1, 1], [1.0, 1.0]) == (0.0, 0)  # equal costs: no pair
    assert ranking.top_k_recall([4, 3, 2, 1], costs, 2) == 1.0
    assert ranking.top_k_recall([1, 2, 3, 4], costs, 2) == 0.0
    assert ranking.top_k_recall([4, 1, 3, 2], costs, 2) == 0.5
    summary = ranking.summarize(
        [{"scores": [4, 3, 2, 1], "costs": costs}, {"scores": [1, 2, 3], "costs": [1.0, 2.0, 3.0]}]
    )
    assert summary["pairs"] == 9 and summary["pairwise_accuracy"] == pytest.approx(6 / 9)
    assert summary["top2_recall"] == pytest.approx((1.0 + 0.5) / 2)
    assert summary["top2_chance"] == pytest.approx((2 / 4 + 2 / 3) / 2)
    # within the noise margin (3%) a pair is a tie to the measurement: the pair 1.0 / 1.02 is not counted
    assert ranking.pairwise_accuracy([3, 1, 2], [1.0, 1.02, 1.2]) == (2.0, 3)
    assert ranking.pairwise_accuracy([3, 1, 2], [1.0, 1.02, 1.2], ranking.NOISE_MARGIN) == (1.0, 2)
    near = ranking.summarize([{"scores": [1, 2, 3], "costs": [1.0, 1.01, 1.2]}])
    assert near["pairs"] == 3 and near["pairs_beyond_noise"] == 2 and near["pairwise_accuracy_beyond_noise"] == 0.0


def test_saved_model_warm_starts_with_the_same_predictions(tmp_path, trained):
    from relaxtune.schedules import cost_model

    model, context, candidates = trained
    assert cost_model.load(tmp_path)[1] is False  # nothing saved yet: a cold model
    path = cost_model.save(model, tmp_path)
    assert path == tmp_path / cost_model.MODEL_FILE and path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [cost_model.MODEL_FILE]  # no temp file left
    loaded, warm = cost_model.load(tmp_path)
    assert warm and loaded.data_size == model.data_size == len(candidates)
    np.testing.assert_allclose(loaded.predict(context, candidates), model.predict(context, candidates), rtol=1e-6)


def test_models_train_on_one_thread(tmp_path, trained):
    """Fresh and loaded models both train with XGB_THREADS (stock: every core, 10x slower per update
    when one is busy)."""
    from relaxtune.schedules import cost_model

    model, _, _ = trained
    assert model.config.nthread == cost_model.XGB_THREADS == 1
    cost_model.save(model, tmp_path)
    loaded, warm = cost_model.load(tmp_path)
    assert warm and loaded.config.nthread == 1


def test_untrained_model_is_not_saved(tmp_path):
    from relaxtune.schedules import cost_model

    assert cost_model.save(cost_model.new_model(), tmp_path) is None
    assert not (tmp_path / cost_model.MODEL_FILE).exists()


def test_damaged_model_is_one_line_and_kept(tmp_path, trained, caplog):
    from relaxtune.schedules import cost_model

    path = tmp_path / cost_model.MODEL_FILE
    path.write_bytes(b"not a tar file")
    with caplog.at_level(logging.WARNING, logger="relaxtune.schedules.cost_model"):
        model, warm = cost_model.load(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warm and model.booster is None
    assert len(lines) == 1 and str(path) in lines[0] and "\n" not in lines[0]
    cost_model.save(trained[0], tmp_path)
    assert (tmp_path / (cost_model.MODEL_FILE + ".damaged")).read_bytes() == b"not a tar file"
    assert cost_model.load(tmp_path)[1] is True


def test_ranked_model_scores_each_batch_before_training_on_it(trained):
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.schedules import cost_model

    model, context, candidates = trained
    wrapped = cost_model.RankedModel(cost_model.new_model())
    fast_first = [ms.runner.RunnerResult([1e-5 * (i + 1)], None) for i in range(len(candidates))]
    wrapped.update(context, candidates, fast_first)
    assert wrapped.held_out == []  # the first batch met an untrained model: nothing to score
    wrapped.update(context, candidates, fast_first)
    assert len(wrapped.held_out) == 1 and len(wrapped.held_out[0]["scores"]) == len(candidates)
    assert wrapped.seconds["update"] > 0


class _Scheduler:
    """MetaSchedule's TaskScheduler as the callback sees it: terminating an ended task is an error."""

    def __init__(self, tasks: int = 2):
        self.terminated = []
        self.tasks_ = [SimpleNamespace(is_terminated=False, runner_futures=None) for _ in range(tasks)]

    def terminate_task(self, task_id):
        if self.tasks_[task_id].is_terminated:
            raise RuntimeError("Check failed: (!task->is_terminated)")
        self.tasks_[task_id].is_terminated = True
        self.terminated.append(task_id)


def _batch(bar, scheduler, task_id, times_us):
    builds = [SimpleNamespace(error_msg=None) for _ in times_us]
    runs = [SimpleNamespace(error_msg=None, run_secs=[t * 1e-6]) for t in times_us]
    bar.record(scheduler, task_id, len(times_us), builds, runs)


def test_early_stop_after_batches_without_gain(tmp_path):
    from relaxtune.schedules.progress import EventLog, ProgressBar

    events = EventLog(tmp_path)
    bar = ProgressBar(64, ["a", "b"], [1e6, 1e6], disable=True, events=events, patience=2)
    scheduler = _Scheduler()
    _batch(bar, scheduler, 0, [100.0, 90.0])  # first times: a gain
    _batch(bar, scheduler, 1, [50.0])
    _batch(bar, scheduler, 0, [95.0])  # no gain 1
    _batch(bar, scheduler, 1, [40.0])  # b keeps gaining
    assert scheduler.terminated == []
    _batch(bar, scheduler, 0, [89.5])  # under 1%: still no gain (2)
    _batch(bar, scheduler, 1, [30.0])
    assert scheduler.terminated == [0] and bar.stopped == ["a"]
    assert bar.best_us == pytest.approx([89.5, 30.0]) and bar.trials == [4, 3]
    lines = events.path.read_text().splitlines()
    assert len(lines) == 7 and '"ev":"stop"' in lines[5]


def test_no_early_stop_when_patience_is_zero():
    from relaxtune.schedules.progress import ProgressBar

    bar = ProgressBar(64, ["a"], [1e6], disable=True, patience=0)
    scheduler = _Scheduler()
    for _ in range(5):
        _batch(bar, scheduler, 0, [100.0])
    assert scheduler.terminated == []


def test_no_early_stop_of_a_task_the_scheduler_already_ended():
    """At the end of the budget MetaSchedule ends every task before the last batch's callback."""
    from relaxtune.schedules.progress import ProgressBar

    bar = ProgressBar(64, ["a"], [1e6], disable=True, patience=1)
    scheduler = _Scheduler(tasks=1)
    _batch(bar, scheduler, 0, [100.0])
    scheduler.tasks_[0].is_terminated = True  # budget spent
    _batch(bar, scheduler, 0, [100.0])  # no gain: would stop, but the task has ended already
    assert scheduler.terminated == [] and bar.stopped == []


def test_no_early_stop_once_the_budget_is_measured_or_in_flight():
    """MetaSchedule's final drain joins a running task, runs the callbacks, then ends the task without
    checking whether a callback ended it: an early stop there crashed a job (TerminateTask check)."""
    from relaxtune.schedules.progress import ProgressBar

    bar = ProgressBar(3, ["a", "b"], [1e6, 1e6], disable=True, patience=1)
    scheduler = _Scheduler()
    _batch(bar, scheduler, 0, [100.0])
    scheduler.tasks_[1].runner_futures = [object()]  # b's last candidate is still running
    _batch(bar, scheduler, 0, [100.0])  # 2 measured + 1 in flight = the budget of 3: no stop, although stale
    assert scheduler.terminated == [] and bar.stopped == []
    scheduler.tasks_[1].runner_futures = None
    bar2 = ProgressBar(8, ["a", "b"], [1e6, 1e6], disable=True, patience=1)
    _batch(bar2, scheduler, 0, [100.0])
    _batch(bar2, scheduler, 0, [100.0])  # 2 of 8: trials left to give to b, so a stops
    assert scheduler.terminated == [0]


def test_features_carry_the_rule_decisions(trained, target):
    """A rules' candidate is one row of its rule, decisions, shape and what they make of it; a generic one keeps
    MetaSchedule's per-store rows, the rule's columns zero."""
    from relaxtune.schedules import cost_model, features, space

    model, context, candidates = trained
    mod = _matmul(512)
    values = {"rows": 8, "units": 1, "pack_b": 1, "k_unroll": 2}
    rule_point = space.from_decisions(mod, target.target, "Matmul", values, space.postprocs())
    rows = features.DecisionFeatures().extract_from(context, [rule_point, candidates[0]])
    ours, generic = (r.numpy() for r in rows)
    assert ours.shape == (1, cost_model.WIDTH) and generic.shape[1] == cost_model.WIDTH and len(generic) > 1
    lanes = features.decisions.read_all(rule_point.sch.trace)[2]["lanes"]
    column_tiles = 16 / lanes  # 16 columns in tiles of 1 vector
    threads = int(context.target.attrs.get("num-cores", 1))
    imbalance = -(-column_tiles // threads) * threads / column_tiles
    expected = [1 + features.RULES.index("Matmul"), 8, 1, 1, 2, 0, 0, 512, 16, 32]
    # 8 vectors per tile, 64 row tiles of 8, no padding; B packed: the column panels are the parallel tasks
    expected += [8, 64, 1.0, column_tiles, column_tiles, imbalance, (8 + 1) / 8, 1 / 512]
    np.testing.assert_allclose(ours[0, -features.EXTRA :], np.array(expected, dtype="float32"), rtol=1e-6)
    assert (ours[0, : features.PER_STORE] == 0).all() and (generic[:, -features.EXTRA :] == 0).all()
    assert cost_model.feature_width(model) == cost_model.WIDTH


def test_a_model_of_other_features_is_not_loaded(tmp_path, trained, caplog):
    """A model saved with MetaSchedule's stock features (an earlier relaxtune) starts fresh, with one warning."""
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.schedules import cost_model

    _, context, candidates = trained
    stock = ms.cost_model.XGBModel(num_warmup_samples=0)
    stock.update(context, candidates, [ms.runner.RunnerResult([1e-5 * (i + 1)], None) for i in range(len(candidates))])
    stock.save(str(tmp_path / cost_model.MODEL_FILE))
    with caplog.at_level(logging.WARNING):
        model, warm = cost_model.load(tmp_path)
    assert not warm and model.data_size == 0
    assert "features per store" in caplog.text


def test_a_fresh_folder_starts_from_the_prior_of_its_lanes(tmp_path, target):
    """A made-up prior where 6 rows per tile beat 3: a model trained on it ranks a 6-row candidate first; a prior of
    other lanes, or no target, leaves the model untrained."""
    from relaxtune.schedules import cost_model, features
    from relaxtune.schedules.rules._utils import lanes

    col = 1 + features.DECISIONS.index("rows")
    rows = np.zeros((8, features.EXTRA), "float32")
    rows[:, 0] = 1  # the Matmul rule
    rows[:, col] = [3, 6, 3, 6, 3, 6, 3, 6]
    costs = np.where(rows[:, col] == 6, 1e-4, 3e-4)
    mine = lanes(target.target, "float32")
    for path, lane in ((tmp_path / "same.npz", mine), (tmp_path / "other.npz", mine * 2)):
        np.savez(path, rows=rows, costs=costs, group=np.array([0, 0, 0, 0, 1, 1, 1, 1]), lanes=np.int32(lane))
    model, warm = cost_model.from_prior(target.target, tmp_path / "same.npz")
    assert warm and model.booster is not None and model.data_size == 8
    guess = model.booster.inplace_predict(np.concatenate([np.zeros((2, features.PER_STORE), "float32"), rows[:2]], 1))
    assert guess[1] > guess[0]  # the 6-row candidate scores higher (faster)
    other, warm_other = cost_model.from_prior(target.target, tmp_path / "other.npz")
    assert not warm_other and other.booster is None
    assert cost_model.from_prior(None)[1] is False and cost_model.load(tmp_path)[1] is False  # no target: no prior
