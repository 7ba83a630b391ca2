"""check_batch_source: where the data will resume must be where the run is (core, no framework)."""

import pytest

from hidden_state_accountants import ParameterError
from hidden_state_accountants.recording import BatchSourceFacts, check_batch_source
from hidden_state_accountants.schedules import CYCLIC, FULL, SHUFFLE_PARTITION, WITHOUT_REPLACEMENT, BatchSchedule


@pytest.mark.parametrize("sampling", [CYCLIC, SHUFFLE_PARTITION])
def test_a_fixed_partition_must_resume_at_the_runs_batch_of_the_epoch(sampling):
    schedule = BatchSchedule(60, 10, sampling, 3 if sampling == SHUFFLE_PARTITION else None)
    restarts = BatchSourceFacts(schedule=schedule, description="the dataset", next_step=0)
    for steps in (0, 6, 12):  # whole epochs: batch 0 is the run's next batch
        check_batch_source(schedule, restarts, steps)
    with pytest.raises(
        ParameterError,
        match="^data: the run is at batch 2 of its 6-batch epoch but the dataset starts at batch 0 .*stopped mid-epoch",
    ):
        check_batch_source(schedule, restarts, 8)
    check_batch_source(schedule, BatchSourceFacts(schedule=schedule, description="d", next_step=2), 8)
    check_batch_source(schedule, BatchSourceFacts(schedule=schedule, description="d"), 8)  # unknown: not checked


def test_fresh_draws_may_skip_ahead_but_never_replay():
    schedule = BatchSchedule(60, 10, WITHOUT_REPLACEMENT, 3)
    check_batch_source(schedule, BatchSourceFacts(schedule=schedule, description="d", next_step=18), 12)
    with pytest.raises(ParameterError, match="d has handed out 6 batches for 12 steps"):
        check_batch_source(schedule, BatchSourceFacts(schedule=schedule, description="d", next_step=6), 12)


def test_full_batches_are_the_same_at_every_step():
    schedule = BatchSchedule(60, 60, FULL)
    check_batch_source(schedule, BatchSourceFacts(schedule=schedule, description="d", next_step=0), 7)
