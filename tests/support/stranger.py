"""A stranger on the swarm's DHT, run as its own process by the tests and benchmarks.

    python -m tests.support.stranger --peer MADDR --run-id RUN --mode MODE [--address-file F]
                             [--closed-by AUTHORITY --ticket none|copied]

It makes a fresh key and, every `--interval` seconds, publishes a validly signed heartbeat saying
"ready for the current outer step" (the highest step the honest nodes are at, with their config
digest copied from their records) with a data-plane address that cannot take part:

- `refused`: 127.0.0.1:9, where nobody listens (the kernel refuses every connect);
- `silent`: a port of its own that accepts connections and never answers (a frozen or malicious
  node looks like this), so only a timeout can tell;
- `differs`: a port of its own that answers every hello at once with "our views differ" (the
  refusal of an honest member that elected other members, which blames no one);
- `refuses`: a port of its own that answers every hello at once with a plain refusal (an honest
  member's answer to a step that is over there);
- `ahead`: a port of its own that completes every handshake under the stranger's key, as an
  elected member's would, then answers that the dialer's attempt is over there, a later one under
  way (an honest member's answer to a peer one attempt behind);
- `busy`: the same, answering "dial again", still in an earlier attempt (an honest member's answer
  to a peer one attempt ahead, until its own attempt ends).

In a closed run (`--closed-by`, the run's authority key in hex) it stores its records under that
run's key, with no ticket or with a ticket copied from an honest node's record (`--ticket copied`),
and prints whether each store was taken. It runs until SIGTERM; with `--address-file` it writes its
key there once it is on the DHT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
import socket
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypedDict

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2ptrain.comm.transport.handshake import (
    MAX_HANDSHAKE_FRAME,
    Admission,
    HandshakeError,
    Refusal,
    Session,
    accept_any,
)
from p2ptrain.comm.transport.wire import WireError, expect, read_frame, write_frame
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.election import IN_STEPS
from p2ptrain.swarm.membership import HeartbeatPublisher, read_heartbeats
from p2ptrain.swarm.records import Heartbeat, NodeState, heartbeat_key


def silent_listener() -> socket.socket:
    """A port that completes TCP handshakes (the kernel's backlog) and never reads or answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


REFUSALS: dict[str, dict[str, object]] = {
    "differs": {"kind": "refuse", "reason": "membership digest differs", "views_differ": True},
    "refuses": {"kind": "refuse", "reason": "not now"},
}
"""What the stranger answers every hello with, by mode: our views differ, or a plain no."""

AHEAD_BY = 8
"""How many attempts ahead of the dialer's the `ahead` stranger claims to be (what a dialer takes
at once at most: server.MAX_ATTEMPT_JUMP)."""


async def refuse_every_hello(
    refusal: Mapping[str, object], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Read a hello, answer `refusal`, close: however often it is dialed."""
    try:
        await read_frame(reader, 5.0, MAX_HANDSHAKE_FRAME)
        await write_frame(writer, refusal, timeout=5.0)
    except WireError:
        pass
    finally:
        writer.close()


def over_here(session: Session) -> Refusal:
    """A later attempt under way here: the dialer's is over (`ahead`)."""
    reason = f"attempt {session.attempt} of step {session.step} is over here"
    return Refusal(reason, attempt=session.attempt + AHEAD_BY)


def still_busy(session: Session) -> Refusal:
    """Still in an earlier attempt here: dial again (`busy`)."""
    return Refusal(f"still in attempt {max(0, session.attempt - 1)} of step {session.step}", retry=True)


PROVEN_REFUSALS = {"ahead": over_here, "busy": still_busy}
"""What the stranger answers once the handshake has proven both keys, by mode."""


async def refuse_once_proven(
    identity: NodeIdentity,
    refusal: Callable[[Session], Refusal],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    """Prove our key to the dialer and take its proof, as a member of its step does, then answer
    `refusal`: however often it is dialed."""
    try:
        hello = expect(await read_frame(reader, 5.0, MAX_HANDSHAKE_FRAME), "hello")
        digest = hello.header.get("digest")
        if not isinstance(digest, bytes):
            return

        async def anyone(step: int, key: bytes) -> Admission:
            return Admission({key}, digest)

        await accept_any(
            reader, writer, identity=identity, resolve=anyone, timeout=5.0, claim=refusal, first=hello
        )
    except (WireError, HandshakeError):
        pass
    finally:
        writer.close()


class Claimed(TypedDict):
    """What the stranger's records copy from the newest honest one, to look ready at its step."""

    state: NodeState
    outer_step: int
    tokens: int
    config_digest: str


async def publish_forever(args: argparse.Namespace, address: str) -> None:
    server = None
    identity = NodeIdentity(Ed25519PrivateKey.generate(), Path(tempfile.gettempdir()))
    if args.mode in REFUSALS or args.mode in PROVEN_REFUSALS:
        answer = (
            functools.partial(refuse_every_hello, REFUSALS[args.mode])
            if args.mode in REFUSALS
            else functools.partial(refuse_once_proven, identity, PROVEN_REFUSALS[args.mode])
        )
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    dht = SwarmDHT.start(DHTSettings(peers=[args.peer], listen=["/ip4/127.0.0.1/tcp/0"]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    publisher = HeartbeatPublisher(dht, identity, run_id=args.run_id, ttl=30.0, data_addr=address)
    authority = bytes.fromhex(args.closed_by) if args.closed_by else None
    if args.address_file:
        Path(args.address_file).write_text(identity.public_key.hex())
    try:
        while not stop.is_set():
            honest = [
                beat
                for beat in await read_heartbeats(dht, args.run_id, authority=authority)
                if beat.node_key != identity.public_key and beat.state in IN_STEPS
            ]
            if honest:
                newest = max(honest, key=lambda beat: beat.outer_step)
                changes: Claimed = {
                    "state": NodeState.READY,
                    "outer_step": newest.outer_step,
                    "tokens": 1000,
                    "config_digest": newest.config_digest,
                }
                if authority is None:
                    await publisher.publish(**changes)
                else:
                    ticket = newest.ticket if args.ticket == "copied" else b""
                    await store_in_closed_run(
                        dht, identity, publisher=publisher, authority=authority, ticket=ticket, **changes
                    )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval)
    finally:
        dht.shutdown()
        if server is not None:
            server.close()


async def store_in_closed_run(
    dht: SwarmDHT,
    identity: NodeIdentity,
    *,
    publisher: HeartbeatPublisher,
    authority: bytes,
    **changes: object,
) -> None:
    """Sign a record with `changes` and store it under the closed run's key, whatever it holds."""
    record: Heartbeat = publisher._next(changes)
    key = heartbeat_key(record.run_id, authority)
    taken = await dht.store(key, record.node_key, value=record.sign(identity), expiration=record.expiration)
    print(f"store {'taken' if taken else 'refused'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True)
    parser.add_argument("--run-id", default="p2ptrain-debug")
    parser.add_argument(
        "--mode", choices=["refused", "silent", *REFUSALS, *PROVEN_REFUSALS], default="refused"
    )
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--address-file", default="")
    parser.add_argument("--closed-by", default="", metavar="AUTHORITY")
    parser.add_argument("--ticket", choices=["none", "copied"], default="none")
    args = parser.parse_args()
    listener = silent_listener() if args.mode == "silent" else None
    address = f"127.0.0.1:{listener.getsockname()[1]}" if listener else "127.0.0.1:9"
    try:
        asyncio.run(publish_forever(args, address))
    finally:
        if listener is not None:
            listener.close()


if __name__ == "__main__":
    main()
