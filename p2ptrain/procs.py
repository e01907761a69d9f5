"""Process-tree housekeeping (Linux /proc): find, signal and reap a process's descendants.

The DHT node runs in a forked child (swarm/dht_process.py) which starts the p2pd daemon; neither
dies with its parent on its own. These helpers let every p2ptrain process take its whole tree down with it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

_PR_SET_PDEATHSIG = 1


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1])


def is_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid`, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_of(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        for child in children.get(current, []):
            found.append(child)
            frontier.append(child)
    return found


def command_line(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def terminate(pids: Iterable[int], timeout: float) -> list[int]:
    """SIGTERM `pids`, wait up to `timeout` s, SIGKILL the rest; returns those that needed SIGKILL."""
    pids = [pid for pid in pids if is_alive(pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        _reap_children()
        time.sleep(0.05)
    stubborn = [pid for pid in pids if is_alive(pid)]
    for pid in stubborn:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _reap_children()
    return stubborn


def _reap_children() -> None:
    """Collect exited children of this process so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_UNPRIVILEGED_PORT = 1024


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections and binds to port 0 (Linux's default where
    the file cannot be read)."""
    try:
        low, high = (int(field) for field in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port nobody listens on right now, for a listener another process opens next (torch's
    rendezvous store of the ranks).

    Picked at random outside the ephemeral range: a port from that range can be taken, between
    this check and the listener's bind, as the local port of any outgoing connection on the
    machine (seen: the ranks' store failing with EADDRINUSE while other processes dialled). Where
    no such port is free, the kernel's choice."""
    ephemeral = ephemeral_ports()
    below = range(FIRST_UNPRIVILEGED_PORT, max(ephemeral.start, FIRST_UNPRIVILEGED_PORT))
    above = range(max(ephemeral.stop, FIRST_UNPRIVILEGED_PORT), 65536)
    for _ in range(tries if len(below) + len(above) else 0):
        index = random.randrange(len(below) + len(above))
        port = below[index] if index < len(below) else above[index - len(below)]
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def set_parent_death_signal(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux prctl)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


class ChildProcesses:
    """Processes started in their own session, tracked by PID and stopped with their whole tree."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._trees: dict[int, set[int]] = {}
        self.orphan_commands: dict[int, str] = {}
        """What the orphans of the last `stop_all` were running (for the message that names them)."""

    def spawn(
        self, name: str, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log_file:
            child = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self.children[name] = child
        self._trees[child.pid] = set()
        return child

    def remember_trees(self) -> None:
        """Record each child's current descendants, so they can be checked after it is gone."""
        for child in self.children.values():
            if child.poll() is None:
                self._trees[child.pid].update(descendants(child.pid))

    def signal(self, name: str, signum: int) -> None:
        self.remember_trees()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.children[name].pid, signum)

    def wait(self, name: str, timeout: float) -> int | None:
        """Exit code of `name`, or None if it is still running after `timeout` seconds."""
        try:
            return self.children[name].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def leftovers(self) -> list[int]:
        """Descendants seen earlier that are still alive after their parent went away."""
        return sorted(
            pid
            for parent, tree in self._trees.items()
            if not is_alive(parent)
            for pid in tree
            if is_alive(pid)
        )

    def stop_all(self, timeout: float = 10.0, tree_grace: float = 5.0) -> list[int]:
        """SIGTERM every child, wait, then kill anything left; returns the orphans that had to be killed.

        A child's own shutdown reaps its tree (DHT child, p2pd) after the child itself is gone, so
        the trees get `tree_grace` seconds of their own once the last child exited."""
        self.remember_trees()
        running = [child for child in self.children.values() if child.poll() is None]
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)
                os.kill(child.pid, signal.SIGCONT)  # a stopped child acts on SIGTERM only once resumed
        deadline = time.monotonic() + timeout
        for child in running:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        # the children's own shutdown reaps their trees; give it a moment, then count what is left
        deadline = time.monotonic() + tree_grace
        while time.monotonic() < deadline and self.leftovers():
            time.sleep(0.05)
        orphans = self.leftovers()
        self.orphan_commands = {pid: " ".join(command_line(pid))[:200] for pid in orphans}
        terminate(orphans, timeout=2.0)
        return orphans


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def exit_without_teardown(code: int) -> NoReturn:
    """End a finished command with `code`: what a normal exit does — non-daemon threads joined,
    atexit handlers run (logging's flush among them), standard streams flushed — except the
    interpreter's teardown of every module, which costs about 0.5 s of CPU with torch and hivemind
    loaded: seconds on a busy machine, out of the 5 s a stopped command has to be gone."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
