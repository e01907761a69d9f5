"""Can the others dial this node? A dial-back probe over the data plane.

A node behind a home router or carrier-grade NAT can dial out, but nobody can dial in. It learns
which it is by asking live peers to dial it back:

    asker  → prober  {kind: "reach", port, nonce}      on a fresh connection to the prober's data port
    prober → asker   {kind: "reach-proof", nonce}      on a new connection to <the asker's source IP>:port
    prober → asker   {kind: "reach-result", observed, dialed}   on the first connection

The asker believes only what it sees itself: its port can be reached when a proof carrying its own
nonce arrives at its own listener. A prober's word ("dialed", "observed") decides nothing alone; the
address others observe is taken only from probers whose proof did arrive (that address reached us).

A prober dials only the IP the request came from, so it cannot be sent at a third party; it runs at
most one probe per source IP and MAX_PROBES_IN_FLIGHT in all, each bounded by DIAL_TIMEOUT, and a
refused request gets a one-line reason. Every field is checked as untrusted input.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.comm.wire import Frame, WireError, read_frame, write_frame
from p2ptrain.untrusted import ThrottledLog

log = logging.getLogger(__name__)

NONCE_BYTES = 16
DIAL_TIMEOUT = 3.0
"""How long a prober tries to reach the asker (connect and send the proof)."""
ASK_TIMEOUT = 2 * DIAL_TIMEOUT + 1.0
"""How long an asker waits for a prober's answer and for the proof."""
MAX_PROBES_IN_FLIGHT = 8
REACH_KINDS = frozenset({"reach", "reach-proof"})
"""First frames of a data-plane connection that are reachability traffic, not a handshake."""


class Reach(str, enum.Enum):
    """What a node knows of its data port's reachability (a field of its signed record)."""

    UNKNOWN = ""  # not probed yet, or nobody could probe it: treated as reachable, as before
    OPEN = "open"  # a peer's dial-back reached it
    CLOSED = "closed"  # peers tried and could not: it dials out instead (connection reversal)

    @classmethod
    def parse(cls, value: str) -> Reach:
        """A record's field; what a newer or broken node wrote that we do not know counts as unknown."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


def can_be_dialed(reach: str) -> bool:
    return Reach.parse(reach) is not Reach.CLOSED


@dataclass(frozen=True)
class ProbeResult:
    reach: Reach
    observed: str | None = None
    """The IP peers see this node at, where a proof confirmed it; None otherwise."""


class ReachService:
    """Both ends of the probe on one node: answers askers (as prober) and collects proofs for our
    own questions (as asker). The data-plane server hands it every connection whose first frame is
    one of REACH_KINDS."""

    def __init__(self) -> None:
        self._proofs: dict[bytes, asyncio.Event] = {}
        self._probing: set[str] = set()
        self._refusals = ThrottledLog(log)

    @property
    def in_flight(self) -> int:
        """Dial-backs this node is running for askers now."""
        return len(self._probing)

    async def handle(
        self, first: Frame, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str
    ) -> None:
        try:
            if first.kind == "reach-proof":
                self._proved(first)
            else:
                await self._probe_for(first, writer, source)
        except WireError as exc:
            self._refusals.warning("reachability request from %s dropped: %s", source, exc)
        finally:
            writer.close()

    def _proved(self, frame: Frame) -> None:
        nonce = frame.header.get("nonce")
        event = self._proofs.get(nonce) if isinstance(nonce, bytes) else None
        if event is not None:
            event.set()

    async def _probe_for(self, frame: Frame, writer: asyncio.StreamWriter, source: str) -> None:
        port, nonce = frame.header.get("port"), frame.header.get("nonce")
        reason = None
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
            reason = "port must be an integer in 1..65535"
        elif not (isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES):
            reason = f"nonce must be {NONCE_BYTES} bytes"
        elif source in self._probing:
            reason = "a probe for this address is running already"
        elif len(self._probing) >= MAX_PROBES_IN_FLIGHT:
            reason = f"{MAX_PROBES_IN_FLIGHT} probes are running already"
        if reason is not None:
            self._refusals.warning("reachability request from %s refused: %s", source, reason)
            await write_frame(writer, {"kind": "refuse", "reason": reason}, timeout=DIAL_TIMEOUT)
            return
        assert isinstance(port, int) and isinstance(nonce, bytes)
        self._probing.add(source)
        try:
            dialed = await _send_proof(source, port, nonce)
        finally:
            self._probing.discard(source)
        answer = {"kind": "reach-result", "observed": source, "dialed": dialed}
        await write_frame(writer, answer, timeout=DIAL_TIMEOUT)

    async def ask(self, prober: tuple[str, int], port: int) -> tuple[bool, str | None, bool]:
        """Ask `prober` to dial us back on `port`: (proof arrived, the IP it saw us at, it answered)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        proof = self._proofs[nonce] = asyncio.Event()
        writer = None
        answer: Frame | None = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*prober), DIAL_TIMEOUT)
            await write_frame(writer, {"kind": "reach", "port": port, "nonce": nonce}, timeout=DIAL_TIMEOUT)
            answer = await read_frame(reader, ASK_TIMEOUT, 0)
            if not proof.is_set():  # the proof's connection may land just after the answer
                await asyncio.wait_for(proof.wait(), 0.5)
        except (OSError, asyncio.TimeoutError, WireError):
            pass
        finally:
            self._proofs.pop(nonce, None)
            if writer is not None:
                writer.close()
        answered = answer is not None and answer.kind == "reach-result"
        observed = answer.header.get("observed") if answered and answer is not None else None
        if not isinstance(observed, str) or len(observed) > 64:
            observed = None
        return proof.is_set(), observed, answered

    async def probe(self, probers: Sequence[tuple[str, int]], port: int) -> ProbeResult:
        """Ask every prober at once. OPEN when any proof arrived, CLOSED when a prober answered and
        none did, UNKNOWN when nobody answered (no peers yet, or all of them unreachable too)."""
        if not probers:
            return ProbeResult(Reach.UNKNOWN)
        answers = await asyncio.gather(*(self.ask(prober, port) for prober in probers))
        confirmed = Counter(observed for proved, observed, _ in answers if proved and observed)
        if any(proved for proved, _, _ in answers):
            # where confirming probers disagree, the majority; ties to the smallest address
            best = min(confirmed.items(), key=lambda item: (-item[1], item[0]))[0] if confirmed else None
            return ProbeResult(Reach.OPEN, best)
        if any(answered for _, _, answered in answers):
            return ProbeResult(Reach.CLOSED)
        return ProbeResult(Reach.UNKNOWN)


async def _send_proof(host: str, port: int, nonce: bytes) -> bool:
    """Dial host:port and deliver the proof; True when the frame went out."""
    writer = None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
        await write_frame(writer, {"kind": "reach-proof", "nonce": nonce}, timeout=DIAL_TIMEOUT)
        return True
    except (OSError, asyncio.TimeoutError, WireError):
        return False
    finally:
        if writer is not None:
            writer.close()
