"""The budget-share rule (`schedules/shares.py`): pure arithmetic, no tuning."""

from __future__ import annotations

import pytest

from relaxtune.schedules import shares


def test_split_gives_one_batch_each_then_by_value_and_adds_up():
    assert shares.split([4.2, 4.1, 4.1], 40, 8) == [16, 16, 8]  # 5 batches: 1 each, 2 more by value
    assert shares.split([3.0, 1.0], 40, 8) == [24, 16]  # 3 more batches: 2.25 and 0.75 of them
    assert shares.split([1.0, 1.0, 1.0, 1.0], 16, 8) == [8, 8, 0, 0]  # only as many as get a batch
    assert shares.split([1.0, 2.0], 20, 8) == [12, 8]  # 4 trials beyond whole batches: to the first
    assert shares.split([1.0, 1.0], 5, 8) == [5, 0]  # under one batch
    assert shares.split([], 40, 8) == [] and shares.split([1.0], 0, 8) == [0]
    for values, total in [([5.0, 3.0, 1.0, 0.5], 72), ([0.0, 0.0], 24), ([1.0] * 7, 50)]:
        assert sum(shares.split(values, total, 8)) == total


def test_split_rejects_a_bad_batch_size():
    with pytest.raises(ValueError, match="per_batch 0"):
        shares.split([1.0], 8, 0)


def test_fresh_job_measures_its_whole_budget():
    job = shares.plan([4.2, 4.1, 4.1], [0, 0, 0], 40, 8, cached_total=0)
    assert job.needs == [16, 16, 8] and job.budget == 40 and job.short == [0, 1, 2]


def test_same_job_again_measures_nothing():
    job = shares.plan([4.2, 4.1, 4.1], [16, 16, 8], 40, 8, cached_total=40)
    assert job.budget == 0 and job.short == []


def test_interrupted_job_measures_exactly_the_rest():
    job = shares.plan([4.2, 4.1, 4.1], [16, 5, 0], 40, 8, cached_total=21)
    assert job.needs == [0, 11, 8] and job.budget == 40 - 21


def test_larger_budget_later_measures_more_for_the_kernels_whose_share_grew():
    job = shares.plan([4.2, 4.1, 4.1], [16, 16, 8], 64, 8, cached_total=40)
    assert job.shares == [24, 24, 16] and job.needs == [8, 8, 8] and job.budget == 24


def test_kernels_tuned_by_another_workload_to_their_share_are_owed_nothing():
    # mlp after llama-block: two kernels hold 16 each from the first job, one is new
    job = shares.plan([4.2, 4.1, 4.1], [16, 16, 0], 40, 8, cached_total=32)
    assert job.needs == [0, 0, 8] and job.short == [2] and job.budget == 8
    # the first job gave them less than this job's shares: they are topped up to them, no more
    job = shares.plan([4.2, 4.1, 4.1], [8, 8, 0], 40, 8, cached_total=16)
    assert job.needs == [8, 8, 8] and job.budget == 24
    # every kernel holds its share: nothing, even with budget left over (another job's surplus)
    job = shares.plan([4.2, 4.1], [30, 30], 40, 8, cached_total=60)
    assert job.budget == 0


def test_retired_kernels_count_in_the_budget_but_get_no_share():
    # a third kernel, stopped early at 24 trials, is left out of `values` by `job_tasks.select`
    job = shares.plan([4.2, 4.1], [8, 0], 40, 8, cached_total=8 + 24)
    assert job.shares == [24, 16] and job.budget == 8


def test_give_back_spreads_freed_trials_by_batches():
    assert shares.give_back(16, [2.0, 1.0], 8) == [8, 8]
    assert shares.give_back(8, [2.0, 1.0], 8) == [8, 0]
    assert shares.give_back(8, [], 8) == []


def test_trials_of_the_same_main_computation_count_toward_the_share():
    # mlp after llama-block at 40 trials: the SwiGLU kernel holds 16 of its 24; the down projection
    # (share 16) has no record, and llama-block measured 8 on its twin with the residual add fused
    job = shares.plan([8.4, 4.2], [16, 0], 40, 8, cached_total=16, borrowed=[0, 8])
    assert job.shares == [24, 16] and job.credit == [0, 8]
    assert job.needs == [8, 8] and job.budget == 16
    without = shares.plan([8.4, 4.2], [16, 0], 40, 8, cached_total=16)
    assert without.needs == [8, 16] and without.budget == 24  # the rule before: its whole share
    # run again after that job: the down projection holds 8 of its own and 8 credited
    again = shares.plan([8.4, 4.2], [24, 8], 40, 8, cached_total=32, borrowed=[0, 8])
    assert again.needs == [0, 0] and again.budget == 0


def test_a_kernel_without_records_owes_its_carried_batch_whatever_it_borrows():
    job = shares.plan([8.4, 4.2], [24, 0], 40, 8, cached_total=24, borrowed=[0, 64])
    assert job.credit == [0, 8] and job.needs == [0, 8] and job.budget == 8
    small = shares.plan([1.0], [0], 5, 8, cached_total=0, borrowed=[40])  # a share under one batch: all of it
    assert small.needs == [5] and small.credit == [0]
    assert shares.plan([1.0], [0], 16, 8, cached_total=0, borrowed=[8], retired=[True]).needs == [0]
