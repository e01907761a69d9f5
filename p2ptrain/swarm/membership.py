"""Heartbeats: publishing this node's signed record, and reading everyone's.

Clocks differ between hosts, and a DHT record's expiration is its sender's wall clock: a sender
whose clock runs 5 s behind would see its 6 s records expire after 1 s everywhere else. So records
live in the DHT for `heartbeat_timeout + max_clock_skew`, and liveness is judged by each reader on
its own monotonic clock (`SwarmView`): a node is alive while its sequence number has advanced
within the last `heartbeat_timeout` seconds and its last record is not a deathrattle (state
`dead`). Sequence numbers start at the wall clock in milliseconds and grow by one per record, so
they keep growing across restarts of the same node.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import replace
from typing import Any

from hivemind.utils import get_dht_time

import p2ptrain.swarm.quiet  # noqa: F401  (hivemind keeps quiet)
from p2ptrain.comm.net.reach import can_be_dialed
from p2ptrain.config import Config
from p2ptrain.deadline import pause
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.admission import parse_ticket_text
from p2ptrain.swarm.crash_watch import port_refuses
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.records import (
    FINISHED_FIELD,
    Heartbeat,
    NodeState,
    RecordError,
    check_admitted,
    decode_heartbeat,
    heartbeat_key,
    relays_key,
)
from p2ptrain.swarm.roster import Roster
from p2ptrain.untrusted import ThrottledLog

log = logging.getLogger(__name__)

DEATHRATTLE_TIMEOUT = 2.0
MAX_CACHED_AGE = 1.0
"""A `cached` read older than this goes to the DHT after all: judged on an old read, the nodes whose
records did not change since would look silent."""


class HeartbeatPublisher:
    """Signs and stores this node's heartbeat; fields not given keep their last value.

    `ttl` is the record's life in the DHT (`SwarmConfig.record_lifetime`), not the liveness timeout.
    """

    def __init__(self, dht: SwarmDHT, identity: NodeIdentity, *, run_id: str, ttl: float, **fields: Any):
        self._dht = dht
        self._identity = identity
        self._ttl = ttl
        self._seq = int(time.time() * 1000)
        self._pending: set[asyncio.Task[bool]] = set()
        self.current = Heartbeat(
            run_id=run_id,
            node_key=identity.public_key,
            seq=self._seq,
            timestamp=time.time(),
            expiration=0.0,
            state=NodeState.JOINING,
            peer_id=dht.peer_id,
            **fields,
        )

    @classmethod
    def for_run(
        cls, dht: SwarmDHT, identity: NodeIdentity, config: Config, **fields: Any
    ) -> HeartbeatPublisher:
        """The publisher of a node of `config`'s run: its record life, config digest and ticket."""
        ticket = parse_ticket_text(config.node.ticket).to_bytes() if config.run.authority else b""
        return cls(
            dht,
            identity,
            run_id=config.run.id,
            ttl=config.swarm.record_lifetime,
            config_digest=config.digest(),
            ticket=ticket,
            **fields,
        )

    async def publish(self, timeout: float | None = None, **changes: Any) -> bool:
        """Store a fresh record with `changes` applied; False when the DHT did not take it."""
        return await self._store(self._next(changes), timeout)

    def advance(self, **changes: Any) -> bytes:
        """Make a fresh record with `changes` the current one, not stored yet (`store_current`):
        its signed bytes, for a push to the peers (record_push.py) while the store is under way."""
        return self._next(changes).sign(self._identity)

    async def store_current(self, signed: bytes) -> bool:
        """Store the current record as `advance` signed it (signed once, pushed and stored)."""
        return await self._store(self.current, None, signed)

    def publish_soon(self, **changes: Any) -> None:
        """`publish` without waiting for the DHT (a store takes a round trip to the replicas, a
        third of a second on a loaded machine): `current` has the changes at once, and a store
        that lands after a newer one is refused by the replicas, which keep the highest seq."""
        self._track(self._store_or_warn(self._next(changes)))

    def store_soon(self, signed: bytes) -> asyncio.Task[bool]:
        """`store_current` as a task of its own, for a caller that may go on without it."""
        return self._track(self._store_or_warn(self.current, signed))

    def _track(self, store: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        task = asyncio.create_task(store)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def _next(self, changes: dict[str, Any]) -> Heartbeat:
        self._seq += 1
        # Never below the last one: the DHT keeps the record that expires last, so after the wall
        # clock stepped back (NTP) a lower expiration would leave the older record in place.
        expiration = max(get_dht_time() + self._ttl, self.current.expiration + 0.001)
        self.current = replace(
            self.current, **changes, seq=self._seq, timestamp=time.time(), expiration=expiration
        )
        return self.current

    async def _store(self, record: Heartbeat, timeout: float | None, signed: bytes | None = None) -> bool:
        return await self._dht.store(
            record.key,
            record.node_key,
            value=signed if signed is not None else record.sign(self._identity),
            expiration=record.expiration,
            timeout=timeout,
        )

    async def _store_or_warn(self, record: Heartbeat, signed: bytes | None = None) -> bool:
        if await self._store(record, None, signed):
            return True
        if record.seq == self.current.seq:  # a newer record since: the replicas refuse this one
            log.warning(
                "heartbeat (%s, step %d) not stored by any DHT peer", record.state.value, record.outer_step
            )
        return False

    async def deathrattle(self, timeout: float = DEATHRATTLE_TIMEOUT) -> bool:
        """Tell the swarm at once that this node is gone, instead of letting it wait for the timeout.

        Bounded tighter than other stores: a node that is stopping must be gone within seconds.
        A node that finished the run says so in it (`FINISHED_FIELD`), with the run's last step.
        """
        extra = self.current.extra
        if self.current.state is NodeState.FINISHED:
            extra = {**extra, FINISHED_FIELD: True}
        deadline = time.monotonic() + timeout
        # A store that no replica took is tried once more, with a fresh record, within the same
        # bound (a finished node's only try came back unconfirmed once in CI, cause not found).
        for _ in range(2):
            if await self.publish(timeout=deadline - time.monotonic(), state=NodeState.DEAD, extra=extra):
                return True
            if deadline - time.monotonic() < 0.2:
                break
        return False


async def keep_alive(publisher: HeartbeatPublisher, interval: float, stop: asyncio.Event) -> None:
    """Re-publish the current record every `interval` seconds until `stop` is set."""
    while not stop.is_set():
        await pause(stop, interval)
        if not stop.is_set() and not await publisher.publish():
            admission = publisher.current.admission
            if admission is not None and admission.expires <= get_dht_time():
                log.error(
                    "this node's admission ticket has expired: the run refuses its records; "
                    "restart it with a new ticket ('p2ptrain admit')"
                )
            else:
                log.warning("heartbeat not stored by any DHT peer; retrying")


class VerifiedRecords:
    """The records one read verified, by their exact bytes, for the next read: a record unchanged
    since (a node reads about four times per heartbeat while it waits) is not verified again.
    Bytes that verified once verify always; only the last read's records are kept."""

    def __init__(self) -> None:
        self._last: dict[bytes, Heartbeat] = {}
        self._now: dict[bytes, Heartbeat] = {}

    def decode(self, value: bytes) -> Heartbeat:
        """decode_heartbeat, or what it gave for these very bytes in the last read."""
        beat = self._last.get(value) if isinstance(value, bytes) else None
        if beat is None:
            beat = decode_heartbeat(value)
        self._now[value] = beat
        return beat

    def read_done(self) -> None:
        self._last, self._now = self._now, {}


async def read_heartbeats(
    dht: SwarmDHT,
    run_id: str,
    *,
    refusals: ThrottledLog | None = None,
    verified: VerifiedRecords | None = None,
    authority: bytes | None = None,
) -> list[Heartbeat]:
    """Every valid, unexpired heartbeat of `run_id` (closed by `authority`, if given), ordered by
    node key.

    The DHT validator already refused bad records where they were stored; the reader verifies
    again because a record may come from a node that runs no validator. What it ignores goes to
    `refusals` (a node that reads several times a second passes a throttled log, and its
    `verified` records of the last read).
    """
    refusals = refusals or ThrottledLog(log, interval=0.0)
    found = await dht.get(heartbeat_key(run_id, authority))
    if not found:
        return []
    beats = decode_all(
        found.items(), run_id, refusals=refusals, verified=verified or VerifiedRecords(), authority=authority
    )
    return [beat for beat in beats if beat.state is not NodeState.RELAY]  # those live under relays_key


async def read_relays(
    dht: SwarmDHT, run_id: str, *, authority: bytes | None = None, refusals: ThrottledLog | None = None
) -> list[Heartbeat]:
    """The run's standby relays (`p2ptrain bootstrap --relay`): records in state `relay` under the
    run's relays key, valid and unexpired (a relay that stops lets its record expire)."""
    found = await dht.get(relays_key(run_id, authority))
    if not found:
        return []
    refusals = refusals or ThrottledLog(log, interval=0.0)
    beats = decode_all(
        found.items(), run_id, refusals=refusals, verified=VerifiedRecords(), authority=authority
    )
    return [beat for beat in beats if beat.state is NodeState.RELAY]


def decode_all(
    items: Iterable[tuple[bytes, Any]],
    run_id: str,
    *,
    refusals: ThrottledLog,
    verified: VerifiedRecords,
    authority: bytes | None = None,
) -> list[Heartbeat]:
    """The valid heartbeats of `run_id` among (subkey, DHT value) pairs, ordered by node key;
    in a run closed by `authority`, only those with a valid ticket from it."""
    heartbeats = []
    now = get_dht_time()
    for subkey, item in items:
        try:
            heartbeat = verified.decode(item.value)
            check_admitted(heartbeat, authority, now)
        except (RecordError, TypeError) as exc:
            refusals.warning("ignoring heartbeat under subkey %r: %s", subkey[:8], exc)
            continue
        if heartbeat.node_key != subkey or heartbeat.run_id != run_id:
            refusals.warning("ignoring heartbeat filed under another node's subkey")
            continue
        heartbeats.append(heartbeat)
    verified.read_done()
    return sorted(heartbeats, key=lambda beat: beat.node_key)


class Offered(enum.Enum):
    """What a view made of a record offered to it: TAKEN, newer than the node's record it had (its
    view's now); HELD, it had this record or a newer one of the node; REFUSED, invalid, of another
    run, or of a node this view does not know."""

    TAKEN = "taken"
    HELD = "held"
    REFUSED = "refused"


class SwarmView:
    """The heartbeats of one run as this node sees them, silent nodes left out.

    A record counts while its sender's sequence number has advanced within `timeout` seconds of
    this node's monotonic clock; no wall clock of another host takes part. A record seen for the
    first time counts as fresh, so a node that has just started may count a silent one for up to
    `timeout`. An older replica of a record (lower seq) never replaces the newest one seen.

    `finished` remembers, for good, every node seen to have finished the run and at which outer
    step: once it has left, its record is gone, but a node behind must still know that the swarm
    went past its step (and never take that step alone).
    """

    def __init__(
        self,
        dht: SwarmDHT,
        run_id: str,
        *,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        authority: bytes | None = None,
    ):
        self._dht = dht
        self.run_id = run_id
        self.authority = authority
        self._timeout = timeout
        self._clock = clock
        self._newest: dict[bytes, tuple[Heartbeat, float]] = {}
        """node key → (newest record seen, when its seq was first seen)."""
        self.finished: dict[bytes, int] = {}
        """node key → the outer step at which it finished the run (never forgotten)."""
        self._refusals = ThrottledLog(log)
        self._verified = VerifiedRecords()
        self._last_read: list[Heartbeat] = []
        self._read_at = -math.inf
        self.roster: Roster | None = None
        """Given one, every judged read goes to it too: who joined and who left, and why (roster.py)."""

    @classmethod
    def for_run(cls, dht: SwarmDHT, config: Config) -> SwarmView:
        return cls(
            dht, config.run.id, timeout=config.swarm.heartbeat_timeout, authority=config.run.authority_key
        )

    async def read(self, cached: bool = False) -> list[Heartbeat]:
        """Every heartbeat in the DHT whose sender is not silent, ordered by node key. `cached`:
        the last read's records again, without a DHT round trip (with what was `offer`ed since)."""
        if not cached or not self.fresh():
            self._last_read = await read_heartbeats(
                self._dht,
                self.run_id,
                refusals=self._refusals,
                verified=self._verified,
                authority=self.authority,
            )
            self._read_at = self._clock()
        return self.judge(self._last_read)

    def fresh(self) -> bool:
        """Whether the last DHT read is recent enough for a `cached` read (MAX_CACHED_AGE)."""
        return self._clock() - self._read_at <= MAX_CACHED_AGE

    def offer(self, beat: Heartbeat) -> Offered:
        """A verified record that came another way than the DHT (pushed by its sender): taken only
        for a node this view knows and only when newer than its record here. So it cannot add a
        node to the swarm, nor bring back an older record."""
        known = self._newest.get(beat.node_key)
        if known is None or beat.run_id != self.run_id:
            return Offered.REFUSED
        if known[0].seq >= beat.seq:
            return Offered.HELD
        self._newest[beat.node_key] = (beat, self._clock())
        return Offered.TAKEN

    def offer_signed(self, value: bytes, source: str) -> Offered:
        """`offer` for a record's signed bytes as they came (record_push.py): verified like a
        record read from the DHT (signature, ticket in a closed run); refusals logged, throttled."""
        try:
            beat = decode_heartbeat(value)
            check_admitted(beat, self.authority, get_dht_time())
        except (RecordError, TypeError) as exc:
            self._refusals.warning("record pushed from %s ignored: %s", source, exc)
            return Offered.REFUSED
        return self.offer(beat)

    def judge(self, heartbeats: list[Heartbeat]) -> list[Heartbeat]:
        """The non-silent subset of one DHT read (its records replaced by newer ones seen before)."""
        now = self._clock()
        newest: dict[bytes, tuple[Heartbeat, float]] = {}
        for beat in heartbeats:
            known = self._newest.get(beat.node_key)
            newest[beat.node_key] = known if known and known[0].seq >= beat.seq else (beat, now)
        self._newest = newest  # nodes gone from the DHT are forgotten
        if self.roster is not None:
            self.roster.update(beat for beat, _ in newest.values())
        for beat, _ in newest.values():
            if finished_run(beat):
                self.finished[beat.node_key] = max(self.finished.get(beat.node_key, 0), beat.outer_step)
        return [beat for beat, since in newest.values() if now - since <= self._timeout]


def finished_run(beat: Heartbeat) -> bool:
    """The node finished the run: it says so, or said so in its deathrattle."""
    return beat.state is NodeState.FINISHED or (
        beat.state is NodeState.DEAD and beat.extra.get(FINISHED_FIELD) is True
    )


def live(heartbeats: list[Heartbeat]) -> list[Heartbeat]:
    """Nodes that have not sent a deathrattle (a `SwarmView` has already left silent ones out)."""
    return [beat for beat in heartbeats if beat.state is not NodeState.DEAD]


EMPTY_READ_RETRIES = 2
"""`status` reads again, at once, when a read found no record at all: a fresh DHT client's first
get may time out on a busy peer, and would show a live run as empty. No pause before it: a get
that timed out has waited its dht_timeout already, and one that found nothing in a run without
nodes would only wait for nothing (it made `status` of an empty run take 5 s instead of 1)."""
GONE, SILENT = "gone", "silent"
"""What `status` shows instead of a record's state: its data port refuses connections (the process
is gone), or its heartbeat did not advance while `status` watched (stopped, frozen, cut off)."""


async def observe(
    dht: SwarmDHT, run_id: str, *, watch: float, authority: bytes | None = None
) -> tuple[list[Heartbeat], dict[bytes, str]]:
    """The run's records, and a verdict for the nodes that are not what their record says.

    One read of the DHT cannot tell a live node from one that died a second ago (its record stays
    until it expires), so: probe every data port (a refusal means the process is gone), and with
    `watch` > 0 read again after that many seconds (records are refreshed every heartbeat interval)."""
    first = await read_heartbeats(dht, run_id, authority=authority)
    for _ in range(EMPTY_READ_RETRIES):  # a DHT get that timed out reads as empty: not "no nodes"
        if first:
            break
        first = await read_heartbeats(dht, run_id, authority=authority)
    candidates = [
        beat for beat in first if beat.state is not NodeState.DEAD and can_be_dialed(beat.data_reach)
    ]
    probes = asyncio.gather(*(port_refuses(beat.data_addr) for beat in candidates))
    if watch > 0 and candidates:
        await asyncio.sleep(watch)
    refused = await probes
    verdicts = {beat.node_key: GONE for beat, gone in zip(candidates, refused, strict=True) if gone}
    if watch <= 0 or not candidates:  # nobody whose heartbeat a second read could find stopped
        return first, verdicts
    second = {beat.node_key: beat for beat in await read_heartbeats(dht, run_id, authority=authority)}
    for beat in candidates:
        again = second.get(beat.node_key)
        if beat.node_key not in verdicts and (again is None or again.seq <= beat.seq):
            verdicts[beat.node_key] = SILENT
    newest = {beat.node_key: beat for beat in first} | second
    return sorted(newest.values(), key=lambda beat: beat.node_key), verdicts
