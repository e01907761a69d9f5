"""The completion barrier: a member takes an all-reduce's result only once it knows that every
member holds all of it.

Without it, a member that died in the last rounds of the all-gather left the members that already
had every frame with the result and the others with an error; those retried the step among the
survivors, and the step had two results (seen: a node stopped in the middle of the all-gather).

Once every frame of the all-reduce is in (and, with robust aggregation, checked), a member sends its
successor in the ring the set of members it knows to hold the whole result, itself first, on the
connection that carried its all-gather frames; it reads its predecessor's sets and passes the union
on whenever it grows. It takes the result once the set holds every member. Sets only grow, so each
member sends at most n frames of a few bytes, and the last member to finish is known everywhere n − 1
hops later.

Only what a member receives decides: its sends are best effort (a successor that already knows
everything may have closed the connection). A member whose barrier fails shuts its connections, so
its successor fails at once, and so on around the ring; a member that dies before it sent its own
set leaves every survivor with an error, all alike, and they retry together.

How long a member waits: as long as the data phase may still legitimately take, failure_timeout
for each frame it receives, plus one for each hop of the sets. A predecessor on a slow link may be
a whole segment of frames behind (with a fixed wait of two failure timeouts, a ring with one slow
link failed every attempt, and members that had sent their set and then timed out left others
with the result). A frame that does not grow the sender's set is refused, so a member cannot hold
its successor longer by repeating itself.

What it cannot close: a member that dies (or stalls past the bound) while the sets travel, after
some members learned that all hold the result and before the others did. That window is a few
small frames long; before, it was the last round of the all-gather's data. Nor does it hold
against a member that lies: one that forwards a full set it did not receive can split the
others as one that withholds the all-gather's last chunk could before. The params hash in the
heartbeats is the backstop for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from p2ptrain.comm import lanes
from p2ptrain.comm.wire import FrameError, WireError

log = logging.getLogger(__name__)

DONE = "done"
"""The kind of a barrier frame: header {"kind", "step", "holders"}, no payload; "holders" is a
bitmap (bit i of byte i // 8: member i), bytes so that it fits any number of members."""


def holders_in(header: dict, step: int, n: int, sender: int, before: int) -> int:
    """The set a barrier frame from member `sender` carries; FrameError for anything else. A sender
    sends only once it holds the result (its own bit is in the set) and only when its set grew
    (a strict superset of `before`, the set it sent last): so at most n frames come."""
    raw = header.get("holders")
    if header.get("kind") != DONE or header.get("step") != step:
        raise FrameError(f"expected a barrier frame of step {step}, got {header.get('kind')!r}")
    if not isinstance(raw, bytes) or len(raw) != (n + 7) // 8:
        raise FrameError(f"barrier frame whose set of holders is not {(n + 7) // 8} bytes")
    holders = int.from_bytes(raw, "little")
    if holders >> n or not holders >> sender & 1 or holders & before != before or holders == before:
        raise FrameError(f"barrier frame with a bad set of holders: {holders:#x} after {before:#x}")
    return holders


async def on_own_thread(work: Callable[[], None], name: str) -> None:
    """`work()` on a thread of its own, as the transfer's (the default executor may be busy with a
    checkpoint's copy or hash). Cancelled, it leaves the thread to end when the caller shuts the
    connections it blocks on (ring_all_reduce does, in any case)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():  # cancelled meanwhile
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            work()
        except BaseException as exc:  # handed to the waiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    await done


def await_every_holder(
    index: int,
    n: int,
    step: int,
    to_successor: lanes.Channel,
    from_predecessor: lanes.Channel,
    seconds: float,
) -> None:
    """Block until this member knows that all `n` members hold the result; WireError when that
    takes more than `seconds`, a frame of its predecessor's is not a barrier frame (or does not
    grow its set), or the connection ends first."""
    everyone, known, deadline = (1 << n) - 1, 1 << index, time.monotonic() + seconds
    _tell(to_successor, step, n, known, seconds)
    predecessor, theirs = (index - 1) % n, 0
    while known != everyone:
        frame = lanes.recv_frame(from_predecessor, max(0.0, deadline - time.monotonic()), 0)
        theirs = holders_in(frame.header, step, n, predecessor, theirs)
        if theirs | known != known:
            known |= theirs
            _tell(to_successor, step, n, known, seconds)


def _tell(channel: lanes.Channel, step: int, n: int, holders: int, timeout: float) -> None:
    header = {"kind": DONE, "step": step, "holders": holders.to_bytes((n + 7) // 8, "little")}
    try:
        lanes.send_frame(channel, header, b"", timeout)
    except WireError as exc:  # it knows already, or it failed: either way our outcome is ours
        log.debug("step %d: barrier frame not sent to the successor: %s", step, exc)
