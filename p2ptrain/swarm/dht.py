"""The DHT handle: a hivemind DHT node started with retries, bounded calls, and a shutdown that
leaves nothing.

The node runs in a forked child (dht_process.py), and that child runs the p2pd daemon. The child
dies with its parent and takes p2pd and its sockets down with it; `SwarmDHT.shutdown` reaps
whatever is left by PID.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.timed_storage import ValueWithExpiration

import p2ptrain.swarm.quiet  # noqa: F401  (hivemind keeps quiet)
from p2ptrain import procs
from p2ptrain.deadline import within
from p2ptrain.errors import IdentityError, NetworkError, UserError
from p2ptrain.swarm.dht_process import (
    ConnectedPeers,
    DHTProcess,
    Get,
    Request,
    Store,
    VisibleAddresses,
    p2pd_sockets,
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DHTSettings:
    peers: Sequence[str] = ()
    listen: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    announce: Sequence[str] = ()
    p2p_key: Path | None = None
    client_mode: bool = False
    timeout: float = 5.0
    retries: int = 4
    backoff: float = 1.0
    shutdown_timeout: float = 5.0
    validators: Sequence[RecordValidatorBase] = field(default_factory=tuple)


@dataclass
class DHTTraffic:
    """What this node's own DHT calls moved: the payload bytes it stored and read, and the calls
    (the DHT's replication between peers comes on top; benchmarks.scale reports these)."""

    stored: int = 0
    read: int = 0
    calls: int = 0


class SwarmDHT:
    """A started DHT node. Every store and get is bounded by `settings.timeout`."""

    def __init__(self, dht: DHTProcess, settings: DHTSettings):
        self._dht = dht
        self.settings = settings
        self._pid = dht.pid
        self._closed = False
        self.traffic = DHTTraffic()
        self._retired: list[tuple[DHTProcess, int | None]] = []
        """Full peers replaced by a client (become_client), until they are stopped."""
        self._retiring: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, settings: DHTSettings) -> SwarmDHT:
        """Start the DHT, retrying unreachable bootstrap peers with exponential backoff.

        Raises NetworkError naming the peers (or the port) and what to check.
        """
        delay = settings.backoff
        for attempt in range(1, settings.retries + 1):
            try:
                return cls(_start_once(settings), settings)
            except P2PDaemonError as exc:
                reason = str(exc)
                if "address already in use" in reason:
                    raise NetworkError(
                        f"cannot listen on {', '.join(settings.listen)}: the port is already in use "
                        "(stop the other process or choose another --listen port)"
                    ) from None
                if "already taken" in reason:
                    raise IdentityError(
                        f"the identity in {settings.p2p_key} is already used by a running peer; "
                        "give each node its own --identity directory"
                    ) from None
                if "connect to bootstrap peers" not in reason or attempt == settings.retries:
                    if settings.peers and "bootstrap" in reason:
                        raise NetworkError(
                            f"cannot reach bootstrap peer {' or '.join(settings.peers)} after {attempt} "
                            "attempts: check the address and peer ID, that the peer is running, and that "
                            "its TCP port is open to this machine"
                        ) from None
                    raise NetworkError(f"the DHT did not start: {_first_line(reason)}") from None
                log.warning(
                    "bootstrap peer not reachable (attempt %d/%d), retrying in %.1f s",
                    attempt,
                    settings.retries,
                    delay,
                )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    @property
    def peer_id(self) -> str:
        return self._dht.peer_id

    def visible_maddrs(self) -> list[str]:
        _, answer = self._dht.call(VisibleAddresses())
        try:
            return list(answer.result(timeout=self.settings.timeout))
        except (concurrent.futures.TimeoutError, ConnectionError) as exc:
            raise NetworkError(f"the DHT did not tell its addresses: {exc or 'timed out'}") from None

    async def store(
        self, key: str, subkey: bytes, *, value: bytes, expiration: float, timeout: float | None = None
    ) -> bool:
        """Store one subkey of `key`; False when no replica accepted it within the timeout.

        Returns at the first replica that accepts (the others continue in the background), so a
        dead peer still in the routing table does not hold every heartbeat up for its RPC timeout.
        """
        timeout = self.settings.timeout if timeout is None else timeout
        self.traffic.stored += len(key) + len(subkey) + len(value)
        self.traffic.calls += 1
        try:
            return bool(
                await self._ask(Store(key=key, subkey=subkey, value=value, expiration=expiration), timeout)
            )
        except asyncio.TimeoutError:
            log.warning("DHT store of %s timed out after %.1f s", key, timeout)
            return False
        except Exception as exc:  # e.g. the full peer stopped under it (become_client)
            log.warning("DHT store of %s failed: %s", key, _first_line(str(exc)) or type(exc).__name__)
            return False

    async def get(self, key: str) -> dict[bytes, ValueWithExpiration] | None:
        """The latest subkey dictionary under `key`, or None when absent or on timeout."""
        try:
            found = await self._ask(Get(key), self.settings.timeout)
        except asyncio.TimeoutError:
            log.warning("DHT get of %s timed out after %.1f s", key, self.settings.timeout)
            return None
        except Exception as exc:  # e.g. the full peer stopped under it (become_client)
            log.warning("DHT get of %s failed: %s", key, _first_line(str(exc)) or type(exc).__name__)
            return None
        self.traffic.calls += 1
        if found is None or not isinstance(found.value, dict):
            return None
        items = {
            subkey: item for subkey, item in found.value.items() if isinstance(item, ValueWithExpiration)
        }
        self.traffic.read += sum(len(subkey) + _size(item.value) for subkey, item in items.items())
        return items

    async def become_client(self) -> bool:
        """Go on as a DHT client: a node nobody can dial (behind NAT) must not sit in the others'
        routing tables, where every store and lookup that picks it waits for a timeout. The client
        still stores and reads through its peers. A client needs no stable peer ID and no fixed
        port, so it starts beside the full peer (a fresh libp2p key, any port) from the peers that
        one is connected to, and takes its place only once it is up. True once a client."""
        if self.settings.client_mode:
            return True
        try:
            connected = list(await self._ask(ConnectedPeers(), self.settings.timeout))
        except Exception as exc:  # the peer list is a hint: the bootstrap peers may do
            log.debug("no connected peers from the DHT: %s", exc)
            connected = []
        settings = replace(
            self.settings,
            peers=[*self.settings.peers, *connected],
            listen=("/ip4/0.0.0.0/tcp/0",),
            announce=(),
            p2p_key=None,
            client_mode=True,
        )
        starting = asyncio.ensure_future(asyncio.to_thread(_start_once, settings))
        try:
            client = await asyncio.shield(starting)
        except asyncio.CancelledError:  # the node stops: the client, once up, goes too
            starting.add_done_callback(self._stop_started)
            raise
        except (P2PDaemonError, UserError) as exc:
            log.warning("the DHT stays a full peer: its client could not start (%s)", _first_line(str(exc)))
            return False
        if self._closed:  # shut down while the client started
            await asyncio.to_thread(self._stop, client, client.pid)
            return False
        self._retired.append((self._dht, self._pid))
        self._dht = client
        self._pid = client.pid
        self.settings = settings
        self._retiring = asyncio.create_task(self._retire_later())
        log.warning("DHT goes on as a client (nobody can dial this node): peer %s", self.peer_id)
        return True

    def shutdown(self) -> None:
        """Stop the DHT child and p2pd; anything still alive after the timeout is killed by PID."""
        if self._closed:
            return
        self._closed = True
        while self._retired:
            self._stop(*self._retired.pop())
        self._stop(self._dht, self._pid)

    async def _ask(self, request: Request, timeout: float) -> Any:
        """The DHT child's answer to `request`; TimeoutError (the request cancelled there) past `timeout`.
        An answer that comes back cancelled (or as concurrent.futures' CancelledError, which
        asyncio.wrap_future would turn into its own) raises ConnectionError, a failed call: only the
        cancellation of the caller's own task raises CancelledError."""
        call_id, answer = self._dht.call(request)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        answer.add_done_callback(lambda done: _settle_soon(loop, waiter, done))
        try:
            return await within(waiter, timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._dht.cancel(call_id)
            raise

    def _stop_started(self, starting: asyncio.Future[DHTProcess]) -> None:
        """A client whose start outlived its caller: stop it by PID, off the event loop."""
        if not starting.cancelled() and starting.exception() is None:
            client = starting.result()
            threading.Thread(target=self._stop, args=(client, client.pid), daemon=True).start()

    async def _retire_later(self) -> None:
        """Stop the full peer once the calls it still runs have ended (each is bounded by the
        timeout): stopped under them, they would hang until it."""
        await asyncio.sleep(self.settings.timeout)
        while self._retired:
            await asyncio.to_thread(self._stop, *self._retired.pop())

    def _stop(self, dht: DHTProcess, pid: int | None) -> None:
        tree = procs.descendants(pid) if pid else []
        with contextlib.suppress(Exception):
            dht.shutdown(self.settings.shutdown_timeout)
        leftovers = [process for process in [pid, *tree] if process and procs.is_alive(process)]
        if leftovers:
            stubborn = procs.terminate(leftovers, timeout=self.settings.shutdown_timeout)
            if stubborn:
                log.warning("killed DHT processes that ignored SIGTERM: %s", stubborn)
        for child in tree:
            for path in p2pd_sockets(child):
                with contextlib.suppress(OSError):
                    os.remove(path)

    def __enter__(self) -> SwarmDHT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _start_once(settings: DHTSettings) -> DHTProcess:
    kwargs: dict[str, Any] = {
        "host_maddrs": list(settings.listen),
        "client_mode": settings.client_mode,
        # hivemind refuses a bootstrap peer whose clock differs from ours by over 3 s; nothing of
        # ours compares clocks across hosts (see membership.py), so a skewed clock only warns
        "strict": False,
    }
    if settings.announce:
        kwargs["announce_maddrs"] = list(settings.announce)
    if settings.p2p_key is not None:
        kwargs["identity_path"] = str(settings.p2p_key)
    before = _socket_files()
    try:
        return DHTProcess.start(settings.peers, settings.validators, node_options=kwargs)
    except P2PDaemonError:
        _remove_dead_sockets(_socket_files() - before)  # hivemind leaves them when p2pd fails
        raise
    except ValueError as exc:  # hivemind validates announce addresses itself
        raise UserError(f"invalid DHT address: {exc}") from None


SOCKET_DIR = Path("/tmp")  # hivemind's fixed prefix: /unix/tmp/hivemind-
SOCKET_GLOB = "hivemind-p2p*.sock"


def _socket_files() -> set[Path]:
    return set(SOCKET_DIR.glob(SOCKET_GLOB))


def _remove_dead_sockets(paths: set[Path], settle: float = 3.0) -> None:
    """Unlink unix sockets nobody listens on (a live daemon's socket accepts the connection).

    A p2pd that just reported its failure may still be exiting, its socket still accepting: such
    sockets are probed again until `settle` seconds have passed.
    """
    deadline = time.monotonic() + settle
    remaining = set(paths)
    while remaining:
        for path in list(remaining):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                with contextlib.suppress(OSError):
                    path.unlink()
                remaining.discard(path)
            except OSError:
                remaining.discard(path)
            finally:
                probe.close()
        if not remaining or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (bytes, bytearray, str)) else 0


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def _settle_soon(
    loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[Any], done: concurrent.futures.Future[Any]
) -> None:
    """From the thread that read the DHT child's answer: settle `waiter` with it on the loop."""
    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        loop.call_soon_threadsafe(_settle, waiter, done)


def _settle(waiter: asyncio.Future[Any], done: concurrent.futures.Future[Any]) -> None:
    if waiter.done():  # our caller gave up (timeout, cancelled)
        return
    exc = None if done.cancelled() else done.exception()
    if done.cancelled() or isinstance(exc, concurrent.futures.CancelledError):
        waiter.set_exception(ConnectionError("the DHT call was cancelled under us"))
    elif exc is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(done.result())
