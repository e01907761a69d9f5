"""The DHT's own process: a hivemind DHTNode in a forked child, driven over a pipe.

hivemind.DHT does the same, but its futures share their state through torch shared memory, so every
process that held a DHT handle imported torch (~2 s of CPU in each node agent, bootstrap peer and
`status` call, none of which computes with torch). Here the parent sends typed requests over a
multiprocessing pipe and a reader thread resolves plain futures with the child's answers.

The child runs in its own session (a Ctrl+C at the terminal reaches the node, which shuts the DHT
down in order; it must not kill p2pd under the node's feet), dies with its parent
(PR_SET_PDEATHSIG) and on SIGTERM takes p2pd and its unix sockets down with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, RecordValidatorBase
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from p2ptrain import procs

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Store:
    key: str
    subkey: bytes
    value: bytes
    expiration: float


@dataclass(frozen=True)
class Get:
    key: str


@dataclass(frozen=True)
class ConnectedPeers:
    """Multiaddresses (with /p2p/<id>) of the peers the node's p2pd is connected to."""


@dataclass(frozen=True)
class VisibleAddresses:
    """The node's own multiaddresses as others may dial them."""


@dataclass(frozen=True)
class Cancel:
    call_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


Request = Store | Get | ConnectedPeers | VisibleAddresses
READY = 0
"""The call ID of the child's first message: its peer ID once the node is up, or why it is not."""


class DHTProcess:
    """Parent side of the DHT child: start it, send it requests, stop it."""

    def __init__(self, process: multiprocessing.process.BaseProcess, pipe: Connection, peer_id: str):
        self._process = process
        self._pipe = pipe
        self.peer_id = peer_id
        self.pid: int | None = process.pid
        self._send_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._pending_lock = threading.Lock()
        self._call_ids = itertools.count(READY + 1)
        self._gone = False
        self._reader = threading.Thread(target=self._read_answers, name="dht-answers", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls,
        initial_peers: Sequence[str],
        validators: Sequence[RecordValidatorBase],
        *,
        node_options: dict[str, Any],
        startup_timeout: float = 120.0,
    ) -> DHTProcess:
        """Fork the child and wait until its node is up.

        Raises what DHTNode.create raised (P2PDaemonError, ValueError), or P2PDaemonError when
        the child exits or stays silent past `startup_timeout`.
        """
        ours, theirs = multiprocessing.Pipe(duplex=True)
        serve = partial(
            _serve,
            parent_pid=os.getpid(),
            initial_peers=list(initial_peers),
            validators=list(validators),
            node_options=node_options,
        )
        process = multiprocessing.get_context("fork").Process(
            target=serve, args=(theirs, ours), name="p2ptrain-dht", daemon=True
        )
        process.start()
        theirs.close()
        try:
            if ours.poll(startup_timeout):
                _, ok, answer = ours.recv()
            else:
                silent = f"the DHT process did not start within {startup_timeout:.0f} s"
                answer, ok = P2PDaemonError(silent), False
        except (EOFError, OSError):
            answer, ok = P2PDaemonError("the DHT process exited while starting"), False
        if not ok:
            _reap(process, timeout=5.0)
            ours.close()
            raise answer
        return cls(process, ours, peer_id=answer)

    def call(self, request: Request) -> tuple[int, concurrent.futures.Future[Any]]:
        """Send a request; its call ID (to cancel it) and a future of the child's answer."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._pending_lock:
            if self._gone:
                future.set_exception(ConnectionError("the DHT process has exited"))
                return call_id, future
            self._pending[call_id] = future
        if not self._send((call_id, request)):
            self._fail(call_id, ConnectionError("the DHT process has exited"))
        return call_id, future

    def cancel(self, call_id: int) -> None:
        """Cancel a request in the child (its answer is no longer wanted)."""
        with self._pending_lock:
            future = self._pending.pop(call_id, None)
        if future is not None:
            future.cancel()
            self._send((call_id, Cancel(call_id)))

    def shutdown(self, timeout: float) -> None:
        """Ask the child to stop its node; SIGTERM it (it then stops p2pd) if it has not within `timeout`."""
        self._send((READY, Shutdown()))
        _reap(self._process, timeout)
        self._pipe.close()

    def _send(self, message: tuple[int, object]) -> bool:
        try:
            with self._send_lock:
                self._pipe.send(message)
            return True
        except (OSError, ValueError):  # the child is gone, or we closed the pipe
            return False

    def _read_answers(self) -> None:
        while True:
            try:
                call_id, ok, answer = self._pipe.recv()
            except (EOFError, OSError, ValueError):  # exited, or the pipe closed by shutdown
                break
            except Exception as exc:  # an answer that would not unpickle: that call fails
                log.warning("unreadable answer from the DHT process: %s", exc)
                continue
            with self._pending_lock:
                future = self._pending.pop(call_id, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(answer)
                else:
                    future.set_exception(answer)
        with self._pending_lock:
            self._gone = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the DHT process has exited"))

    def _fail(self, call_id: int, exc: BaseException) -> None:
        with self._pending_lock:
            future = self._pending.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(exc)


def _reap(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    process.join(timeout)
    if process.is_alive():
        process.terminate()  # SIGTERM: the child stops p2pd and removes its sockets
        process.join(timeout)


# ---- the child ----


def _serve(
    pipe: Connection,
    parents_end: Connection,
    *,
    parent_pid: int,
    initial_peers: list[str],
    validators: list[RecordValidatorBase],
    node_options: dict[str, Any],
) -> None:
    """The child's whole life: start the node, answer requests until Shutdown or the pipe closes."""
    os.setsid()
    procs.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
    signal.signal(signal.SIGTERM, _stop_daemon_and_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)  # the parent's event loop's, inherited by the fork
    parents_end.close()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(
            _serve_node(pipe, initial_peers, validators=validators, node_options=node_options)
        )
    finally:
        loop.close()


async def _serve_node(
    pipe: Connection,
    initial_peers: list[str],
    *,
    validators: list[RecordValidatorBase],
    node_options: dict[str, Any],
) -> None:
    try:
        node = await DHTNode.create(
            initial_peers=initial_peers or None,
            record_validator=CompositeValidator(validators),
            **node_options,
        )
    except Exception as exc:
        pipe.send((READY, False, _sendable(exc)))
        return
    pipe.send((READY, True, node.peer_id.to_base58()))
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    running: dict[int, asyncio.Task[Any]] = {}

    def answer(call_id: int, task: asyncio.Task[Any]) -> None:
        running.pop(call_id, None)
        if task.cancelled():
            return
        exc = task.exception()
        with contextlib.suppress(OSError, ValueError):
            pipe.send((call_id, True, task.result()) if exc is None else (call_id, False, _sendable(exc)))

    def on_readable() -> None:
        try:
            while pipe.poll():
                call_id, request = pipe.recv()
                if isinstance(request, Shutdown):
                    stopping.set()
                elif isinstance(request, Cancel):
                    task = running.pop(request.call_id, None)
                    if task is not None:
                        task.cancel()
                else:
                    running[call_id] = task = loop.create_task(_handle(node, request))
                    task.add_done_callback(partial(answer, call_id))
        except (EOFError, OSError):  # the parent is gone
            loop.remove_reader(pipe.fileno())
            stopping.set()

    loop.add_reader(pipe.fileno(), on_readable)
    await stopping.wait()
    loop.remove_reader(pipe.fileno())
    for task in running.values():
        task.cancel()
    await node.shutdown()


async def _handle(node: DHTNode, request: Request) -> Any:
    if isinstance(request, Store):
        return await node.store(
            request.key, request.value, request.expiration, subkey=request.subkey, await_all_replicas=False
        )
    if isinstance(request, Get):
        return await node.get(request.key, latest=True)
    if isinstance(request, ConnectedPeers):
        infos = await node.p2p.list_peers()
        return [f"{address}/p2p/{info.peer_id.to_base58()}" for info in infos for address in info.addrs]
    return [str(address) for address in await node.p2p.get_visible_maddrs()]


def _sendable(exc: BaseException) -> BaseException:
    """The exception itself when it pickles, else one that carries its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _stop_daemon_and_exit(signum: int, frame: Any) -> None:
    """SIGTERM in the DHT child: stop p2pd, remove its unix sockets, exit at once."""
    daemons = procs.descendants(os.getpid())
    sockets = [path for pid in daemons for path in p2pd_sockets(pid)]
    procs.terminate(daemons, timeout=2.0)
    for path in sockets:
        with contextlib.suppress(OSError):
            os.remove(path)
    os._exit(0)


def p2pd_sockets(pid: int) -> list[str]:
    """The daemon and client unix sockets a p2pd process was started with."""
    paths = []
    for arg in procs.command_line(pid):
        if arg.startswith("-listen=/unix"):
            daemon_socket = arg.removeprefix("-listen=/unix")
            paths.append(daemon_socket)
            paths.append(daemon_socket.replace("p2pd-", "p2pclient-"))
    return paths
