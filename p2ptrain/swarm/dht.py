"""The DHT handle: hivemind.DHT started with retries, bounded calls, and a shutdown that leaves nothing.

hivemind runs its DHT node in a forked child, and that child runs the p2pd daemon. On their own
both outlive a parent that is killed, and p2pd leaves its unix sockets in /tmp. `ManagedDHT`
ties the child's life to its parent's (PR_SET_PDEATHSIG) and makes SIGTERM take p2pd and the
sockets down with it; `SwarmDHT.shutdown` reaps whatever is left by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hivemind.dht import DHT
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.timed_storage import ValueWithExpiration

import p2ptrain.swarm.quiet  # noqa: F401  (hivemind keeps quiet)
from p2ptrain import procs
from p2ptrain.errors import IdentityError, NetworkError, UserError

log = logging.getLogger(__name__)


class ManagedDHT(DHT):
    """hivemind.DHT whose child process dies with its parent and takes p2pd with it."""

    def run(self) -> None:
        # Own session: a Ctrl+C at the terminal reaches the node, which shuts the DHT down in
        # order (deathrattle first); it must not kill p2pd under the node's feet.
        os.setsid()
        procs.set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != self._parent_pid:  # the parent died before prctl took effect
            os._exit(0)
        signal.signal(signal.SIGTERM, _stop_daemon_and_exit)
        super().run()


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


@dataclass
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

    def __init__(self, dht: ManagedDHT, settings: DHTSettings):
        self._dht = dht
        self.settings = settings
        self._pid = dht.pid
        self._closed = False
        self.traffic = DHTTraffic()
        self._retired: list[tuple[ManagedDHT, int | None]] = []
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
        return self._dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in self._dht.get_visible_maddrs()]

    async def store(
        self, key: str, subkey: bytes, value: bytes, expiration: float, timeout: float | None = None
    ) -> bool:
        """Store one subkey of `key`; False when no replica accepted it within the timeout.

        Returns at the first replica that accepts (the others continue in the background), so a
        dead peer still in the routing table does not hold every heartbeat up for its RPC timeout.
        """
        timeout = self.settings.timeout if timeout is None else timeout
        self.traffic.stored += len(key) + len(subkey) + len(value)
        self.traffic.calls += 1
        future = self._dht.store(
            key, value, expiration, subkey=subkey, return_future=True, await_all_replicas=False
        )
        try:
            return bool(await asyncio.wait_for(_awaitable(future), timeout))
        except asyncio.TimeoutError:
            future.cancel()
            log.warning("DHT store of %s timed out after %.1f s", key, timeout)
            return False
        except Exception as exc:  # e.g. the full peer stopped under it (become_client)
            log.warning("DHT store of %s failed: %s", key, _first_line(str(exc)) or type(exc).__name__)
            return False

    async def get(self, key: str) -> dict[bytes, ValueWithExpiration] | None:
        """The latest subkey dictionary under `key`, or None when absent or on timeout."""
        future = self._dht.get(key, latest=True, return_future=True)
        try:
            found = await asyncio.wait_for(_awaitable(future), self.settings.timeout)
        except asyncio.TimeoutError:
            future.cancel()
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
            found = self._dht.run_coroutine(_connected_peers, return_future=True)
            connected = await asyncio.wait_for(_awaitable(found), self.settings.timeout)
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
        self._dht, self._pid, self.settings = client, client.pid, settings
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

    def _stop_started(self, starting: asyncio.Future[ManagedDHT]) -> None:
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

    def _stop(self, dht: ManagedDHT, pid: int | None) -> None:
        tree = procs.descendants(pid) if pid else []
        with contextlib.suppress(Exception):
            dht.shutdown()
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


def _start_once(settings: DHTSettings) -> ManagedDHT:
    kwargs: dict[str, Any] = {
        "host_maddrs": list(settings.listen),
        "client_mode": settings.client_mode,
        "record_validators": list(settings.validators),
        "shutdown_timeout": settings.shutdown_timeout,
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
        return ManagedDHT(initial_peers=list(settings.peers) or None, start=True, **kwargs)
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


async def _connected_peers(_dht: DHT, node: Any) -> list[str]:
    """Multiaddresses of the peers this DHT node is connected to (runs in the DHT's process)."""
    infos = await node.p2p.list_peers()
    return [f"{address}/p2p/{info.peer_id.to_base58()}" for info in infos for address in info.addrs]


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (bytes, bytearray, str)) else 0


async def _awaitable(future: Any) -> Any:
    return await future


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
