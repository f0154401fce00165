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


# -- idle slots counted independently: each pass one slot, tensors matched by what they are ------------------------
def _counted_idle_slots(schedule: str, stages: int, micro_batches: int) -> list[int]:
    """Per rank, the slots without a pass when every pass takes one slot and the engines' rules hold: a tensor is
    sent when its send runs (1F1B) or at the sender's next CommitP2P (DualPipeV launches the queued sends there); a
    receive waits for its tensor at the instruction (1F1B) or at the next CommitP2P, which waits for all of them
    (DualPipeV). Unlike the replay, tensors are matched by their identity (kind, micro-batch, stage), not by the
    order of a channel."""
    from planner.pipeline_schedule import instruction_streams

    dual = schedule != "1f1b"
    last = 2 * stages - 1 if dual else stages - 1
    streams = instruction_streams(schedule, stages, micro_batches)
    sent: dict[tuple, int] = {}  # (kind, micro-batch, receiving stage) -> slot it can be received from
    clock, position, busy = [0] * stages, [0] * stages, [0] * stages
    queued_sends: list[list[tuple]] = [[] for _ in range(stages)]
    queued_receives: list[list[tuple]] = [[] for _ in range(stages)]
    seen: list[dict[str, int]] = [{} for _ in range(stages)]  # 1F1B's cyclic buffers: count micro-batches instead

    def identity(rank: int, instruction) -> tuple:
        name, phase = type(instruction).__name__, getattr(instruction, "phase", 0)
        stage = (rank if phase == 0 else last - rank) if dual else rank
        if dual:
            micro_batch = instruction.buffer_id - phase * micro_batches
        else:
            micro_batch = seen[rank].get(name, 0)
            seen[rank][name] = micro_batch + 1
        receiver = {"SendActivation": stage + 1, "SendGrad": stage - 1}.get(name, stage)
        return ("activation" if "Activation" in name else "gradient", micro_batch, receiver)

    def step(rank: int) -> bool:
        instruction = streams[rank][position[rank]]
        name = type(instruction).__name__
        if name in ("ForwardPass", "BackwardPass"):
            clock[rank] += 1
            busy[rank] += 1
        elif name.startswith("Send"):
            key = identity(rank, instruction)
            if dual:
                queued_sends[rank].append(key)
            else:
                sent[key] = clock[rank]
        elif name.startswith("Recv"):
            key = identity(rank, instruction)
            if dual:
                queued_receives[rank].append(key)
            elif key not in sent:
                seen[rank][name] -= 1  # counted again when retried
                return False
            else:
                clock[rank] = max(clock[rank], sent[key])
        elif name == "CommitP2P":
            for key in queued_sends[rank]:
                sent[key] = clock[rank]
            queued_sends[rank] = []
            if any(key not in sent for key in queued_receives[rank]):
                return False
            clock[rank] = max([clock[rank]] + [sent[key] for key in queued_receives[rank]])
            queued_receives[rank] = []
        position[rank] += 1
        return True

    while any(position[r] < len(streams[r]) for r in range(stages)):
        moved = False
        for rank in range(stages):
            while position[rank] < len(streams[rank]) and step(rank):
                moved = True
        assert moved, "the streams deadlock"
    return [max(clock) - work for work in busy]


@pytest.mark.parametrize("stages, micro_batches", CASES + [(p, m) for p in (2, 4, 8) for m in (1, p, 2 * p - 1)])
def test_idle_slots_counted_per_rank_equal_the_simulation(stages, micro_batches):
    """Each pass costs one slot (F = B = 2, each of DualPipeV's two stages half of it): the replay's idle time per
    rank equals the idle slots counted pass by pass, for 1F1B ((p - 1) / m of the compute, 2 (p - 1) slots),
    DualPipeV (m >= 2p) and the V-shaped schedule below it."""
    for schedule in ("1f1b", "dualpipev"):
        counted = _counted_idle_slots(schedule, stages, micro_batches)
        unit = 2.0 if schedule != "1f1b" else 1.0
        replay = simulate(schedule, stages, micro_batches, unit, unit)
        assert list(replay.idle) == counted, (schedule, replay.idle, counted)
        if schedule == "1f1b":
            assert counted == [2 * (stages - 1)] * stages
            assert Fraction(max(replay.idle)) / Fraction(replay.busy[0]) == Fraction(stages - 1, micro_batches)


@pytest.mark.parametrize("stages", [2, 4, 8, 35])
@pytest.mark.parametrize("ratio, shares", [(2.0, (0.5, 0.5)), (3.0, (0.5, 0.5)), (2.0, (2 / 3, 1 / 3))])
def test_dualpipev_idle_does_not_grow_with_the_micro_batches(stages, ratio, shares):
    """What the planner's pipeline_bubble relies on: from 2p micro-batches on, each one more adds a busy main-step
    chunk to every rank, so the idle time of 2p is that of 4p and 16p (ratio B / F; shares: the two stages' parts,
    2 / 3 and 1 / 3 for 530B's 2 + 1 blocks per rank)."""
    from planner.pipeline_schedule import pipeline_bubble

    at_2p = max(simulate("dualpipev", stages, 2 * stages, 1.0, ratio, shares).idle)
    for micro_batches in ((4 * stages, 16 * stages) if stages < 35 else (4 * stages,)):
        assert max(simulate("dualpipev", stages, micro_batches, 1.0, ratio, shares).idle) == pytest.approx(
            at_2p, rel=1e-12)
        assert pipeline_bubble("dualpipev", stages, micro_batches, 1.0, ratio, shares) == pytest.approx(at_2p)
