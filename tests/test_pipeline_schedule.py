"""The pipeline bubble by simulation (planner/pipeline_schedule.py) on DeepSpeed's own instruction streams.

- 1F1B (TrainSchedule): for p in {2, 4, 8} and m in {2p, 4p, 16p}, every rank idles exactly (p - 1)(F + B), the
  bubble (p - 1) / m; and with unit costs the idle time equals the idle slots counted in DeepSpeed's schedule (its
  steps with neither a forward nor a backward).
- DualPipeV (DualPipeVSchedule, W kept inside B as DeepSpeed 0.19.8 does): the same compute per rank, every tensor
  sent is received, and less idle time than 1F1B at every (p, m). The figures are printed.
- Fewer than 2p micro-batches, which DeepSpeed's DualPipeVSchedule refuses: the V-shaped schedule runs, its sends and
  receives pair up commit by commit, and it does 1F1B's work.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from planner.pipeline_schedule import instruction_streams, message_channel, simulate

CASES = [(p, m) for p in (2, 4, 8) for m in (2 * p, 4 * p, 16 * p)]
FORWARD, BACKWARD = 1.0, 2.0  # costs in units that keep every sum exact in floating point


@pytest.mark.parametrize("stages, micro_batches", CASES)
def test_1f1b_idles_p_minus_1_slots_the_formula(stages, micro_batches):
    result = simulate("1f1b", stages, micro_batches, FORWARD, BACKWARD)
    assert result.busy == (micro_batches * (FORWARD + BACKWARD),) * stages
    assert result.idle == ((stages - 1) * (FORWARD + BACKWARD),) * stages
    assert Fraction(result.bubble) == Fraction(stages - 1, micro_batches)


@pytest.mark.parametrize("stages, micro_batches", CASES)
def test_1f1b_idle_slots_counted_in_deepspeeds_schedule_equal_the_simulation(stages, micro_batches):
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    unit = simulate("1f1b", stages, micro_batches, 1.0, 1.0)
    for rank in range(stages):
        steps = list(TrainSchedule(micro_batches, stages, rank).steps())
        idle_slots = sum(not any(isinstance(i, (ForwardPass, BackwardPass)) for i in step) for step in steps)
        assert idle_slots == unit.idle[rank] == 2 * (stages - 1)


def test_dualpipev_fills_part_of_the_bubble():
    rows = []
    for stages, micro_batches in CASES:
        plain = simulate("1f1b", stages, micro_batches, FORWARD, BACKWARD)
        dual = simulate("dualpipev", stages, micro_batches, FORWARD, BACKWARD)
        assert dual.busy == plain.busy  # two half-depth stages per rank: the same work
        assert max(dual.idle) < min(plain.idle)
        rows.append(f"p {stages} m {micro_batches:>3}: idle 1F1B {plain.idle[0]:g} ({plain.bubble:.4f}), "
                    f"DualPipeV {max(dual.idle):g} ({dual.bubble:.4f})")
    print("\n" + "\n".join(rows))


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_dualpipev_channels_pair_every_send_with_a_receive(stages):
    counts: dict[tuple, int] = {}
    for rank, stream in enumerate(instruction_streams("dualpipev", stages, 2 * stages)):
        for instruction in stream:
            name = type(instruction).__name__
            if name.startswith(("Send", "Recv")) and name != "SendRecv":
                channel = message_channel("dualpipev", rank, instruction)
                assert 0 <= channel[0] < stages and 0 <= channel[1] < stages, (rank, instruction)
                counts[channel] = counts.get(channel, 0) + (1 if name.startswith("Send") else -1)
    assert counts and all(balance == 0 for balance in counts.values())


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_below_2p_micro_batches_the_v_shaped_schedule_runs(stages):
    """DeepSpeed's DualPipeVSchedule refuses fewer than 2p micro-batches; "dualpipev" then runs the V-shaped 1F1B
    (model/pipe_schedules.py) on the same stages: every tensor sent is received, in the same order on both ranks
    of a CommitP2P, every rank does the same work, and nothing waits forever (the replay would raise)."""
    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule

    from model.pipe_schedules import VShapeSchedule

    with pytest.raises(ValueError, match=f"DualPipeV needs at least 2 \\* {stages} micro-batches, got 3"):
        list(DualPipeVSchedule(3, stages, 0).steps())
    rows = []
    for micro_batches in range(1, 2 * stages):
        streams = instruction_streams("dualpipev", stages, micro_batches)
        assert all(isinstance(schedule, VShapeSchedule) for schedule in _schedules("dualpipev", stages, micro_batches))
        sent, received = _messages_per_commit(streams)
        assert sent == received  # the same (peer, kind, phase) sequence on both ends of every CommitP2P
        plain = simulate("1f1b", stages, micro_batches, FORWARD, BACKWARD)
        vshape = simulate("dualpipev", stages, micro_batches, FORWARD, BACKWARD)
        assert vshape.busy == plain.busy
        rows.append(f"p {stages} m {micro_batches:>2}: makespan 1F1B {plain.makespan:g}, V-shape {vshape.makespan:g}")
    print("\n" + "\n".join(rows))


def _schedules(schedule: str, stages: int, micro_batches: int) -> list:
    from model.pipe_schedules import schedule_for, train_schedule

    name = schedule_for(schedule, micro_batches, stages)
    return [train_schedule(name, micro_batches, stages, rank) for rank in range(stages)]


def _messages_per_commit(streams: list[list]) -> tuple[dict, dict]:
    """{(sender, receiver, n-th CommitP2P of the sender / receiver): [kind, phase, ...]} for sends and receives."""
    sent, received = {}, {}
    for rank, stream in enumerate(streams):
        commits = 0
        for instruction in stream:
            name = type(instruction).__name__
            if name == "CommitP2P":
                commits += 1
            elif name.startswith(("Send", "Recv")):
                sender, receiver, kind, phase = message_channel("dualpipev", rank, instruction)
                book = sent if name.startswith("Send") else received
                book.setdefault((sender, receiver, commits), []).append((kind, phase))
    return sent, received


def test_unknown_schedule_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="parallelism.pipeline_schedule must be one of"):
        simulate("interleaved", 4, 8, FORWARD, BACKWARD)
