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


# ------------------------------------------ issue 29: the accounted schedule is the one trained on
def test_claim_for_source_keeps_poisson_takes_a_schedule_and_refuses_the_rest():
    from hidden_state_accountants import LossGeometry
    from hidden_state_accountants.recording import Claim, claim_for_source

    fresh = Claim(default_relation="ADD_OR_REMOVE_ONE")  # an adapter's unconfigured claim: Poisson
    poisson = BatchSourceFacts(schedule=None, poisson=True, description="the Poisson loader")
    assert claim_for_source(fresh, poisson) is fresh
    shuffled = BatchSourceFacts(schedule=BatchSchedule.framework(1500, 100, secret=False), description="shuffled")
    taken = claim_for_source(fresh, shuffled)
    assert taken.schedule == shuffled.schedule and taken.relation()[0].name == "REPLACE_ONE"
    assert taken.relation()[1].startswith("reported under REPLACE_ONE, not the host's ADD_OR_REMOVE_ONE")
    # a geometry declared for Poisson steps is kept, on the schedule the batches follow
    geometry = LossGeometry(smoothness=1.0, strong_convexity=0.1)
    declared = Claim(geometry=geometry, assume_convex_model=True, dataset_size=1500)
    assert claim_for_source(declared, shuffled).geometry == geometry
    with pytest.raises(ParameterError, match="^dataset_size: 1400 is not the schedule's 1500"):
        claim_for_source(Claim(geometry=geometry, assume_convex_model=True, dataset_size=1400), shuffled)
    with pytest.raises(
        ParameterError,
        match="^data: the batches come from a sampler with replacement: neither the framework's Poisson "
        "sampling nor a schedule of this package",
    ):
        claim_for_source(fresh, BatchSourceFacts(schedule=None, description="a sampler with replacement"))
    with pytest.raises(ParameterError, match="^data: 3 steps were accounted as the framework's Poisson sampling"):
        claim_for_source(fresh, shuffled, steps=3)
    # a declared schedule must be the source's
    cyclic = Claim(schedule=BatchSchedule(1500, 100, CYCLIC))
    assert claim_for_source(cyclic, BatchSourceFacts(schedule=cyclic.schedule, description="d")) is cyclic
    with pytest.raises(ParameterError, match="^data: the batches do not come from a schedule of this package"):
        claim_for_source(cyclic, poisson)
    with pytest.raises(ParameterError, match="^data: the batches come from .*'reshuffle'.*but the accountant was told"):
        claim_for_source(cyclic, shuffled)


def test_weights_from_storage_need_the_ledger_or_a_public_declaration():
    from hidden_state_accountants.recording import check_initial_weights

    assert check_initial_weights(None, restored=False, public=False) is None
    assert check_initial_weights("load('w')", restored=True, public=False) is None
    with pytest.raises(ParameterError, match=r"^model: its weights were loaded by load\('w'\) without the run's"):
        check_initial_weights("load('w')", restored=False, public=False)
    note = check_initial_weights("load('w')", restored=False, public=True)
    assert note.startswith("the run starts from weights loaded by load('w'), declared public")
