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

What it cannot close: a member that dies while the sets travel, after some members learned that all
hold the result and before the others did. That window is a few small frames long; before, it was
the last round of the all-gather's data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from p2ptrain.comm import lanes
from p2ptrain.comm.wire import FrameError, WireError

log = logging.getLogger(__name__)

DONE = "done"
"""The kind of a barrier frame: header {"kind", "step", "holders"}, no payload."""
WAIT = 2
"""The barrier waits this many failure_timeouts for each frame of its predecessor's: the last
frames of the all-gather reach the members a frame or two apart."""


def holders_in(header: dict, step: int, n: int, sender: int) -> int:
    """The set (bit i: member i) a barrier frame from member `sender` carries; FrameError for
    anything else. A sender sends only once it holds the result, so its own bit must be in it."""
    holders = header.get("holders")
    if header.get("kind") != DONE or header.get("step") != step:
        raise FrameError(f"expected a barrier frame of step {step}, got {header.get('kind')!r}")
    if type(holders) is not int or not 0 <= holders < 1 << n or not holders >> sender & 1:
        raise FrameError(f"barrier frame with a bad set of holders: {holders!r}")
    return holders


async def every_holder(
    index: int,
    n: int,
    step: int,
    to_successor: lanes.Channel,
    from_predecessor: lanes.Channel,
    failure_timeout: float,
) -> None:
    """`await_every_holder` on a thread of its own, as the transfer's (the default executor may be
    busy with a checkpoint's copy or hash). Cancelled, it leaves the thread to end when the caller
    shuts the connections (ring_all_reduce does, in any case)."""
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
            await_every_holder(index, n, step, to_successor, from_predecessor, failure_timeout)
        except BaseException as exc:  # handed to the waiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=f"p2ptrain-ring-barrier-{step}", daemon=True).start()
    await done


def await_every_holder(
    index: int,
    n: int,
    step: int,
    to_successor: lanes.Channel,
    from_predecessor: lanes.Channel,
    failure_timeout: float,
) -> None:
    """Block until this member knows that all `n` members hold the result; WireError when a
    frame of its predecessor's does not come within WAIT failure timeouts, is not a barrier frame,
    or the connection ends first."""
    everyone, known, timeout = (1 << n) - 1, 1 << index, WAIT * failure_timeout
    _tell(to_successor, step, known, timeout)
    predecessor = (index - 1) % n
    while known != everyone:
        frame = lanes.recv_frame(from_predecessor, timeout, 0)
        holders = holders_in(frame.header, step, n, predecessor)
        if holders | known != known:
            known |= holders
            _tell(to_successor, step, known, timeout)


def _tell(channel: lanes.Channel, step: int, holders: int, timeout: float) -> None:
    try:
        lanes.send_frame(channel, {"kind": DONE, "step": step, "holders": holders}, b"", timeout)
    except WireError as exc:  # it knows already, or it failed: either way our outcome is ours
        log.debug("step %d: barrier frame not sent to the successor: %s", step, exc)
