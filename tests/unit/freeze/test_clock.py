"""The freeze-point clock, handed numbers (no Trainer): when points fall, the warning when none fits, resume.

Every expected step below is worked out by hand in the comment beside it.
"""

from __future__ import annotations

import pytest

from lightning_pipetransformer.freeze.clock import FreezeClock, steps_per_epoch


def started(interval: int | float | None, batches: float = 12, accumulate: int = 1, step: int = 0, **kwargs) -> FreezeClock:
    clock = FreezeClock(interval, **kwargs)
    clock.start(step, batches, accumulate)
    return clock


def test_steps_per_epoch_count_optimizer_steps_and_need_a_length():
    assert steps_per_epoch(12, 1) == 12
    assert steps_per_epoch(10, 4) == 3  # windows of 4, 4 and 2 batches: the short last window steps too
    assert steps_per_epoch(8, 4) == 2
    assert steps_per_epoch(0, 1) == 1  # never 0: a fraction of it is at least one step
    for unknown in (float("inf"), None):
        with pytest.raises(ValueError, match="needs a training loader with a length"):
            steps_per_epoch(unknown, 1)


def test_points_at_a_quarter_epoch_fall_every_three_of_twelve_steps_and_count_across_epochs():
    clock = started(0.25)  # 12 optimizer steps per epoch: a point every 3
    assert (clock.interval_steps, clock.next_point) == (3, 3)
    assert [clock.step_point(s) for s in range(7)] == [None, None, None, 1, None, None, 2]
    assert clock.next_point == 9
    # Points passed without being asked (AutoDP applies them at the next epoch start) all count:
    # steps 9 and 12 are points 3 and 4.
    assert clock.step_point(12) == 4 and clock.next_point == 15
    assert clock.step_point(12) is None  # asked twice at one step: one point


def test_an_int_interval_is_optimizer_steps_whatever_the_epoch_length():
    clock = started(5, batches=100)
    assert (clock.interval_steps, clock.next_point) == (5, 5)
    assert clock.step_point(4) is None and clock.step_point(5) == 1 and clock.next_point == 10


def test_an_int_interval_needs_no_epoch_length():
    # An IterableDataset's loader has no length: an int interval (optimizer steps) still works;
    # only a fraction of an epoch is refused, naming the fix.
    for unknown in (float("inf"), None):
        clock = started(5, batches=unknown)
        assert (clock.interval_steps, clock.next_point) == (5, 5) and clock.step_point(5) == 1
        with pytest.raises(ValueError, match="pass an int number of optimizer steps"):
            started(0.25, batches=unknown)
    # Lightning's estimated_stepping_batches is -1 for a stream without max_steps: an unknown length, no warning.
    assert started(5, batches=float("inf")).too_few_points(1, "rule='schedule'", -1, None) is None


def test_with_accumulation_a_fraction_counts_optimizer_steps_and_points_open_a_window():
    clock = started(0.5, batches=10, accumulate=4)  # 3 optimizer steps per epoch; half of it rounds to 2
    assert (clock.interval_steps, clock.next_point) == (2, 2)
    assert [b for b in range(10) if clock.opens_window(b, 4)] == [0, 4, 8]
    assert all(clock.opens_window(b, 1) for b in range(3)) and clock.opens_window(0, 0)


def test_epoch_start_points_come_every_n_epochs_from_epoch_n_and_once_each():
    clock = FreezeClock(None, every_n_epochs=2)
    assert [clock.epoch_point(e) for e in range(6)] == [None, None, 1, None, 2, None]
    assert clock.epoch_point(4) is None  # a resumed epoch start does not decide twice
    per_epoch = FreezeClock(None, per_epoch=True)  # a plan per epoch is asked at every epoch start, epoch 0 too
    assert [per_epoch.epoch_point(e) for e in range(3)] == [0, 1, 2]


def test_a_resumed_clock_keeps_its_next_point_and_decided_epoch():
    clock = started(0.25)
    assert clock.step_point(4) == 1  # the point of step 3, asked at 4; the next is at 6
    state = clock.state_dict()
    assert state == {"decided_epoch": 0, "next_point": 6, "points": 1}
    resumed = FreezeClock(0.25)
    resumed.load_state_dict(state)
    resumed.start(5, 12, 1)  # a fresh start at step 5 would put the next point at 8
    assert resumed.next_point == 6 and resumed.step_point(6) == 2
    epochs = FreezeClock(None, every_n_epochs=2)
    assert epochs.epoch_point(2) == 1
    again = FreezeClock(None, every_n_epochs=2)
    again.load_state_dict(epochs.state_dict())
    assert again.epoch_point(2) is None and again.epoch_point(4) == 2
    old = FreezeClock(None)
    old.load_state_dict({})  # a checkpoint without the clock's keys: a fresh clock
    assert (old.decided_epoch, old.next_point, old.points) == (0, None, 0)


def test_the_warning_when_no_point_fits_the_run():
    rule = "rule='paper'"
    short = started(20, batches=9)  # the first point at step 20, the run has 9 steps
    assert short.too_few_points(1, rule, 9, None) == (
        "AutoFreeze: with freeze_interval=20 (20 optimizer steps) and a run of 9 optimizer steps, no freeze point "
        "falls inside it: nothing will be frozen. Use a shorter freeze_interval (a float is a fraction of an epoch)."
    )
    one = started(5, batches=9)  # points at steps 5 only (10 > 8, the last step)
    assert "only one freeze point fits, and rule='autofreeze' needs two" in one.too_few_points(2, "rule='autofreeze'", 9, None)
    assert one.too_few_points(1, rule, 9, None) is None
    assert started(5).too_few_points(3, rule, 15, None) is not None  # points 5 and 10 (15 > 14): two of three
    assert started(5).too_few_points(3, rule, 16, None) is None  # 5, 10, 15
    assert started(5).too_few_points(1, rule, float("inf"), None) is None  # unknown length: nothing said
    epochs = FreezeClock(None)
    assert "max_epochs=1, no freeze point falls inside it" in epochs.too_few_points(1, rule, None, 1)
    assert epochs.too_few_points(1, rule, None, 2) is None  # the start of epoch 1
    assert epochs.too_few_points(1, rule, None, -1) is None  # unbounded
    resumed = FreezeClock(None, every_n_epochs=2)
    resumed.decided_epoch = 2  # epoch 2 decided before the checkpoint: only epoch 4 is left, and the run ends there
    assert "freeze_every_n_epochs=2 and a run of max_epochs=4, no freeze point" in resumed.too_few_points(1, rule, None, 4)


def test_the_point_after_this_one_for_smooth_freezing():
    assert FreezeClock(None, per_epoch=True).following(2, 2, max_epochs=4) == (3, 3)
    assert FreezeClock(None, per_epoch=True).following(3, 3, max_epochs=4) is None  # no point after the last epoch
    assert FreezeClock(None, every_n_epochs=2).following(2, 2, max_epochs=None) == (2, 4)
    inside = started(0.25)
    inside.step_point(6)
    assert inside.following(None, 1, max_epochs=3) == (3, 1)
    # The step of that point: two epochs of 10 steps after epoch 2's start at step 20.
    assert FreezeClock(None, every_n_epochs=2).following_step(20, 2, 10, 1) == 40
    assert FreezeClock(None, per_epoch=True).following_step(20, 2, 10, 1) == 30
    assert inside.following_step(6, None, 12, 1) == 9
    assert FreezeClock(None).following_step(20, None, 10, 1) is None
    with pytest.raises(ValueError, match="with a length"):
        FreezeClock(None).following_step(20, 2, float("inf"), 1)


def test_the_clock_in_words():
    assert FreezeClock(3).describe() == "every 3 optimizer step(s)"
    assert FreezeClock(0.25).describe() == "every 0.25 of an epoch"
    assert FreezeClock(None, every_n_epochs=2).describe() == "every 2 epoch(s)"
    assert FreezeClock(3).where(1, 7) == "epoch 1, step 7" and FreezeClock(None).where(1, 7) == "epoch 1"
