"""The agent ↔ rank 0 channel over a real socket pair."""

from __future__ import annotations

import asyncio
import socket

import pytest

from p2ptrain.channel import AgentChannel, ChannelError, Finished, RankChannel, StepDone, encode


def test_a_cancelled_receive_loses_no_message_even_between_its_length_and_its_body():
    """The agent stops waiting for rank 0 when a rank exits; rank 0's last message (Finished) may
    then be half read. The next receive must still return it, and the one after it."""

    async def scenario() -> None:
        agent_end, rank_end = socket.socketpair()
        channel = await AgentChannel.open(agent_end)
        first = encode(Finished(outer_step=3))
        rank_end.sendall(first[:6])  # the length and two bytes of the body
        waiting = asyncio.ensure_future(channel.receive())

        async def length_taken() -> None:
            while len(channel.reader._buffer) != 2:  # the two body bytes are left: it waits for more
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


def test_messages_cross_both_ways():
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
