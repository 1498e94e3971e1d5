"""Schedules as data: presets, validation with precise errors, pictures. One process, no ranks."""
import itertools

import pytest

from piper_fx import schedules
from piper_fx.schedules import Action, Schedule, ScheduleError


@pytest.mark.parametrize("pp", range(2, 9))
def test_every_preset_validates_for_its_whole_range(pp):
    for microbatches in range(pp, 4 * pp + 1):
        schedules.build("gpipe", pp, microbatches)
        schedules.build("1f1b", pp, microbatches)
        schedules.build("zb1p", pp, microbatches)
        assert schedules.build("zbv", pp, microbatches, 2).stage_to_rank == schedules.v_placement(pp)
        if microbatches >= 2 * pp:
            assert schedules.build("dualpipev", pp, microbatches, 2).stage_to_rank == schedules.v_placement(pp)
            if pp % 2 == 0 and microbatches % 2 == 0:
                assert schedules.build("dualpipe", pp, microbatches).copies == 2
        for stages_per_rank in (2, 3):
            if microbatches % pp == 0:
                s = schedules.build("interleaved_1f1b", pp, microbatches, stages_per_rank)
                assert s.num_stages == pp * stages_per_rank


def _live_after_each_action(schedule: Schedule, rank: int) -> int:
    live = peak = 0
    for action in schedule.actions[rank]:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_1f1b_bounds_in_flight_microbatches_by_pipeline_depth():
    pp, m = 4, 12
    one_f_one_b, gpipe = schedules.build("1f1b", pp, m), schedules.build("gpipe", pp, m)
    for rank in range(pp):
        assert _live_after_each_action(one_f_one_b, rank) == pp - rank
        assert _live_after_each_action(gpipe, rank) == m


def _two_rank(actions):
    return Schedule("custom", 2, 2, (0, 1), actions)


F, B = "F", "B"


def test_missing_microbatch_is_named():
    bad = _two_rank([[Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)],
                     [Action(1, F, 0), Action(1, B, 0), Action(1, F, 1)]])
    with pytest.raises(ScheduleError, match=r"B1\.1 \(stage 1, microbatch 1\) is missing"):
        schedules.validate(bad)


def test_backward_before_its_forward_on_the_same_rank_deadlocks_with_the_action_named():
    bad = _two_rank([[Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)],
                     [Action(1, B, 0), Action(1, F, 0), Action(1, F, 1), Action(1, B, 1)]])
    with pytest.raises(ScheduleError, match=r"deadlocks: .*rank 1 action 0 B1\.0 waits for F1\.0"):
        schedules.validate(bad)


def test_cross_rank_cycle_is_a_deadlock():
    # Rank 0 waits for the backward of microbatch 0 before it sends microbatch 1's forward,
    # while rank 1 wants microbatch 1's forward before it runs microbatch 0's backward.
    bad = _two_rank([[Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
                     [Action(1, F, 0), Action(1, F, 1), Action(1, B, 0), Action(1, B, 1)]])
    with pytest.raises(ScheduleError, match=r"rank 0 action 1 B0\.0 waits for B/I1\.0.*rank 1 action 1 F1\.1 waits for F0\.1"):
        schedules.validate(bad)


def test_action_on_the_wrong_rank_and_duplicates_are_named():
    wrong_rank = _two_rank([[Action(1, F, 0)], []])
    with pytest.raises(ScheduleError, match=r"rank 0 action 0 F1\.0: stage 1 is placed on rank 1"):
        schedules.validate(wrong_rank)
    twice = _two_rank([[Action(0, F, 0), Action(0, F, 0)], []])
    with pytest.raises(ScheduleError, match=r"rank 0 action 1 F0\.0: F0\.0 already runs as rank 0 action 0"):
        schedules.validate(twice)


def test_text_grid_and_svg_come_from_the_simulation():
    s = schedules.build("1f1b", 2, 4)
    grid = schedules.text_grid(s)
    assert grid.splitlines()[1].startswith("rank 0: F0.0 F0.1 .    B0.0")
    picture = schedules.svg(s)
    assert picture.startswith("<svg") and picture.count("<rect") == 16


def test_w_before_its_i_is_rejected_with_the_action_named():
    bad = Schedule("custom", 1, 1, (0,), [[Action(0, F, 0), Action(0, "W", 0), Action(0, "I", 0)]])
    with pytest.raises(ScheduleError, match=r"rank 0 action 1 W0\.0 waits for I0\.0"):
        schedules.validate(bad)


def test_b_and_a_split_backward_of_the_same_microbatch_is_rejected():
    bad = Schedule("custom", 1, 1, (0,), [[Action(0, F, 0), Action(0, "I", 0), Action(0, "W", 0),
                                           Action(0, B, 0)]])
    with pytest.raises(ScheduleError, match=r"B0\.0 and a split backward"):
        schedules.validate(bad)


def _random_costs(seed, count=300):
    import random
    rng = random.Random(seed)
    for _ in range(count):
        pp = rng.randint(2, 8)
        yield pp, rng.randint(pp, 3 * pp), rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(0.05, 3)


def test_1f1b_bubble_is_p_minus_1_times_f_plus_b_for_any_costs():
    for pp, m, f, i, w in _random_costs(0):
        sim = schedules.simulate(schedules.build("1f1b", pp, m), schedules.Costs(F=f, B=i + w))
        assert max(sim.bubbles) == pytest.approx((pp - 1) * (f + i + w))


def test_zb1p_bubble_is_p_minus_1_times_f_plus_b_minus_2w():
    # The closed form holds when W is no longer than F or I: with W > F + I it
    # would be negative, so "W <= B" alone cannot be its condition.
    checked = 0
    for pp, m, f, i, w in _random_costs(1, 1000):
        if w > min(f, i):
            continue
        costs = schedules.Costs(F=f, B=i + w, I=i, W=w)
        sim = schedules.simulate(schedules.build("zb1p", pp, m), costs)
        assert max(sim.bubbles) == pytest.approx((pp - 1) * (f + i + w - 2 * w))
        # Deferred W's hold activations longer on later ranks, but no rank above 1F1B's peak (pp).
        assert max(sim.peak_activations) == pp
        checked += 1
    assert checked > 100


def test_zbv_simulated_bubble_beats_1f1b_on_the_same_layers():
    # A V stage holds half a rank's layers: half the per-stage cost of a 1F1B stage.
    for pp in (2, 4, 8):
        m = 2 * pp
        flat = schedules.simulate(schedules.build("1f1b", pp, m), schedules.Costs(F=2, B=4))
        v = schedules.simulate(schedules.build("zbv", pp, m, 2), schedules.Costs(F=1, B=2, I=1, W=1))
        assert v.makespan < flat.makespan and max(v.bubbles) < max(flat.bubbles), (pp, v.bubbles, flat.bubbles)


def test_dualpipe_bubbles_meet_deepseeks_bound():
    """DeepSeek's table: DualPipe's bubble is (PP/2-1)(F&B+B-3W) for PP stages in each direction;
    DualPipeV on P ranks is DualPipe folded onto half the ranks, so PP = 2P there. It holds for
    any gain from overlapping whenever neither F nor W costs more than I (which includes the
    transformer regime W <= F <= I the table assumes); without that gain the exact condition is
    in test_dualpipev_meets_deepseeks_table_exactly_under_its_cost_condition. With F > I the
    fill's forwards, and with W > I the drain's weight gradients, take longer than it counts."""
    import random
    rng = random.Random(2)
    checked = 0
    while checked < 300:
        f, i, w = rng.uniform(0.2, 3), rng.uniform(0.2, 3), rng.uniform(0.1, 3)
        if not max(f, w) <= i:
            continue
        b = i + w
        fb = rng.uniform(max(f, b), f + b)  # overlapping F with B saves at most the shorter one
        costs = schedules.Costs(F=f, B=b, I=i, W=w, FB=fb)
        ranks = rng.choice([2, 4, 6, 8])
        microbatches = rng.randint(2 * ranks, 4 * ranks)
        for name, stages in (("dualpipe", ranks), ("dualpipev", 2 * ranks)):
            m = microbatches + microbatches % 2 if name == "dualpipe" else microbatches
            sim = schedules.simulate(schedules.build(name, ranks, m), costs)
            bound = (stages / 2 - 1) * (fb + b - 3 * w)
            assert max(sim.bubbles) <= bound + 1e-9, (name, ranks, m, costs, sim.bubbles, bound)
        checked += 1
    # Tight: with equal F, I and W and no gain from overlapping, every rank idles exactly that long.
    for ranks in (2, 4, 6, 8):
        costs = schedules.Costs(F=1, B=2, I=1, W=1, FB=3)
        for name, stages in (("dualpipe", ranks), ("dualpipev", 2 * ranks)):
            sim = schedules.simulate(schedules.build(name, ranks, 2 * ranks), costs)
            assert sim.bubbles == pytest.approx([(stages / 2 - 1) * 2] * ranks), (name, ranks)


def _costs(f, i, w, fb=None):
    """Split-backward costs; F&B defaults to F + B, no gain from overlapping."""
    return schedules.Costs(F=f, B=i + w, I=i, W=w, FB=f + i + w if fb is None else fb)


def _deepseek_table(ranks, costs):
    """DeepSeek's DualPipeV bubble (PP/2-1)(F&B+B-3W), with PP = 2P stages."""
    return (ranks - 1) * (costs.FB + costs.B - 3 * costs.W)


def test_deepseeks_dualpipev_order_validates_and_has_its_closed_form_bubble():
    """The reference (tests/dualpipe_reference.py, rebuilt from DualPipeV.step) is a valid schedule.
    With F&B = F+B its bubble is the table's plus max((P-1)(F-I), -F) + (P-1)max(0, W-I): the
    order itself, not our simulator, is what exceeds the table when F > I or W > I + F/(P-1)."""
    from dualpipe_reference import dualpipev_reference

    for ranks in range(2, 9):
        for microbatches in range(2 * ranks, 3 * ranks + 1):
            schedules.validate(dualpipev_reference(ranks, microbatches))
    grid = (0.5, 1, 1.5, 2)
    for f, i, w in itertools.product(grid, repeat=3):
        costs = _costs(f, i, w)
        for ranks in (2, 3, 4, 8):
            for microbatches in (2 * ranks, 2 * ranks + 3):
                sim = schedules.simulate(dualpipev_reference(ranks, microbatches), costs)
                excess = max((ranks - 1) * (f - i), -f) + (ranks - 1) * max(0.0, w - i)
                assert max(sim.bubbles) == pytest.approx(_deepseek_table(ranks, costs) + excess), \
                    (f, i, w, ranks, microbatches)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_dualpipev_is_no_worse_than_deepseeks_order(ranks):
    """On the grid F, I, W in {0.5, 1, 2}, F&B = F+B or max(F, B) (the most overlap can save),
    and M = 2P or 2P+3, the preset's makespan, worst bubble and peak activations are never above
    those of DeepSeek's DualPipeV order."""
    from dualpipe_reference import dualpipev_reference

    grid = (0.5, 1, 2)
    for microbatches in (2 * ranks, 2 * ranks + 3):
        ours = schedules.build("dualpipev", ranks, microbatches)
        reference = schedules.validate(dualpipev_reference(ranks, microbatches))
        for f, i, w in itertools.product(grid, repeat=3):
            for fb in (f + i + w, max(f, i + w)):
                costs = _costs(f, i, w, fb)
                mine, theirs = schedules.simulate(ours, costs), schedules.simulate(reference, costs)
                where = (microbatches, costs, mine.bubbles, theirs.bubbles)
                assert mine.makespan <= theirs.makespan + 1e-9, where
                assert max(mine.bubbles) <= max(theirs.bubbles) + 1e-9, where
                assert max(mine.peak_activations) <= max(theirs.peak_activations), where


def test_dualpipev_when_a_forward_costs_as_much_as_a_backward():
    """F = 2, I = 1.5, W = 0.5 (F = B), no gain from overlapping: the table says 4.5(P-1).

    DeepSeek's order has a bubble of 5(P-1) here: every rank runs its 2P warm-up forwards (the
    last rank 2P+1) before its first backward, so with F > I the last rank reaches that backward
    at 3P*F, after its input gradient (2P*F + (P-1)*I); the (P-1)(F-I) = 0.5(P-1) difference is
    on the critical path. The preset splits the last stage's last backward into I then W, which
    starts the final chain of input gradients through all 2P stages a W sooner: table +
    (P-1)(F-I) - W, i.e. the table's 4.5 at P = 2, and 14.5 and 34.5 where the table says 13.5
    and 31.5 at P = 4 and 8. The table is not a limit of valid schedules (ones without DualPipe's
    phases idle less with these costs), but the rest of the gap is DualPipeV's warm-up itself:
    this pins both orders' bubbles so that a change to the phases shows here."""
    from dualpipe_reference import dualpipev_reference

    costs = _costs(2, 1.5, 0.5)
    for ranks in (2, 4, 8):
        table = _deepseek_table(ranks, costs)
        assert table == pytest.approx(4.5 * (ranks - 1))
        for microbatches in (2 * ranks, 2 * ranks + 3):
            reference = schedules.simulate(dualpipev_reference(ranks, microbatches), costs)
            ours = schedules.simulate(schedules.build("dualpipev", ranks, microbatches), costs)
            excess = (ranks - 1) * (costs.F - costs.I)
            assert max(reference.bubbles) == pytest.approx(table + excess)
            assert max(ours.bubbles) == pytest.approx(table + excess - costs.W)
            if ranks == 2:  # (P-1)(F-I) = W: the split wins back all of it
                assert max(ours.bubbles) <= table + 1e-9


def test_dualpipev_meets_deepseeks_table_exactly_under_its_cost_condition():
    """With no gain from overlapping (F&B = F+B), dualpipev's bubble is at most DeepSeek's
    (P-1)(F&B+B-3W) if and only if F + W <= 2I, (P-1)(F-I) <= W and (P-1)(W-I) <= F: F > I
    makes the warm-up forwards, and W > I the drain's deferred W's, longer than the table counts;
    splitting the last stage's last backward wins back up to a W of the first, hence
    (P-1)(F-I) <= W rather than DeepSeek's order's F <= I."""
    grid = (0.5, 1, 1.5, 2)
    held = 0
    for f, i, w in itertools.product(grid, repeat=3):
        costs = _costs(f, i, w)
        for ranks in (2, 3, 4, 8):
            q = ranks - 1
            condition = f + w <= 2 * i and q * (f - i) <= w and q * (w - i) <= f
            held += condition
            for microbatches in (2 * ranks, 2 * ranks + 3):
                sim = schedules.simulate(schedules.build("dualpipev", ranks, microbatches), costs)
                assert (max(sim.bubbles) <= _deepseek_table(ranks, costs) + 1e-9) == condition, \
                    (f, i, w, ranks, microbatches, sim.bubbles)
    assert 0 < held < len(grid) ** 3 * 4


def test_dualpipe_beats_1f1b_and_zb1p_on_the_same_layers():
    f, i, w, fb = 1.0, 1.0, 1.0, 2.5
    for ranks in (4, 8):
        m = 2 * ranks
        one_f_one_b = schedules.simulate(schedules.build("1f1b", ranks, m), schedules.Costs(F=f, B=i + w))
        dual = schedules.simulate(schedules.build("dualpipe", ranks, m),
                                  schedules.Costs(F=f, B=i + w, I=i, W=w, FB=fb))
        assert max(dual.bubbles) < max(one_f_one_b.bubbles)
        assert dual.makespan < one_f_one_b.makespan


def test_overlapped_pairs_are_checked():
    row = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)]
    two_forwards = Schedule("custom", 1, 2, (0,), [row], pairs=[{0}])
    with pytest.raises(ScheduleError, match=r"rank 0 actions 0-1 \(F0\.0&F0\.1\): an overlapped pair is one F and one B"):
        schedules.validate(two_forwards)
    waits = Schedule("custom", 1, 2, (0,), [[Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)]],
                     pairs=[{0}])
    with pytest.raises(ScheduleError, match=r"B0\.0 waits for F0\.0, so they cannot run overlapped"):
        schedules.validate(waits)
    fine = Schedule("custom", 1, 2, (0,), [row], pairs=[{1}])
    assert [len(g) for g in schedules.validate(fine).steps(0)] == [1, 2, 1]
    assert "F0.1&B0.0" in schedules.text_grid(fine)


def test_copies_take_their_own_half_of_the_microbatches():
    s = schedules.build("dualpipe", 2, 4)
    assert [s.copy_of(m) for m in range(4)] == [0, 0, 1, 1]
    assert s.stage_rank(0, 0) == 0 and s.stage_rank(0, 3) == 1  # copy 1 runs stage 0 on the last rank
    wrong = Schedule("custom", 2, 4, s.stage_to_rank, [list(r) for r in s.actions], copies=2, pairs=s.pairs)
    wrong.actions[0][0] = Action(0, F, 3)
    with pytest.raises(ScheduleError, match=r"microbatch 3 goes through copy 1, stage 0 is in copy 0"):
        schedules.validate(wrong)


def test_the_custom_schedule_example_round_trips_through_directives():
    from examples.custom_schedule import COSTS, as_directives, one_f_one_b_deferred_weights
    from piper_fx.directives import schedule_from_directives

    custom = schedules.validate(one_f_one_b_deferred_weights(2, 4))
    again = schedules.validate(schedule_from_directives(as_directives(custom), 2))
    assert again.actions == custom.actions and again.stage_to_rank == custom.stage_to_rank
    one_f_one_b = schedules.simulate(schedules.build("1f1b", 2, 4), COSTS)
    deferred = schedules.simulate(custom, COSTS)
    assert deferred.makespan < one_f_one_b.makespan  # W's fill the cool-down bubble...
    assert max(deferred.peak_activations) > max(one_f_one_b.peak_activations)  # ...holding activations longer


def test_one_vocabulary_reads_back_what_it_prints():
    from piper_fx.schedules import ActionKind, step_from_str, step_str

    assert Action(0, "F", 1).kind is ActionKind.F and Action(0, ActionKind.W, 1) == Action(0, "W", 1)
    for name in ("zb1p", "dualpipev"):
        built = schedules.build(name, 3, 6, schedules.PRESETS[name].stages_per_rank)
        for rank in range(built.num_ranks):
            assert [Action.from_str(str(a)) for a in built.actions[rank]] == built.actions[rank]
            steps = built.steps(rank)
            assert [step_from_str(step_str(step)) for step in steps] == steps
    assert step_str(step_from_str("F0.1&B3.0")) == "F0.1&B3.0"
    with pytest.raises(ScheduleError, match="unknown action kind 'X'"):
        Action(0, "X", 0)
    with pytest.raises(ScheduleError, match="not of one"):
        Action(0, ActionKind.OVERLAP_F_B, 0)
    with pytest.raises(ScheduleError, match=r"'F0\.0&B0\.0&W0\.0' pairs more than two actions"):
        step_from_str("F0.0&B0.0&W0.0")


def test_every_shape_a_preset_accepts_builds_a_valid_schedule():
    accepted = 0
    for preset in schedules.PRESETS.values():
        for pp, stages_per_rank in itertools.product(range(1, 7), (1, 2, 3)):
            for microbatches in range(1, 3 * pp + 3):
                try:
                    preset.check(pp, microbatches, stages_per_rank)
                except schedules.ShapeError:
                    continue
                built = schedules.validate(preset(pp, microbatches, stages_per_rank))
                assert built.stages_per_copy == pp * stages_per_rank, (preset.name, pp, microbatches)
                accepted += 1
    assert accepted > 300


def test_presets_state_their_own_rules():
    dualpipe = schedules.PRESETS["dualpipe"]
    for shape, parameter in [((3, 6, 1), "ranks"), ((2, 4, 2), "stages_per_rank"), ((2, 3, 1), "microbatches"),
                             ((2, 5, 1), "microbatches")]:
        with pytest.raises(schedules.ShapeError) as info:
            dualpipe.check(*shape)
        assert info.value.parameter == parameter
    assert schedules.PRESETS["interleaved_1f1b"].stages_per_rank == 2
    assert schedules.min_microbatches("dualpipev", 4, 2) == 8 and schedules.min_microbatches("gpipe", 4, 1) == 1
    assert schedules.V_SHAPED == {"zbv", "dualpipev"}
    assert schedules.SPLIT_BACKWARD == {"zb1p", "zbv", "dualpipev", "dualpipe"}
