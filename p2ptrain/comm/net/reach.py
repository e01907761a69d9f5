"""Can the others dial this node? A dial-back probe over the data plane.

A node behind a home router or carrier-grade NAT can dial out, but nobody can dial in. It learns
which it is by asking live peers to dial it back:

    asker  → prober  {kind: "reach", port, nonce[, ckpt_port, ckpt_nonce]}   to the prober's data port
    prober → asker   {kind: "reach-proof", nonce}      on a new connection to <the asker's source IP>:port
    prober → asker   GET /reach/<ckpt_nonce hex>       to <the asker's source IP>:ckpt_port (its sidecar)
    prober → asker   {kind: "reach-result", observed, dialed, ckpt_dialed}   on the first connection

The asker believes only what it sees itself: its port can be reached when a proof carrying its own
nonce arrives at its own listener (its sidecar's, when the GET reaches it). A prober's word
("dialed", "observed") decides nothing alone; the address others observe is taken only from
probers whose proof did arrive (that address reached us).

A prober dials only the IP the request came from, so it cannot be sent at a third party; it runs at
most one probe per source network (an IPv4 /24, an IPv6 /64: one host often holds a whole /64)
and MAX_PROBES_IN_FLIGHT in all, each bounded by DIAL_TIMEOUT, and a refused request gets a
one-line reason. Every field is checked as untrusted input.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.comm.transport.wire import Frame, WireError, read_frame, write_frame
from p2ptrain.deadline import within
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


def sidecar_can_be_reached(ckpt_reach: str, data_reach: str) -> bool:
    """What a node's record says of its sidecar: its own probe where it made one, else its data
    port's (a node whose sidecar was never probed is as reachable as its data port, we assume)."""
    ckpt = Reach.parse(ckpt_reach)
    return ckpt is Reach.OPEN if ckpt is not Reach.UNKNOWN else can_be_dialed(data_reach)


@dataclass(frozen=True)
class ProbeResult:
    reach: Reach
    observed: str | None = None
    """The IP peers see this node at, where a proof confirmed it; None otherwise."""
    ckpt: Reach = Reach.UNKNOWN
    """The sidecar's reachability, where it was probed too."""


def network_of(source: str) -> str:
    """The network a probe's source address is counted in: its IPv4 /24 or IPv6 /64."""
    try:
        address = ipaddress.ip_address(source)
    except ValueError:
        return source
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # an IPv4 peer on a dual-stack socket
    return str(ipaddress.ip_network(f"{address}/{24 if address.version == 4 else 64}", strict=False))


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
        if isinstance(nonce, bytes):
            self.proof_arrived(nonce)

    def proof_arrived(self, nonce: bytes) -> None:
        """A proof with `nonce` reached one of our ports (the data port's, or the sidecar's GET)."""
        event = self._proofs.get(nonce)
        if event is not None:
            event.set()

    async def _probe_for(self, frame: Frame, writer: asyncio.StreamWriter, source: str) -> None:
        port, nonce = frame.header.get("port"), frame.header.get("nonce")
        ckpt_port, ckpt_nonce = frame.header.get("ckpt_port"), frame.header.get("ckpt_nonce")
        network, reason = network_of(source), None
        if not (_is_port(port) and (ckpt_port is None or _is_port(ckpt_port))):
            reason = "port must be an integer in 1..65535"
        elif not (_is_nonce(nonce) and (ckpt_port is None or _is_nonce(ckpt_nonce))):
            reason = f"nonce must be {NONCE_BYTES} bytes"
        elif network in self._probing:
            reason = "a probe for this address's network is running already"
        elif len(self._probing) >= MAX_PROBES_IN_FLIGHT:
            reason = f"{MAX_PROBES_IN_FLIGHT} probes are running already"
        if reason is not None:
            self._refusals.warning("reachability request from %s refused: %s", source, reason)
            await write_frame(writer, {"kind": "refuse", "reason": reason}, timeout=DIAL_TIMEOUT)
            return
        assert isinstance(port, int) and isinstance(nonce, bytes)
        self._probing.add(network)
        try:
            dialed = await _send_proof(source, port, nonce)
            ckpt_dialed = False
            if isinstance(ckpt_port, int) and isinstance(ckpt_nonce, bytes):
                ckpt_dialed = await _get_proof(source, ckpt_port, ckpt_nonce)
        finally:
            self._probing.discard(network)
        answer = {"kind": "reach-result", "observed": source, "dialed": dialed, "ckpt_dialed": ckpt_dialed}
        await write_frame(writer, answer, timeout=DIAL_TIMEOUT)

    async def ask(
        self, prober: tuple[str, int], port: int, ckpt_port: int | None = None
    ) -> tuple[bool, str | None, bool, bool]:
        """Ask `prober` to dial us back on `port` (and GET our sidecar on `ckpt_port`): (proof
        arrived, the IP it saw us at, it answered, the sidecar's proof arrived)."""
        nonce, ckpt_nonce = secrets.token_bytes(NONCE_BYTES), secrets.token_bytes(NONCE_BYTES)
        proof = self._proofs[nonce] = asyncio.Event()
        ckpt_proof = self._proofs[ckpt_nonce] = asyncio.Event()
        request: dict = {"kind": "reach", "port": port, "nonce": nonce}
        if ckpt_port is not None:
            request |= {"ckpt_port": ckpt_port, "ckpt_nonce": ckpt_nonce}
        writer = None
        answer: Frame | None = None
        try:
            reader, writer = await within(asyncio.open_connection(*prober), DIAL_TIMEOUT)
            await write_frame(writer, request, timeout=DIAL_TIMEOUT)
            answer = await read_frame(reader, ASK_TIMEOUT + DIAL_TIMEOUT, 0)
            for event, asked in ((proof, True), (ckpt_proof, ckpt_port is not None)):
                if asked and not event.is_set():  # a proof may land just after the answer
                    with contextlib.suppress(asyncio.TimeoutError):
                        await within(event.wait(), 0.5)
        except (OSError, asyncio.TimeoutError, WireError):
            pass
        finally:
            self._proofs.pop(nonce, None)
            self._proofs.pop(ckpt_nonce, None)
            if writer is not None:
                writer.close()
        answered = answer is not None and answer.kind == "reach-result"
        observed = answer.header.get("observed") if answered and answer is not None else None
        if not isinstance(observed, str) or len(observed) > 64:
            observed = None
        return proof.is_set(), observed, answered, ckpt_proof.is_set()

    async def probe(
        self, probers: Sequence[tuple[str, int]], port: int, ckpt_port: int | None = None
    ) -> ProbeResult:
        """Ask every prober at once. OPEN when any proof arrived, CLOSED when a prober answered and
        none did, UNKNOWN when nobody answered (no peers yet, or all of them unreachable too). The
        sidecar's the same way, where `ckpt_port` is given."""
        if not probers:
            return ProbeResult(Reach.UNKNOWN)
        answers = await asyncio.gather(*(self.ask(prober, port, ckpt_port) for prober in probers))
        answered = any(answer[2] for answer in answers)

        def verdict(proved: bool) -> Reach:
            return Reach.OPEN if proved else Reach.CLOSED if answered else Reach.UNKNOWN

        ckpt = verdict(any(answer[3] for answer in answers)) if ckpt_port is not None else Reach.UNKNOWN
        confirmed = Counter(seen for proved, seen, _, _ in answers if proved and seen and _is_ip(seen))
        if any(answer[0] for answer in answers):
            # where confirming probers disagree, a strict majority; a tie changes nothing (a liar
            # beside one honest prober must not pick our address)
            ranked = confirmed.most_common(2)
            best = ranked[0][0] if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]) else None
            return ProbeResult(Reach.OPEN, best, ckpt)
        return ProbeResult(verdict(False), None, ckpt)


def _is_ip(text: str) -> bool:
    """A literal IPv4 or IPv6 address (what a prober says it saw us at), not a name or junk."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _is_nonce(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == NONCE_BYTES


async def _get_proof(host: str, port: int, nonce: bytes) -> bool:
    """GET the asker's sidecar at host:port with the nonce; True when an HTTP answer came back."""
    writer = None
    try:
        reader, writer = await within(asyncio.open_connection(host, port), DIAL_TIMEOUT)
        writer.write(f"GET /reach/{nonce.hex()} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        status = await within(reader.readline(), DIAL_TIMEOUT)
        return status.startswith(b"HTTP/1.")
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()


async def _send_proof(host: str, port: int, nonce: bytes) -> bool:
    """Dial host:port and deliver the proof; True when the frame went out."""
    writer = None
    try:
        _, writer = await within(asyncio.open_connection(host, port), DIAL_TIMEOUT)
        await write_frame(writer, {"kind": "reach-proof", "nonce": nonce}, timeout=DIAL_TIMEOUT)
        return True
    except (OSError, asyncio.TimeoutError, WireError):
        return False
    finally:
        if writer is not None:
            writer.close()
