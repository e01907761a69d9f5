"""The agent ↔ rank 0 channel over a real socket pair."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from p2ptrain.channel import (
    AgentChannel,
    Averaged,
    ChannelError,
    Finished,
    RankChannel,
    StepDone,
    encode,
)
from p2ptrain.node.agent import TrainingNode
from p2ptrain.node.interrupt import Interrupted, finish_first, unless
from p2ptrain.train.agent_link import ChannelLink


def test_a_cancelled_receive_loses_no_message_even_between_its_length_and_its_body() -> None:
    """The agent stops waiting for rank 0 when a rank exits; rank 0's last message (Finished) may
    then be half read. The next receive must still return it, and the one after it."""

    async def scenario() -> None:
        agent_end, rank_end = socket.socketpair()
        channel = await AgentChannel.open(agent_end)
        first = encode(Finished(outer_step=3))
        rank_end.sendall(first[:6])  # the length and two bytes of the body
        waiting = asyncio.ensure_future(channel.receive())

        async def length_taken() -> None:
            # the two body bytes are left: it waits for more (_buffer is private: not in typeshed)
            while len(channel.reader._buffer) != 2:  # type: ignore[attr-defined]
                await asyncio.sleep(0.001)

        await asyncio.wait_for(length_taken(), 5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        rank_end.sendall(first[6:] + encode(StepDone(outer_step=4, params_hash="ab", loss=1.0)))
        assert await asyncio.wait_for(channel.receive(), 5) == Finished(outer_step=3)
        assert await asyncio.wait_for(channel.receive(), 5) == StepDone(
            outer_step=4, params_hash="ab", loss=1.0
        )
        rank_end.close()
        with pytest.raises(ChannelError):
            await asyncio.wait_for(channel.receive(), 5)
        channel.close()

    asyncio.run(scenario())


def test_messages_cross_both_ways() -> None:
    async def scenario() -> None:
        agent_end, rank_end = socket.socketpair()
        channel = await AgentChannel.open(agent_end)
        rank = RankChannel(rank_end)
        await asyncio.to_thread(rank.send, Finished(outer_step=1))
        assert await asyncio.wait_for(channel.receive(), 5) == Finished(outer_step=1)
        await channel.send(StepDone(outer_step=2, params_hash="cd", loss=0.5))
        assert await asyncio.to_thread(rank.receive) == StepDone(outer_step=2, params_hash="cd", loss=0.5)
        channel.close()
        rank_end.close()

    asyncio.run(scenario())


def test_the_agent_loses_no_message_when_a_rank_exit_interrupts_its_wait_for_the_next_one() -> None:
    """A rank that exits (rank 1 after the final barrier) interrupts the agent's wait for rank 0's
    next message. Where that message (Finished) was read in the same turn of the event loop, it
    must still be the next one the agent gets: seen lost on 2 cores, the node then exited 1 with
    "trainer rank 1 exited with code 0". Interruptions here land at every point of the read."""

    async def scenario() -> list[int]:
        agent_end, rank_end = socket.socketpair()
        channel = await AgentChannel.open(agent_end)
        rank = RankChannel(rank_end)
        node = SimpleNamespace(syncing=None)  # the one attribute _next_message reads

        def send_all() -> None:
            for i in range(COUNT):
                rank.send(StepDone(i, "ab", 1.0))

        sent = asyncio.ensure_future(asyncio.to_thread(send_all))
        got: list[int] = []
        turns = 0
        deadline = time.monotonic() + 30  # a bound for a failing run: lost messages never come
        while len(got) < COUNT and time.monotonic() < deadline:
            turns += 1
            interruption = asyncio.sleep(0) if turns % 3 else asyncio.sleep(0.0005)
            try:
                # node stands in for a TrainingNode: not one to the type checker
                message = await unless(TrainingNode._next_message(node, channel), interruption)  # type: ignore[arg-type]
            except Interrupted:
                continue
            assert isinstance(message, StepDone)
            got.append(message.outer_step)
        await sent
        channel.close()
        rank_end.close()
        return got

    assert asyncio.run(scenario()) == list(range(COUNT))


COUNT = 300


def test_rank_zero_asks_whether_a_steps_answer_is_here_without_waiting_and_keeps_it(tmp_path: Path) -> None:
    """outer.overlap.take_on_arrival: rank 0 looks at the channel between inner steps. Nothing there, or
    only another step's answer: not here, and no wait. The answer: here, and `collect` returns it
    without reading again."""
    agent_end, rank_end = socket.socketpair()
    link = ChannelLink(RankChannel(rank_end), tmp_path / "buffer")
    assert not link.arrived(5)  # nothing sent: it must not block
    agent_end.sendall(encode(Averaged(outer_step=4, members=2)))
    assert not link.arrived(5)  # an old step's answer is read and dropped
    answer = Averaged(outer_step=5, members=3, sync_s=1.5)
    agent_end.sendall(encode(answer) + encode(Averaged(outer_step=6, members=2)))
    assert link.arrived(5)
    assert link.arrived(5)  # kept: asking again reads nothing more
    assert link.collect(5) == answer
    assert link.arrived(6)  # the next answer was left on the channel
    assert link.collect(6) == Averaged(outer_step=6, members=2)
    agent_end.close()
    rank_end.close()


def test_work_under_way_when_the_node_stops_finishes_within_the_grace_then_is_cancelled() -> None:
    """`finish_first` (the all-reduce of a node told to stop): cancelled while its work runs, the work
    still ends before the cancellation goes on; work that would take longer is cut at the grace."""

    async def scenario() -> tuple[list[float], list[BaseException | float], float]:
        ended: list[float] = []

        async def work(seconds: float) -> float:
            await asyncio.sleep(seconds)
            ended.append(seconds)
            return seconds

        quick = asyncio.ensure_future(finish_first(work(0.3), grace=10.0))
        slow = asyncio.ensure_future(finish_first(work(60.0), grace=0.3))
        await asyncio.sleep(0.05)  # both under way
        started = asyncio.get_running_loop().time()
        quick.cancel()
        slow.cancel()
        outcomes = await asyncio.gather(quick, slow, return_exceptions=True)
        return ended, list(outcomes), asyncio.get_running_loop().time() - started

    ended, outcomes, waited = asyncio.run(scenario())
    assert ended == [0.3]  # the quick work ended though its caller was cancelled; the slow one did not
    assert all(isinstance(outcome, asyncio.CancelledError) for outcome in outcomes), outcomes
    assert waited < 10, waited  # the slow one was cut at its grace, not awaited to its end
