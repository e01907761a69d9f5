"""A flooding client against one node's data port, run as its own process by the tests.

    python -m tests.support.flooder --target HOST:PORT --mode idle|hellos|reaches|forged|relays|records
                            [--count N] [--source 127.0.0.2] [--claim KEY] [--run-id RUN]
                            [--from-step N] [--learn-source 127.0.0.3]

- `idle`: keeps `count` TCP connections open that never send a byte, opening a new one whenever
  the node closes one (a stranger's cheapest way to hold a node's handshake slots);
- `hellos`: keeps sending well-formed hellos, each from a fresh key, for outer step 10⁹, `count`
  connections at a time;
- `reaches`: keeps asking for reachability probes (dial-backs to random ports of its address),
  `count` connections at a time;
- `forged`: keeps sending hellos for the node's next outer step that claim `--claim` (a member's
  key, which it cannot sign for), `count` connections at a time, each held open as long as the node
  lets it: hellos from a member that dials early wait for the node to reach the step. It learns the
  node's step from the node's own refusal of a hello for step 10⁹.
- `relays`: keeps asking the node (whose key `--claim` gives) to relay an edge of its current or
  next outer step, each request validly signed by a fresh key, for a membership nobody has: a
  stranger trying to hold the slots where members behind NAT wait for their relay.
- `records`: keeps pushing records (record_push.py), `count` connections at a time, in turn:
  junk bytes; a validly signed ready record of run `--run-id` from a fresh key (a node nobody
  knows); and a record in the name of `--claim` (a member) that says it is dead, with a sequence
  number far ahead of the member's own and a fresh key's signature — were it taken, the member
  would drop out of the steps.

With `--from-step N` the flood starts once the node says it is at outer step N (it learns the step as
`forged` does); the process can so be started, and pay for its imports, before the node is there.
Connections come from `--source` (another loopback address than the honest nodes' 127.0.0.1, as a
stranger's would come from another host); the asks for the node's step from `--learn-source` (the
system's choice if not given), so that they do not compete with the flood for the node's slots. It
runs until SIGTERM and prints one line per second: the connections it holds and how many the node
closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import signal
import sys
import time
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2ptrain.comm.net.record_push import RECORD_KIND
from p2ptrain.comm.net.relay import RelayRequest
from p2ptrain.comm.transport.wire import encode_frame
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.records import Heartbeat, NodeState

FAR_STEP = 10**9


def hello(step: int = FAR_STEP, key: bytes | None = None) -> bytes:
    header = {
        "kind": "hello",
        "node_key": key or secrets.token_bytes(32),
        "step": step,
        "attempt": 0,
        "digest": secrets.token_bytes(32),
        "nonce": secrets.token_bytes(32),
        "lane": 0,
        "ephemeral": secrets.token_bytes(32),
    }
    return b"".join(bytes(part) for part in encode_frame(header))


def relay_request(step: int, relay: bytes) -> bytes:
    stranger = NodeIdentity(Ed25519PrivateKey.generate(), Path("stranger"))
    request = RelayRequest(
        step=step,
        attempt=0,
        digest=secrets.token_bytes(32),
        sender=stranger.public_key,
        receiver=secrets.token_bytes(32),
        lane=0,
        role="send",
        relay=relay,
    )
    return b"".join(bytes(part) for part in encode_frame(request.header(stranger)))


def pushed_record(turn: int, run_id: str, *, claim: bytes, step: int) -> bytes:
    stranger = NodeIdentity(Ed25519PrivateKey.generate(), Path("stranger"))
    if turn % 3 == 0:
        record = secrets.token_bytes(300)
    else:
        beat = Heartbeat(
            run_id=run_id,
            node_key=stranger.public_key,
            seq=2**62,
            timestamp=time.time(),
            expiration=time.time() + 60,
            state=NodeState.READY,
            outer_step=step,
            data_addr="127.0.0.2:9",
            tokens=10**6,
        )
        record = beat.sign(stranger)
        if turn % 3 == 2:  # the member's name, the stranger's signature
            forged = msgpack.unpackb(record, raw=False)
            body = msgpack.unpackb(forged[1], raw=False)
            body.update(node_key=claim, state=NodeState.DEAD.value)
            forged[1] = msgpack.packb(body, use_bin_type=True)
            record = msgpack.packb(forged, use_bin_type=True)
    frames = [*encode_frame({"kind": RECORD_KIND}), *encode_frame({"kind": "body"}, record)]
    return b"".join(bytes(part) for part in frames)


def reach_request() -> bytes:
    header = {"kind": "reach", "port": secrets.randbelow(60000) + 1024, "nonce": secrets.token_bytes(16)}
    return b"".join(bytes(part) for part in encode_frame(header))


class Flood:
    def __init__(self, args: argparse.Namespace):
        self.host, _, port = args.target.rpartition(":")
        self.port = int(port)
        self.args = args
        self.held = 0
        self.closed = 0
        self.step = 0
        self.turn = 0
        self.step_reached = asyncio.Event()
        """Set once the node told a step ≥ `--from-step` (it tells once it has one): the flood waits
        for it. Asks made once the flood is on compete with its connections for the node's
        per-address handshake slots, and may all lose."""

    async def learn_step(self) -> None:
        """The node's outer step, from its refusal of a hello far ahead ("… of this node's step N").

        Under the flood the node's listen backlog is full and SYNs are dropped; the kernel would
        retry ours 1, 3, 7 … s later (seen on a slow machine: no step learned in a whole run), so a
        connect that is not through within a second starts again with a fresh one."""
        while True:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                source = (self.args.learn_source, 0) if self.args.learn_source else None
                connecting = asyncio.open_connection(self.host, self.port, local_addr=source)
                reader, writer = await asyncio.wait_for(connecting, 1.0)
                writer.write(hello())
                answer = await asyncio.wait_for(reader.read(), 5)  # the refusal, then the close
                writer.close()
                found = re.search(rb"this node's step (\d+)", answer)
                if found:
                    self.step = int(found.group(1))
                    if self.step >= self.args.from_step:
                        self.step_reached.set()
            await asyncio.sleep(0.2)

    async def one(self) -> None:
        """One connection slot, reopened as soon as the node closes it."""
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, local_addr=(self.args.source, 0)
                )
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.held += 1
            if self.args.mode == "hellos":
                writer.write(hello())
            elif self.args.mode == "forged":
                writer.write(hello(self.step + 1, bytes.fromhex(self.args.claim)))
            elif self.args.mode == "reaches":
                writer.write(reach_request())
            elif self.args.mode == "relays":
                writer.write(relay_request(self.step + secrets.randbelow(2), bytes.fromhex(self.args.claim)))
            elif self.args.mode == "records":
                self.turn += 1
                claim = bytes.fromhex(self.args.claim)
                writer.write(pushed_record(self.turn, self.args.run_id, claim=claim, step=self.step + 1))
            with contextlib.suppress(OSError):
                await reader.read()  # until the node closes it
            self.held -= 1
            self.closed += 1
            writer.close()
            await asyncio.sleep(0.01)

    async def run(self) -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        tasks: list[asyncio.Task[None]] = []
        if self.args.mode in ("forged", "relays", "records") or self.args.from_step > 0:
            tasks.append(asyncio.create_task(self.learn_step()))
        if self.args.from_step > 0:
            reached = asyncio.create_task(self.step_reached.wait())
            await asyncio.wait(
                [reached, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED
            )
            reached.cancel()
            print(f"flooder: the node is at step {self.step}, flooding", flush=True)
        tasks += [asyncio.create_task(self.one()) for _ in range(self.args.count)]
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            held = f"holding {self.held}, closed by the node {self.closed}"
            print(f"flooder: {held}, step {self.step}", flush=True)
        for task in tasks:
            task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument(
        "--from-step", type=int, default=0, help="start flooding once the node is at this outer step"
    )
    modes = ["idle", "hellos", "reaches", "forged", "relays", "records"]
    parser.add_argument("--mode", choices=modes, default="idle")
    parser.add_argument(
        "--claim",
        default="",
        metavar="KEY",
        help="forged, records: the member key to claim; relays: the node's",
    )
    parser.add_argument("--run-id", default="p2ptrain-debug", help="records: the run of the signed ones")
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--source", default="127.0.0.2")
    parser.add_argument("--learn-source", default="", help="the address the asks for the step come from")
    args = parser.parse_args()
    with contextlib.suppress(ValueError, OSError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(Flood(args).run())
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
