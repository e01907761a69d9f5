"""The sync of one outer step for one node: ready → election → all-reduce, retried with survivors.

The trainer (and `p2ptrain drill`) hands over the flat fp32 pseudo-gradient of step N and its
weight; `OuterSync.sync` publishes ready(N), elects the members from the signed heartbeats, runs
the int8 all-reduce, and on failure re-elects among the live ready nodes and tries again. The
vector is averaged in place only when an all-reduce completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2ptrain.comm.codec.quant import NonFiniteError
from p2ptrain.comm.codec.sparse import ErrorFeedback
from p2ptrain.comm.net.attempt import AllReduceError
from p2ptrain.comm.net.reach import can_be_dialed
from p2ptrain.comm.net.record_push import RecordPusher
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.allreduce import all_reduce
from p2ptrain.comm.reduce.gather import sparse_code
from p2ptrain.comm.reduce.plan import ReduceStats
from p2ptrain.config import Config
from p2ptrain.faults import Faults
from p2ptrain.identity import short_id
from p2ptrain.node.election_reads import ElectionReads
from p2ptrain.node.interrupt import LEAVING_GRACE_S, finish_first
from p2ptrain.node.record_extras import RecordExtras
from p2ptrain.swarm.crash_watch import CrashWatch, answers_hello
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.election import (
    IN_STEPS,
    Election,
    LeftOut,
    SwarmAhead,
    elect,
    parse_address,
    ready_for,
    swarm_still_at,
)
from p2ptrain.swarm.evidence import Offences, Refusers
from p2ptrain.swarm.membership import HeartbeatPublisher, SwarmView, live
from p2ptrain.swarm.records import Heartbeat, NodeState
from p2ptrain.swarm.roster import Roster
from p2ptrain.swarm.standby import StandbyRelays

log = logging.getLogger(__name__)

MIN_ATTEMPT_SECONDS = 0.5
"""Shortest time one failed attempt of a step takes before the next election (at most half the
heartbeat interval): a refusal that comes at once must not burn every retry before the views
converge (seen: 20 attempts within a second, then the step given up on every node)."""


OUT_OF_STEP_TRIES = 2
"""Attempts that a member at a later attempt ends are free, up to this many times sync_retries
a step; then they count. Members cycle through attempts at most twice a second (the pause after
a free try), and a refuser holds them for 12 s before it is named: 24 such ends. A stranger that
claims a later attempt at every handshake is never named (AllReduceError.out_of_step), and costs
each step it is in about this many half seconds more before the step is given up."""


class StepGivenUp(RuntimeError):
    """No all-reduce of this step completed here within the retries, or the others take it without
    this node (the evidence, or no room behind NAT; its result is theirs to replay once they have
    it); the vector is unchanged."""


LONE_GRACE_BEATS = 2
"""A node with no other node of its run in view waits this many heartbeat intervals for one, not
the whole straggler deadline (election.elect's `lone_grace`)."""


@dataclass(kw_only=True)
class SyncResult:
    election: Election
    stats: ReduceStats
    attempts: int
    election_s: float = 0.0
    """From this node's ready record to the members of the attempt that completed being decided."""
    ready_time: float = 0.0
    """Wall-clock time this node was ready, before its record went out (drills on one machine
    compare them)."""


class OuterSync:
    def __init__(
        self,
        config: Config,
        dht: SwarmDHT,
        *,
        publisher: HeartbeatPublisher,
        server: DataPlaneServer,
    ):
        self.config = config
        self.dht = dht
        self.publisher = publisher
        self.server = server
        self.view = SwarmView.for_run(dht, config)
        self.roster = Roster(
            config.run.id, timeout=config.swarm.heartbeat_timeout, me=publisher.current.node_key
        )
        """Who of the run joined and who left, and why: logged once per departure (roster.py)."""
        self.view.roster = self.roster
        self.standby = StandbyRelays(dht, config.run.id, authority=config.run.authority_key)
        """The run's standby relays (bootstrap --relay), for steps whose members are all behind NAT."""
        self.faults = Faults.from_env()
        self.poisoner = self.faults.poisoner()
        comm = config.comm
        self.feedback = (
            ErrorFeedback(code=sparse_code(comm), decay=comm.error_feedback)
            if comm.codec == "sparse"
            else None
        )
        """This node's error-feedback accumulator under the sparse codec (codec/sparse.py): one more
        model-sized fp32 vector, per node (a node that starts, or restarts, starts from zeros)."""
        self.last_result: np.ndarray | None = None
        """The last all-reduce result this node took (robust aggregation weighs the shares of the
        segment it owns by their agreement with it): one more model-sized fp32 vector, kept only
        where comm.robust is "reweighted"."""
        self.extras = RecordExtras(server.paths)
        self.crashes = CrashWatch(on_crash=self.roster.crashed)
        self.offences = Offences()
        self._last_members: tuple[int, frozenset[bytes]] = (-1, frozenset())
        """The last step this node completed and its members."""
        self._seen: dict[bytes, Heartbeat] = {}
        self.pusher = RecordPusher(config.comm.failure_timeout)
        """Our ready records, pushed to the peers of the step beside the DHT store (record_push.py)."""
        self.reads = ElectionReads(self.view, config.digest(), server)

    async def _live_heartbeats(self, step: int) -> list[Heartbeat]:
        """Live nodes of this run with this config (a node of another config is never a member),
        without those whose data port refuses connections: crashed, not worth waiting for."""
        me = self.publisher.current.node_key
        beats = await self.reads.current()
        # our own record as we last signed it: the copy in the DHT may not show our newest evidence yet
        beats = sorted(
            [beat for beat in beats if beat.node_key != me] + [self.publisher.current],
            key=lambda beat: beat.node_key,
        )
        self._seen = {beat.node_key: beat for beat in beats}
        ready = [beat.node_key for beat in ready_for(beats, step)]
        self.server.at_step(step, ready, known=[beat.node_key for beat in beats])
        transit = self._in_transit(step)
        self.crashes.watch(
            b
            for b in beats
            if b.node_key != me
            and b.state in IN_STEPS
            and (b.outer_step == step or (b.node_key in transit and b.outer_step == step - 1))
        )
        return self.crashes.alive(beats)

    async def _announce(self, step: int, **changes: Any) -> None:
        """Publish our record with `changes` before we elect: once we decide we dial the others,
        and the read our hello wakes them to must find our record (a store that failed under load
        left some nodes with our record, others without it, and their views apart). So we wait for
        the DHT store, or, with `swarm.push_records`, until every node of the step we know of says
        it holds the record we pushed to it, whichever comes first (a store took a second at 16
        nodes on 2 cores; the push, milliseconds); the store goes on either way."""
        record, me = self.publisher.advance(**changes), self.publisher.current.node_key
        if not self.config.swarm.push_records:
            await self.publisher.store_current(record)
            return
        peers = [
            beat
            for beat in self._seen.values()
            if beat.node_key != me and beat.state in IN_STEPS and beat.outer_step in (step - 1, step)
        ]
        addresses = [
            address
            for beat in peers
            if can_be_dialed(beat.data_reach) and (address := parse_address(beat.data_addr)) is not None
        ]
        pushes = self.pusher.push(record, addresses)
        stored = self.publisher.store_soon(record)
        if len(addresses) < len(peers):  # one we cannot push to (behind NAT) reads the DHT
            await stored
            return
        held = asyncio.ensure_future(self.pusher.held_by_all(pushes))
        try:
            await asyncio.wait((stored, held), return_when=asyncio.FIRST_COMPLETED)
            if not (held.done() and held.result()):
                await stored
        finally:
            held.cancel()

    async def _leave(self, step: int, reason: Exception, named: Collection[bytes]) -> None:
        """After `step` was given up here: say so at once (a record of step + 1, which takes us out
        of the others' elections of `step` and counts us past it for those that gave it up too),
        then wait, at most election_timeout, while the others are still at it (`swarm_still_at`),
        those we `named` in it aside (a stranger that stalled the step need not stay at it).
        Taking step + 1 before them would fork the run; once they are past it, the step is theirs
        for the agent to replay."""
        self.server.at_step(step + 1)  # hellos for `step` refused at once, not kept waiting
        await self.publisher.publish(state=NodeState.TRAINING, outer_step=step + 1, params_hash="")
        me = self.publisher.current.node_key
        started, waiting = time.monotonic(), False
        while time.monotonic() < started + self.config.swarm.election_timeout:
            beats = [beat for beat in await self.reads.records() if beat.node_key not in named]
            if not swarm_still_at(self.crashes.alive(beats), step, me=me, finished=self.view.finished):
                if waiting:
                    waited = time.monotonic() - started
                    log.info("the others are done with outer step %d after %.1f s", step, waited)
                return
            if not waiting:
                log.warning("outer step %d given up (%s): waiting for the others to end it", step, reason)
                waiting = True
            await asyncio.sleep(self.config.swarm.heartbeat_interval / 2)
        log.warning(
            "the others are still at outer step %d %.0f s after this node gave it up: going on",
            step,
            self.config.swarm.election_timeout,
        )

    def _in_transit(self, step: int) -> frozenset[bytes]:
        """The members of our step - 1, on their way to `step` (election.expected_for)."""
        completed, members = self._last_members
        return members if completed == step - 1 else frozenset()

    def close(self) -> None:
        self.crashes.close()
        self.pusher.close()
        self.standby.close()

    async def _straggle(self, step: int) -> None:
        """P2PTRAIN_INJECT_LATE: be `late_seconds` later than the first other node ready for `step`."""
        me = self.publisher.current.node_key
        deadline = time.monotonic() + self.config.swarm.election_timeout
        while time.monotonic() < deadline:
            beats = live(await self.view.read())
            if any(beat.node_key != me for beat in ready_for(beats, step)):
                break
            await asyncio.sleep(self.config.swarm.heartbeat_interval / 4)
        log.warning("fault injection: reporting ready(%d) %.1f s late", step, self.faults.late_seconds)
        await asyncio.sleep(self.faults.late_seconds)

    async def _probe_offenders(self, step: int) -> None:
        """Offenders due to be tried again this step answer a hello first, or stay named (a step
        that included one that still cannot take part would pay a failed attempt for it)."""
        due = [self._seen[key] for key in self.offences.due_at(step) if key in self._seen]
        due = [beat for beat in due if can_be_dialed(beat.data_reach)]  # one behind NAT dials us
        if not due:
            return
        identity = self.server.identity
        answers = await asyncio.gather(*(answers_hello(beat.data_addr, identity) for beat in due))
        failing = [beat.node_key for beat, answered in zip(due, answers, strict=True) if not answered]
        for key in failing:
            log.warning("%s still fails its probe; named again in step %d", short_id(key), step)
        self.offences.still_failing(step, failing)

    async def sync(self, step: int, vector: np.ndarray, tokens: int) -> SyncResult:
        """Average `vector` with the members of `step`; raises StepGivenUp when every attempt failed."""
        if step == self.faults.late_step:
            await self._straggle(step)
        if (factor := self.faults.scale(step)) != 1.0:
            log.warning("fault injection: sending %g × this node's pseudo-gradient of step %d", factor, step)
            np.multiply(vector, np.float32(factor), out=vector)
        if self.poisoner is not None and self.poisoner.corrupt(step, vector):
            log.warning("fault injection: sending a %s pseudo-gradient in step %d", self.poisoner.kind, step)
        await self._probe_offenders(step)
        ignored = self.offences.named_at(step)
        named, tried = set(ignored), set[bytes]()
        self.server.at_step(step)
        ready_at, ready_time = time.monotonic(), time.time()
        try:
            if step == self.faults.give_up_step:
                raise StepGivenUp(f"fault injection: outer step {step} given up")
            extra = self.extras.extra_for(self.publisher.current.extra, step, named=named)
            self.reads.start()  # the election's first read, beside our ready record's store
            self._prepare_share(step, vector)
            await self._announce(step, state=NodeState.READY, outer_step=step, tokens=tokens, extra=extra)
            result = await self._attempts(step, vector, named=named, tried=tried, ready_at=ready_at)
        except StepGivenUp as exc:
            self.offences.step_done(step, (), named=named - ignored)
            await self._leave(step, exc, named)
            raise
        finally:
            self.reads.stop()  # the step is over: a read under way is of no use now
        members = result.election.keys
        if self.poisoner is not None:
            self.poisoner.remember(vector)  # the all-reduce left the shared result in it
        if self.config.comm.aggregation == "reweighted" and self.feedback is None and len(members) > 1:
            if self.last_result is None or self.last_result.shape != vector.shape:
                self.last_result = np.empty_like(vector)
            np.copyto(self.last_result, vector)
        self.roster.took_part(members)
        self.offences.step_done(step, members, named=named - ignored, failed=tried.difference(members))
        self._last_members = (step, frozenset(members))
        result.ready_time = ready_time
        return result

    def _prepare_share(self, step: int, vector: np.ndarray) -> None:
        """Under the sparse codec: fold and encode this step's share on a thread while the election
        runs (1.7 s a core for 150M values), so that the all-reduce finds it ready (ErrorFeedback
        makes it wait for this one rather than compute it twice). A failure is the all-reduce's to
        report: it computes the share again and says why."""
        feedback = self.feedback
        if feedback is None:
            return

        def prepare() -> None:
            with contextlib.suppress(NonFiniteError):
                feedback.share(step, vector)

        threading.Thread(target=prepare, name=f"p2ptrain-share-{step}", daemon=True).start()

    async def _attempts(
        self, step: int, vector: np.ndarray, *, named: set[bytes], tried: set[bytes], ready_at: float
    ) -> SyncResult:
        """Elect and all-reduce until an attempt completes; `named` collects whom we blame, `tried`
        every member of our attempts."""
        swarm = self.config.swarm
        me = self.publisher.current.node_key
        last_error: Exception | None = None
        attempt = 0
        deadline = time.monotonic() + swarm.election_timeout
        refusers = Refusers(2 * self.server.setup_timeout)
        # "dial again" for a whole setup deadline, three times (an honest member says it only until
        # its own attempt unwinds); later attempts are free tries up to a budget instead (AllReduceError)
        busy = Refusers(3 * self.server.setup_timeout)
        free_tries = OUT_OF_STEP_TRIES * swarm.sync_retries
        while attempt < swarm.sync_retries and time.monotonic() < deadline:
            standby = await self.standby.current()
            try:
                election = await elect(
                    lambda: self._live_heartbeats(step),
                    step,
                    straggler_deadline=swarm.straggler_deadline,
                    timeout=swarm.election_timeout,
                    poll_interval=min(0.25, swarm.heartbeat_interval),
                    me=me,
                    finished=self.view.finished,
                    in_transit=self._in_transit(step),
                    max_tokens=self.config.max_tokens(),
                    pause=self.reads.pause,
                    standby=standby,
                    lone_grace=LONE_GRACE_BEATS * swarm.heartbeat_interval,
                )
            except LeftOut as exc:
                raise StepGivenUp(str(exc)) from None
            except (TimeoutError, SwarmAhead) as exc:
                raise StepGivenUp(str(exc)) from None
            if election.left_out:
                self.roster.left_out(step, election.left_out)
            if me in election.left_out:
                raise StepGivenUp(f"left out of outer step {step}: {election.left_out[me]}")
            if me not in election.keys:
                # our ready record has not reached the others' view yet: read again shortly
                await asyncio.sleep(swarm.heartbeat_interval / 2)
                continue
            attempt += 1
            tried.update(election.keys)
            elected_at = time.monotonic()
            next_attempt_at = elected_at + min(MIN_ATTEMPT_SECONDS, swarm.heartbeat_interval / 2)
            self.publisher.publish_soon(state=NodeState.SYNCING)  # for the others' tables: no need to wait
            try:
                reduce = all_reduce(
                    self.server,
                    step=step,
                    members=election.members,
                    buffer=vector,
                    progress=lambda *_: self.faults.die_mid_reduce(step),
                    relays=election.relays,
                    reference=self.last_result,
                    feedback=self.feedback,
                )
                stats = await finish_first(reduce, LEAVING_GRACE_S)  # a node that stops finishes it
            except AllReduceError as exc:
                last_error = exc
                refusers.forgive(exc.connected)
                busy.forgive(exc.connected)
                patience = busy if exc.out_of_step else refusers
                liar = patience.still(exc.refuser)
                if exc.out_of_step and exc.refuser is None:
                    free_tries -= 1
                free = exc.views_differ or exc.refuser is not None or (exc.out_of_step and free_tries >= 0)
                if liar is None and free:
                    # views that still differ, a refusal that may yet pass, a member at another
                    # attempt: not a failed try, and read again only after they had time to converge
                    # (instant refusals burned every retry). The election's deadline still bounds it.
                    log.info(
                        "step %d: %s (%s); electing again",
                        step,
                        "at another attempt" if exc.out_of_step else "refused",
                        exc,
                    )
                    attempt -= 1
                    await asyncio.sleep(min(0.5, swarm.heartbeat_interval / 2))
                    continue
                log.warning("step %d attempt %d failed (%s); electing the survivors", step, attempt, exc)
                if liar is not None:
                    log.warning(
                        "%s has %s for %.0f s: naming it in the evidence of step %d",
                        short_id(liar),
                        "said dial again" if exc.out_of_step else "refused our handshakes",
                        patience.patience,
                        step,
                    )
                    named.add(liar)
                else:
                    # a member that crashed (its port refuses) is left out by everyone's own probe;
                    # one that did not answer (frozen, cut off, a stranger) by the evidence we publish
                    others = [key for key in election.keys if key != me]
                    await self._live_heartbeats(step)  # their newest records
                    await self.crashes.probe_now(self._seen[key] for key in others if key in self._seen)
                    culprit = exc.unresponsive
                    if (
                        culprit in others
                        and culprit in self._seen
                        and self.crashes.alive([self._seen[culprit]])
                    ):
                        log.warning("naming %s in the evidence of step %d", short_id(culprit), step)
                        named.add(culprit)
                extra = self.extras.extra_for(self.publisher.current.extra, step, named=named, report=True)
                await self._announce(step, state=NodeState.READY, extra=extra)
                await asyncio.sleep(max(0.0, next_attempt_at - time.monotonic()))
                continue
            for key, chunks in stats.clipped.items():
                log.warning(
                    "step %d: cut %s's share to under half its norm in %d chunk(s) (comm.clip: its "
                    "pseudo-gradient is far larger than the members' median)",
                    step,
                    short_id(key),
                    chunks,
                )
            for key, chunks in stats.left_out.items():
                if self.feedback is not None:
                    log.warning(
                        "step %d: left out %s's share: malformed (every member did)", step, short_id(key)
                    )
                    continue
                log.warning(
                    "step %d: counted %s's share at under half its weight in %d chunk(s) (comm.robust "
                    "reweighted: its pseudo-gradient points away from the others')",
                    step,
                    short_id(key),
                    chunks,
                )
            return SyncResult(
                election=election, stats=stats, attempts=attempt, election_s=elected_at - ready_at
            )
        raise StepGivenUp(
            f"step {step}: no all-reduce completed in {attempt} attempts within "
            f"{swarm.election_timeout:.0f} s ({last_error})"
        )
