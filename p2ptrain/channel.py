"""The protocol between a node agent and its rank 0: typed messages over a local socketpair.

Both processes import this module; it is the whole contract between them. The agent starts the
ranks (node/rank_launcher.py) and hands rank 0 its end of a socketpair (P2PTRAIN_CHANNEL_FD). The
big vector never goes through the socket: rank 0 creates a file the size of the model in fp32 (in
/dev/shm where it exists), both map it, and the messages only say whose turn it is.

Framing: a 4-byte big-endian length, then msgpack `[kind, {field: value}]`, at most `MAX_MESSAGE`
bytes; anything else is a `ChannelError`. Rank 0's training thread and its checkpoint-writer
thread both send, serialised by a lock.

    when                               rank 0 → agent             agent → rank 0
    model built (or resumed)           Hello: layout, vector file
                                       path, start step
    after every inner step             Progress
    inner phase over, Δ in the file    Ready(N, tokens, finite)
      the file is the agent's until …                             Averaged(N): exactly one reply
    outer step applied                 StepDone(N, params hash)
    a checkpoint folder written        CheckpointWritten (writer
      (any time, from the writer)      thread; the folder is final)
    max_steps reached, writer done     Finished, then exit 0

`Averaged(N)` says what the file holds now: `members` > 0, the swarm's weighted average of Δ;
`members` 0, rank 0's own Δ unchanged (no all-reduce completed); `replayed`, the result of step N
that the swarm computed without this node (the next outer step then skips its inner phase);
`reload`, a checkpoint folder to load instead of taking step N (no StepDone follows; the next
outer step skips its inner phase). A rank that exits before Finished is a failure: the agent sends
the deathrattle and stops the others. The agent closing the channel stops rank 0.

Rank 0 sends Finished before the final barrier, so the other ranks exit just after it; an exit can
interrupt the agent's wait in the very turn that read Finished. No read is lost to that: a read in
progress or done but not yet taken stays in the channel (`pending`, `take`) for the next wait.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import msgpack

from p2ptrain.untrusted import unpack_untrusted

_LENGTH = struct.Struct("!I")
MAX_MESSAGE = 1 << 20


@dataclass
class Hello:
    numel: int
    layout_digest: str
    buffer_path: str
    world_size: int
    parameters: int
    start_step: int
    micro_batch: int
    memory_estimate: int
    """Bytes the rank's memory estimate says it needs at `micro_batch` (train/memory.py)."""
    memory_available: int
    """Bytes free for the rank when it started (GPU memory, or its share of RAM)."""
    kind: ClassVar[str] = "hello"


@dataclass
class Progress:
    outer_step: int
    inner_step: int
    loss: float
    tokens: int
    tokens_per_s: float
    kind: ClassVar[str] = "progress"


@dataclass
class Ready:
    outer_step: int
    tokens: int
    finite: bool
    kind: ClassVar[str] = "ready"


@dataclass
class Averaged:
    outer_step: int
    members: int
    """0 when no all-reduce completed: rank 0 then applies its own pseudo-gradient alone."""
    ring: list[str] = field(default_factory=list)
    """Short ids of the members in ring order."""
    sync_s: float = 0.0
    bytes_sent: int = 0
    reload: str = ""
    """A checkpoint folder to load instead of taking this step: the node was off the swarm's track."""
    replayed: bool = False
    """The buffer holds the result of an all-reduce the swarm did without this node (ckpt/replay.py).
    The swarm is then already in its next inner phase: the node takes that step without inner steps,
    with weight 0, so it is in time to be a member of it."""
    relayed_bytes: int = 0
    """Bytes this node has relayed so far between members behind NAT (comm/relay.py)."""
    allreduce_s: float = 0.0
    """Seconds of the all-reduce that completed, its transfer alone (sync_s also counts the wait
    for the others and the elections): bytes_sent over it is the node's all-reduce rate."""
    rtt_ms: float = 0.0
    """The longest smoothed round trip (the kernel's) to a member this node sent to; 0: none measured."""
    kind: ClassVar[str] = "averaged"


@dataclass
class StepDone:
    outer_step: int
    params_hash: str
    loss: float
    kind: ClassVar[str] = "step_done"


@dataclass
class CheckpointWritten:
    outer_step: int
    """The outer step the checkpoint continues at (its folder is step-N)."""
    path: str
    write_s: float
    kind: ClassVar[str] = "checkpoint_written"


@dataclass
class Finished:
    outer_step: int
    kind: ClassVar[str] = "finished"


Message = Hello | Progress | Ready | Averaged | StepDone | CheckpointWritten | Finished
_KINDS: dict[str, type] = {
    cls.kind: cls for cls in (Hello, Progress, Ready, Averaged, StepDone, CheckpointWritten, Finished)
}


class ChannelError(RuntimeError):
    """The other side closed the channel or sent something that is not a message."""


def encode(message: Message) -> bytes:
    body = msgpack.packb([message.kind, asdict(message)], use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        kind, values = unpack_untrusted(body, MAX_MESSAGE)
        cls = _KINDS[kind]
        return cls(**{f.name: values[f.name] for f in fields(cls)})
    except Exception as exc:
        raise ChannelError(f"not a channel message ({exc})") from None


class RankChannel:
    """Rank 0's blocking end (the training thread and the checkpoint writer both send)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Message) -> None:
        with self._send_lock:
            self.sock.sendall(encode(message))

    def _read_exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            piece = self.sock.recv(size - len(data))
            if not piece:
                raise ChannelError("the node agent closed the channel")
            data += piece
        return bytes(data)

    def has_message(self) -> bool:
        """Whether a message has started to arrive (`receive` would not wait for the agent)."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def receive(self) -> Message:
        (size,) = _LENGTH.unpack(self._read_exactly(_LENGTH.size))
        if size > MAX_MESSAGE:
            raise ChannelError(f"message of {size} bytes")
        return decode(self._read_exactly(size))


class AgentChannel:
    """The agent's asyncio end."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self._reading: asyncio.Future[Message] | None = None
        """The read in progress: a wait on it that is cancelled (a rank died, the node stops)
        leaves it running, so no message is torn between its length and its body."""

    @classmethod
    async def open(cls, sock: socket.socket) -> AgentChannel:
        reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer)

    async def send(self, message: Message) -> None:
        self.writer.write(encode(message))
        await self.writer.drain()

    async def receive(self) -> Message:
        """The next message; cancelling this call loses nothing (the next call gets it)."""
        await asyncio.wait({self.pending()})  # cancelled, it leaves the read running
        return self.take()

    def pending(self) -> asyncio.Future[Message]:
        """The read of the next message (started if none is in progress). Wait on it with
        asyncio.wait beside other events, then `take` it in the same turn of the loop: a waiter
        cancelled before that loses nothing, the next call gets the message."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_one())
        return self._reading

    def take(self) -> Message:
        """The message of the finished read (or its ChannelError); the next read starts afresh."""
        reading, self._reading = self._reading, None
        assert reading is not None and reading.done(), "take() before the read finished"
        return reading.result()

    async def _read_one(self) -> Message:
        try:
            (size,) = _LENGTH.unpack(await self.reader.readexactly(_LENGTH.size))
            if size > MAX_MESSAGE:
                raise ChannelError(f"message of {size} bytes")
            return decode(await self.reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise ChannelError("rank 0 closed the channel") from None

    def close(self) -> None:
        if self._reading is not None:
            if self._reading.done() and not self._reading.cancelled():
                self._reading.exception()  # retrieved: nobody will read it now
            self._reading.cancel()
            self._reading = None
        self.writer.close()
