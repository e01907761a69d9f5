"""One attempt of one all-reduce step on a node: who may connect and their connections as they
arrive (`Registration`), and the error that ends an attempt (`AllReduceError`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from p2ptrain.comm.transport.handshake import Admission, Session
from p2ptrain.comm.transport.resume import WarmLane
from p2ptrain.comm.transport.wire import WireError

T = TypeVar("T")

StreamConnection = tuple[asyncio.StreamReader, asyncio.StreamWriter, Session]
"""A connection authenticated by a handshake, on asyncio's streams, and what the handshake
established (its keys among it)."""
Connection = StreamConnection | WarmLane
"""A lane of an attempt: freshly authenticated, or kept from an earlier step and re-bound to this
one (transport/resume.py)."""
LaneKey = tuple[bytes, int]
"""(peer key, lane): one of the `connections` parallel connections from that peer."""


def session_of(connection: Connection) -> Session:
    return connection.session if isinstance(connection, WarmLane) else connection[2]


def close_connection(connection: Connection) -> None:
    if isinstance(connection, WarmLane):
        connection.close()
    else:
        connection[1].close()


class AllReduceError(WireError):
    """This member's all-reduce failed; its buffer is unchanged. Retry with the survivors."""

    def __init__(
        self,
        message: str,
        unresponsive: bytes | None = None,
        *,
        views_differ: bool = False,
        refuser: bytes | None = None,
        out_of_step: bool = False,
    ):
        super().__init__(message)
        self.unresponsive = unresponsive
        """A member this node could not reach or that did not answer in time, where one is named."""
        self.views_differ = views_differ
        """A peer elected other members (another digest): elect again shortly, blaming no one."""
        self.refuser = refuser
        """The member whose handshake refused a dial of ours outright: our views differ, or a plain
        no (not "dial again", not "that attempt is over here": honest members say those to each
        other for as long as any member fails their attempts). An honest member says it only while
        views converge; one that keeps saying it is lying, as a stranger can, or broken (outer_sync
        names it then)."""
        self.out_of_step = out_of_step
        """A member is at another attempt of this step than ours: it has moved on to a later one (it
        dialed us with a later number, or answered that ours is over there), or it answered "dial
        again", still in an earlier one, for the whole setup deadline (then it is `refuser`). Nobody
        is to blame yet (the member that saw an attempt fail counted that), so not a failed try:
        counted as one, members cycling through attempts while a refuser's patience ran burned
        every retry of their peers. A later attempt names no one: a stranger that claims ever later
        ones pushes honest members ahead of each other, and they then say it too (naming it named
        honest members); "dial again" for three deadlines names its sayer (outer_sync)."""
        self.connected: frozenset[bytes] = frozenset()
        """Members whose handshake with this node completed in the failed attempt (either way): they
        did not refuse it (set by all_reduce)."""


@dataclass(kw_only=True)
class Registration:
    """One attempt of one step on this node: who may connect, and their connections as they arrive.

    `abandoned` is set when a peer shows it has moved to a later attempt; it ends the attempt while
    it is still connecting (`unless_abandoned`). Once data flows, the peer's closed connections do.
    """

    attempt: int
    admission: Admission
    incoming: dict[LaneKey, asyncio.Future[Connection]]
    claimed: set[LaneKey] = field(default_factory=set)
    heard: set[bytes] = field(default_factory=set)
    """Members whose hello for this step arrived during the attempt, taken or not: alive and
    trying (a refused one elected other members), so not to be named as unresponsive. Members only:
    strangers' keys once filled it."""
    abandoned: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    def abandon(self, reason: str) -> None:
        if not self.abandoned.is_set():
            self.reason = reason
            self.abandoned.set()

    async def unless_abandoned(self, work: Awaitable[T]) -> T:
        """`work`'s result, or AllReduceError as soon as a peer has given this attempt up."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self.abandoned.wait())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if task.cancelled() and self.abandoned.is_set():
            raise AllReduceError(self.reason, out_of_step=True)
        return task.result()
