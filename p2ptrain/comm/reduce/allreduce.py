"""The all-reduce of one outer step, over authenticated TCP between members: int8 (or int4: `bits`)
codes through the ring or the butterfly, or the sparse codec's gather (gather.py).

Every member of step N calls `all_reduce` with the same ordered member list; with dense codes it
runs the ring or the butterfly (`comm.topology`). The flat fp32
vector is cut into one segment per member (member i owns segment i+1 mod n) and each segment into
chunks (`chunk_bytes`). Two reduce-scatter topologies share one all-gather:

- ring: n−1 rounds; a member receives a chunk from its predecessor, decodes it, adds its own
  weighted values in fp32, re-encodes the partial sum and sends it to its successor. Only ring
  neighbours talk, so slow links can be avoided by the ring order; but each hop re-encodes a
  growing partial sum, so the error grows with n (0.9 % at 3 members, 1.4 % at 8).
- butterfly: every member sends its own encoded chunks of segment j straight to j's owner, which
  sums them in fp32. The same bytes leave each member as in the ring, every contribution is encoded
  once, and the error stays near 0.9 % at any n; but every pair of members must connect.
- all-gather (both): each owner encodes its reduced segment once; the bytes travel around the ring
  unchanged, and every member, the owner included, decodes the same bytes: bit-identical results.

`comm.topology = "auto"` takes the ring up to 3 members (where it meets the 1 % error budget), the
butterfly above and under robust aggregation (`comm.robust`, on by default in open runs): its owners
clip the shares they sum to limits every member can check and leave out those pointing away from
the others' (robust/aggregator.py). Each member scales its values by its share of the weights.

Who sends which frames to whom is schedule.py; what one member does with them, plan.py (gather.py
for the sparse codec). Connections are set up and authenticated on the event
loop (or kept from the step before and re-bound to this one: transport/resume.py); the transfer
itself runs on threads (transfer.py), one per connection and direction, with blocking socket calls
(lanes.py) and the kernels (which release the GIL): a chunk goes out as soon as what it depends on
came in, while the next one is already on the wire. With `connections` = M, each pair of members
holds M connections ("lanes") and the chunks of a stream take them in turn. The event loop meanwhile
watches the connections we only send on, so a peer that hangs up early is noticed at once.

Failure is all-or-nothing. Any error — a member that dies, stalls past `failure_timeout`, sends a
malformed frame or non-finite block parameters, or our own NaN/Inf — shuts all of this member's
connections, which makes its peers fail at once too, and raises AllReduceError. The caller's buffer
is untouched until every frame arrived and every member is known to hold them (barrier.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from p2ptrain.comm.codec import quant
from p2ptrain.comm.codec.sparse import ErrorFeedback, weighted_sum
from p2ptrain.comm.net.attempt import AllReduceError, Connection, close_connection, session_of
from p2ptrain.comm.net.members import Member, membership_digest
from p2ptrain.comm.net.relay import needs_relay
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.barrier import (
    ALIVE,
    BEATS_PER_TIMEOUT,
    DONE,
    Holding,
    Proven,
    await_every_holder,
)
from p2ptrain.comm.reduce.connect import LanePlan, connect_lanes
from p2ptrain.comm.reduce.gather import GatherPlan, sparse_code
from p2ptrain.comm.reduce.plan import Progress, ReducePlan, ReduceStats, link_rates
from p2ptrain.comm.reduce.transfer import Transfer
from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.handshake import HandshakeError, Session, ViewsDiffer
from p2ptrain.comm.transport.resume import WarmLane
from p2ptrain.comm.transport.wire import WireError

log = logging.getLogger(__name__)


def _keep_lanes(plan: ReducePlan, transfer: Transfer, members: Sequence[Member]) -> list[WarmLane]:
    """The lanes of a step that succeeded to keep for the next (transport/resume.py): all but the
    relayed ones (the next step may have another relay) and the lane to the ring successor if a
    barrier frame on it may have gone out cut (the barrier's sends are best effort)."""
    relayed = {member.key for member in members if needs_relay(member, members[plan.index])}
    whole = plan.to_successor.release()
    successor_lane = plan.to_successor.channel

    def wanted(channel: lanes.Channel, session: Session) -> bool:
        return session.peer_key not in relayed and (whole or channel is not successor_lane)

    return transfer.keep(wanted, frozenset({ALIVE, DONE}))


async def all_reduce(
    server: DataPlaneServer,
    *,
    step: int,
    members: Sequence[Member],
    buffer: np.ndarray,
    progress: Progress | None = None,
    relays: Sequence[Member] = (),
    reference: np.ndarray | None = None,
    feedback: ErrorFeedback | None = None,
) -> ReduceStats:
    """Replace `buffer` (1-D fp32) with the weighted average over `members`, identical on all of them.
    `relays`: the standby relays the election listed (relay.relay_for), part of the digest.
    `reference`: the last result this member took, of `buffer`'s length (robust aggregation weighs
    the shares of the segment it owns by their agreement with it, clipping.robust_sum); None: none.
    `feedback`: this node's error feedback under the sparse codec (`buffer` holds the step's delta;
    what it sends comes from the accumulator, which keeps the rest); None: a fresh one each call.

    Raises AllReduceError (buffer unchanged) when any member fails; see the module docstring.
    """
    identity, comm = server.identity, server.comm
    if buffer.dtype != np.float32 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise TypeError("the all-reduce buffer must be a contiguous 1-D float32 array")
    keys = [member.key for member in members]
    if identity.public_key not in keys or len(set(keys)) != len(keys):
        raise ValueError("members must be distinct and include this node")
    # the attempt's deadlines grow with the slowest path to a member we measured (net/paths.py)
    failure_timeout = server.paths.failure_timeout(
        keys, configured=comm.failure_timeout, cap=BEATS_PER_TIMEOUT * comm.failure_timeout
    )
    if failure_timeout != comm.failure_timeout:
        comm = comm.model_copy(update={"failure_timeout": failure_timeout})
    started = time.monotonic()
    own_share = None
    if comm.codec == "sparse":
        feedback = feedback or ErrorFeedback(code=sparse_code(comm), decay=0.0)
        try:
            own_share = await asyncio.to_thread(feedback.share, step, buffer)
        except quant.NonFiniteError as exc:
            raise AllReduceError(
                f"step {step}: NaN or Inf in this node's contribution ({exc}); not sent"
            ) from exc
    if len(members) == 1:
        if not quant.all_finite(buffer):
            raise AllReduceError(f"step {step}: this node's contribution holds NaN or Inf")
        if own_share is not None and feedback is not None:  # alone, a node applies what it would send
            weighted_sum([own_share], [1.0], buffer, feedback.code)
            feedback.sent(step)
        return ReduceStats(seconds=time.monotonic() - started)
    # NaN/Inf of ours are caught where a chunk is encoded, before anything is sent; the error then
    # shuts every connection, so the others fail at once instead of waiting for a timeout.
    loop = asyncio.get_running_loop()
    digest = membership_digest(step, members, relays)
    usable = reference is not None and reference.shape == buffer.shape
    kind: Callable[..., ReducePlan] = (
        functools.partial(GatherPlan, own_share=own_share)
        if own_share is not None
        else functools.partial(ReducePlan, reference=reference if usable else None)
    )
    plan = kind(
        index=keys.index(identity.public_key),
        members=members,
        own=buffer,
        comm=comm,
        step=step,
        progress=progress,
        identity=identity,
        digest=digest,
    )
    plan.stats.failure_timeout = comm.failure_timeout
    lane_plan = LanePlan.of(members, plan.schedule)
    registration = server.expect(
        step, (), digest=digest, lanes=lane_plan.incoming_lanes(members, comm.connections), members=members
    )
    incoming = registration.incoming
    connections: list[Connection] = []
    transfer = Transfer(plan, loop)
    cancelled = False
    kept: list[WarmLane] = []
    try:
        sending, receiving = await connect_lanes(
            server,
            members=members,
            plan=lane_plan,
            registration=registration,
            step=step,
            digest=digest,
            connections=connections,
            standby=relays,
            failure_timeout=comm.failure_timeout,
        )
        connected_at = time.monotonic()
        plan.stats.connect_s = connected_at - started
        bound = plan.data_phase_bound()  # the data phase, and the barrier after it, as the data allow
        plan.data_deadline = connected_at + bound
        outgoing = {slot: transfer.adopt(connection, sending=True) for slot, connection in sending.items()}
        into = {slot: transfer.adopt(connection, sending=False) for slot, connection in receiving.items()}
        transfer.start(outgoing, into)
        await transfer.finished
        if plan.failure is not None:
            raise plan.failure
        plan.check_results()
        transferred_at = time.monotonic()
        plan.stats.transfer_s = transferred_at - connected_at
        holding = Holding.signed(
            identity,
            step,
            keys=keys,
            digest=digest,
            attempt=registration.attempt,
            holds=plan.holding_digest(),
        )
        barrier = functools.partial(
            await_every_holder,
            holding,
            to_successor=plan.to_successor,
            from_predecessor=into[plan.schedule.predecessor, 0],
            seconds=bound,
            testimony=plan.testimony(),
            check_testimony=plan.testimony_check(),
        )
        await lanes.on_own_thread(barrier, f"p2ptrain-ring-barrier-{step}")
        plan.stats.barrier_s = time.monotonic() - transferred_at
        server.completed(step)
        if comm.warm_lanes:
            kept = _keep_lanes(plan, transfer, members)
    except AllReduceError as exc:
        # normal while records spread, or while another member's failure moves the step on
        level = logging.INFO if exc.views_differ or exc.out_of_step else logging.WARNING
        log.log(level, "all-reduce of step %d failed: %s", step, exc)
        exc.connected = frozenset(session_of(connection).peer_key for connection in connections)
        raise
    except quant.NonFiniteError as exc:
        log.warning("all-reduce of step %d failed: NaN or Inf in this node's contribution", step)
        raise AllReduceError(
            f"step {step}: NaN or Inf in this node's contribution ({exc}); not sent"
        ) from exc
    except Proven as exc:  # the frames prove it: the evidence names it
        log.warning("all-reduce of step %d failed: %s", step, exc)
        raise AllReduceError(f"step {step}: {exc}", unresponsive=exc.culprit) from exc
    except (WireError, HandshakeError, OSError) as exc:
        log.warning("all-reduce of step %d failed, connections dropped: %s", step, exc)
        raise AllReduceError(f"step {step}: {exc}", views_differ=isinstance(exc, ViewsDiffer)) from exc
    except asyncio.CancelledError:
        cancelled = True  # the caller stops waiting: do not block its cancellation on the threads
        raise
    finally:
        plan.to_successor.stop()
        transfer.stop()
        kept_sockets = {lane.sock for lane in kept}
        accepted = [  # accepted, but the step may have failed before they were used
            future.result()
            for future in incoming.values()
            if future.done() and not future.cancelled() and future.exception() is None
        ]
        for connection in accepted + connections:
            if not (isinstance(connection, WarmLane) and connection.sock in kept_sockets):
                close_connection(connection)
        server.forget(step)
        server.paths.measured(round_trips=plan.stats.round_trips)
        if not cancelled:
            await asyncio.to_thread(transfer.join, comm.failure_timeout)
    for lane in kept:
        server.warm.keep(lane)
    server.warm.prune(step)
    await loop.run_in_executor(None, plan.write_result, buffer)
    if feedback is not None:
        feedback.sent(step)
    plan.stats.result = plan.finals
    if plan.aggregator is not None:
        plan.stats.clipped = dict(plan.aggregator.clipped)
        plan.stats.left_out = dict(plan.aggregator.left_out)
    plan.stats.link_rates = link_rates({plan.keys[peer]: held for peer, held in plan.held_up.items()})
    server.paths.measured(rates=plan.stats.link_rates)
    plan.stats.seconds = time.monotonic() - started
    return plan.stats
