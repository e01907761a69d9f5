"""Standby relays: a bootstrap peer that opts in (`p2ptrain bootstrap --relay`) relays the edges
between nodes behind NAT of its run where no member of a step can relay, and answers their
reachability probes (in a swarm of nodes behind NAT only, nobody else could).

It publishes a signed record in state `relay` under the run's relays key (records.relays_key), so
nothing that reads the nodes sees it. Nodes read those records (`StandbyRelays`, at most every
REFRESH_S) and an election whose members are all behind NAT lists them (election.decide), so the
membership digest covers them and both ends of an edge pick the same one (relay.relay_for).

The relay is a member of no step, so it cannot check a request against a membership of its own as
a member relay does. It checks what it can read (`RunEnds`): both ends are nodes of its run whose
records say they are ready for (or syncing) that step and cannot be dialed. Beyond that it is a
member relay's service: signed requests, pairs of the same (step, attempt, digest, pair, lane),
bounded waits, the cap `--relay-mbps`, and only sealed frames through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.reach import can_be_dialed
from p2ptrain.comm.net.relay import RelayRequest
from p2ptrain.deadline import within
from p2ptrain.identity import short_id
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.election import parse_address
from p2ptrain.swarm.membership import VerifiedRecords, live, read_heartbeats, read_relays
from p2ptrain.swarm.records import Heartbeat, NodeState
from p2ptrain.untrusted import ThrottledLog

log = logging.getLogger(__name__)

REFRESH_S = 10.0
"""How often a node reads the run's relay records (they change when a bootstrap peer starts or stops)."""
MAX_STANDBY = 8
"""Relays a node takes from the records (the first by key): a stranger's records cannot grow the
elections' digests, or the probes a node sends, without bound."""
MIN_READ_GAP_S = 0.5
"""A standby relay reads its run's records at most this often, however many requests come in."""
MAX_CHECKING = (64, 8)
"""Requests that wait for a newer read of the records at once: of nodes the last read found in the
run, and of anyone else (a fresh key is one; a flood of those must not refuse the run's own ends).
More are refused at once (the request has been read, so the pending-handshake budget no longer
holds its connection)."""


class StandbyRelays:
    """The run's standby relays as this node knows them (data address, key), read lazily."""

    def __init__(
        self,
        dht: SwarmDHT,
        run_id: str,
        *,
        authority: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._dht = dht
        self._run_id = run_id
        self._authority = authority
        self._clock = clock
        self._read_at: float | None = None
        self._relays: list[Member] = []
        self._reading: asyncio.Future[None] | None = None
        self._refusals = ThrottledLog(log)

    async def current(self) -> list[Member]:
        """The relays of the last read. The first call reads; after that a read older than
        REFRESH_S is renewed in the background and this call answers at once: a node calls this
        when it is ready for a step, and a DHT read there (0.6 s at 16 nodes on 2 cores) held
        every step it fell in up by as much."""
        now = self._clock()
        if self._read_at is None:
            self._read_at = now
            await self._read()
        elif now - self._read_at >= REFRESH_S and (self._reading is None or self._reading.done()):
            self._read_at = now
            self._reading = asyncio.ensure_future(self._read())
        return self._relays

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()

    async def _read(self) -> None:
        beats = await read_relays(self._dht, self._run_id, authority=self._authority, refusals=self._refusals)
        relays = []
        for beat in live(beats):
            address = parse_address(beat.data_addr)
            if address is not None:
                host, port = address
                relays.append(Member(key=beat.node_key, host=host, port=port))
        relays = relays[:MAX_STANDBY]  # the records come ordered by key
        if relays != self._relays:
            names = ", ".join(f"{short_id(r.key)} at {r.host}:{r.port}" for r in relays) or "none"
            log.info("standby relays of the run: %s", names)
        self._relays = relays


class RunEnds:
    """A standby relay's check of relay requests against its run's records: both ends must be
    nodes of the run, ready for (or syncing) the request's step, that cannot be dialed. The records
    are read at most every MIN_READ_GAP_S (one read at a time), so a flood of requests costs the
    DHT nothing more; an end not found ready is looked up once more in a newer read (its record
    may have been stored just before it asked)."""

    def __init__(self, dht: SwarmDHT, run_id: str, authority: bytes | None = None):
        self._dht = dht
        self._run_id = run_id
        self._authority = authority
        self._records: dict[bytes, Heartbeat] = {}
        self._read_at = -1e9
        self._reading = asyncio.Lock()
        self._refusals = ThrottledLog(log)
        self._verified = VerifiedRecords()
        self._checking = [0, 0]
        """Requests waiting for a newer read now: [the run's nodes', strangers']."""

    async def _read(self, newer_than: float) -> Mapping[bytes, Heartbeat]:
        """The records of a read that started after `newer_than` (monotonic seconds)."""
        async with self._reading:
            if self._read_at > newer_than:
                return self._records  # another request's read, under the lock before us
            await asyncio.sleep(max(0.0, self._read_at + MIN_READ_GAP_S - time.monotonic()))
            started = time.monotonic()
            beats = await read_heartbeats(
                self._dht,
                self._run_id,
                refusals=self._refusals,
                verified=self._verified,
                authority=self._authority,
            )
            self._records = {beat.node_key: beat for beat in live(beats)}
            self._read_at = started
            return self._records

    async def check(self, request: RelayRequest, deadline: float) -> str | None:
        """Why this relay will not relay `request`'s edge, or None (RelayService's `admit`)."""
        reason = _refusal(request, self._records)
        if reason is None:
            return None
        stranger = request.signer not in self._records
        if self._checking[stranger] >= MAX_CHECKING[stranger]:
            return f"{MAX_CHECKING[stranger]} requests like it wait for a read of the records already"
        asked = time.monotonic()
        self._checking[stranger] += 1
        try:
            records = await within(self._read(asked), max(0.0, deadline - asked))
            return _refusal(request, records)
        except asyncio.TimeoutError:
            return reason
        finally:
            self._checking[stranger] -= 1


def _refusal(request: RelayRequest, records: Mapping[bytes, Heartbeat]) -> str | None:
    for end in (request.signer, request.partner):
        beat = records.get(end)
        if beat is None:
            return f"{short_id(end)} is not a live node of this relay's run"
        if beat.state not in (NodeState.READY, NodeState.SYNCING) or beat.outer_step != request.step:
            return f"{short_id(end)} is not ready for step {request.step}"
        if can_be_dialed(beat.data_reach):
            return f"{short_id(end)} can be dialed: its edges need no relay"
    return None
