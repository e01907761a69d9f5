"""What a command checks before it starts anything: a port taken, a folder it cannot write, an
identity another process runs. Found later, each cost a traceback, a misleading error after the
DHT's retries, or days of lost checkpoints; found here, each is one line and a non-zero exit.

The checks bind and write for real, then let go: another program can still take a port between
the check and the node's own bind, which then fails in one line too (node/swarm_link.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import tempfile
from pathlib import Path
from types import TracebackType

from p2ptrain.errors import UserError

LOCK_FILE = "in-use.lock"
"""In an identity folder: held (a POSIX lock, released when the process ends however it ends) by
the one process that runs with that identity."""


def port_free(host: str, port: int, what: str) -> None:
    """UserError naming `what` when nothing could listen on host:port now (0: any port, not checked).

    No SO_REUSEPORT: p2pd listens with it, so two DHT peers would otherwise share one port and the
    kernel would split the dials between them."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a recent node's TIME_WAITs
        if family == socket.AF_INET6:  # as asyncio's servers bind: IPv6 only, IPv4 is another port
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            probe.bind((host, port))
            probe.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"{what}: port {port} on {host} is in use (another node, or another program): "
                    "choose another port, or 0 for any"
                ) from None
            raise UserError(f"{what}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def tcp_listen_ports(addresses: list[str]) -> list[tuple[str, int]]:
    """(host, port) of every /ip4|ip6/…/tcp/PORT multiaddress with a fixed port."""
    found = []
    for address in addresses:
        parts = address.strip("/").split("/")
        tcp = len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp"
        if tcp and parts[3].isdigit() and int(parts[3]) != 0:
            found.append((parts[1], int(parts[3])))
    return found


def dht_ports_free(addresses: list[str], what: str) -> None:
    for host, port in tcp_listen_ports(addresses):
        port_free(host, port, what)


def writable_dir(path: Path, what: str) -> None:
    """UserError unless `path` is (or can be made) a folder this process can write files in."""
    probe = path / f".p2ptrain-write-check-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{what} {path}: cannot write there ({exc.strerror or exc})") from None


class IdentityLock:
    """Held while a process runs with an identity: a second process with the same keys (two nodes
    that would sign the same records, or two bootstrap peers at one address) is refused at start.

    The lock file lies in the identity folder, or, where that folder is read-only (keys on a
    secrets mount), in the machine's temporary folder under a name derived from its path."""

    def __init__(self, directory: Path, what: str) -> None:
        self.directory = directory
        self.what = what
        self.fd: int | None = None

    def _open(self) -> int:
        directory = self.directory
        if directory.exists() and not directory.is_dir():
            raise UserError(f"{self.what} {directory}: not a folder")
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise UserError(f"{self.what} {directory}: cannot make it ({exc.strerror or exc})") from None
        try:
            return os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # read-only keys: one lock per identity path on this machine
            name = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:16]
            fallback = Path(tempfile.gettempdir()) / f"p2ptrain-identity-{name}.lock"
            try:
                return os.open(fallback, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise UserError(f"{self.what} {directory}: cannot lock it ({exc.strerror or exc})") from None

    def acquire(self) -> IdentityLock:
        """Take the lock (once: a second call, or `with` after it, keeps the one taken)."""
        if self.fd is not None:
            return self
        fd = self._open()
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per process: a forked child holds no lock
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(
                f"{self.what} {self.directory} is in use by another running process (pid {holder}): "
                "one process per identity; give this one another --identity or --work-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # the lock goes with the descriptor
            self.fd = None

    def __enter__(self) -> IdentityLock:
        return self.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
