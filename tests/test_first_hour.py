"""The first hour of an operator and a volunteer: the mistakes they make get one line each, before
anything starts where that can be checked, and a node never trains alone in silence."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.identity import load_or_create_identity
from p2ptrain.procs import ChildProcesses, free_port
from p2ptrain.swarm.admission import issue_ticket
from tests.support.helpers import LIGHT, LocalSwarm, assert_one_line_error, cli, read_address, wait_until

pytestmark = pytest.mark.procs
"""Every test here starts processes."""


@pytest.fixture
def listener() -> Iterator[int]:
    """A port on 127.0.0.1 another program listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        yield held.getsockname()[1]


@pytest.mark.parametrize("setting", ["node.data_port", "node.ckpt_port"])
def test_a_port_in_use_is_one_line_before_the_dht_starts(tmp_path: Path, listener: int, setting: str) -> None:
    """Seen: 41 lines ending in `OSError: [Errno 98]` once the DHT and the ranks had started."""
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmTaMjzayTqNDpDJQSfyoqzzgJuHkbGj1oNzxzXC34MxPA"  # never dialed
    flags = ["--set", "node.data_host=127.0.0.1", "--set", f"{setting}={listener}"]
    result = cli("join", "--peer", peer, "--work-dir", str(tmp_path), *flags, timeout=60)
    assert_one_line_error(result, setting, f"port {listener}", "in use")


def test_a_dht_listen_port_in_use_is_named_not_taken_for_an_unreachable_peer(
    tmp_path: Path, listener: int
) -> None:
    """p2pd binds with SO_REUSEPORT: it started on the taken port, and the node reported "cannot
    reach bootstrap peer" 14 s later."""
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmTaMjzayTqNDpDJQSfyoqzzgJuHkbGj1oNzxzXC34MxPA"
    listen = f"/ip4/127.0.0.1/tcp/{listener}"
    result = cli("drill", "--peer", peer, "--work-dir", str(tmp_path), "--listen", listen, timeout=60)
    assert_one_line_error(result, "node.listen", f"port {listener}", "in use")


def test_a_second_bootstrap_on_a_taken_port_or_with_a_running_identity_is_refused(swarm: LocalSwarm) -> None:
    """Two bootstrap peers on one port both said "is up", and the kernel split the dials between
    them: nodes could end in two DHTs. One identity twice is two peers with one address."""
    port = free_port()
    swarm.start_bootstrap(listen=f"/ip4/127.0.0.1/tcp/{port}")
    other = swarm.root / "other"
    taken = cli("bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--identity", str(other), timeout=30)
    assert_one_line_error(taken, "--listen", f"port {port}", "in use")
    twice = cli("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(swarm.root / "bootstrap"))
    assert_one_line_error(twice, "in use by another running process")


def test_one_identity_runs_in_one_node_at_a_time(swarm: LocalSwarm) -> None:
    swarm.start_bootstrap()
    read_address(swarm.start_node("watcher"), timeout=60)
    again = cli(
        "watch", "--peer", swarm.bootstrap_addr, "--work-dir", str(swarm.root / "watcher"), timeout=30
    )
    assert_one_line_error(again, "in use by another running process")


def test_folders_it_cannot_write_are_one_line_at_start(tmp_path: Path) -> None:
    """A checkpoint folder it could not write: 20 outer steps ran with no checkpoint on disk, one
    "could not copy" line a step and a double traceback at exit. A work dir it could not write:
    `OSError: [Errno 30]` with the identity elsewhere."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    identity = ["--identity", str(tmp_path / "id")]
    result = cli(
        "join", "--work-dir", str(tmp_path / "w"), *identity, "--set", f"checkpoint.dir={not_a_folder}/x"
    )
    assert_one_line_error(result, "checkpoint.dir", "cannot write")
    result = cli("join", "--work-dir", str(not_a_folder / "w"), *identity)
    assert_one_line_error(result, "node.work_dir", "cannot write")
    result = cli("watch", "--work-dir", str(tmp_path / "w"), "--identity", str(not_a_folder))
    assert_one_line_error(result, "identity folder", "not a folder")


def test_checkpoint_copies_that_keep_failing_stop_the_node_and_free_its_ram_copies(tmp_path: Path) -> None:
    """The disk went away under a running node: it stops after a few failed copies in a row,
    saying why, instead of training on for days with no checkpoint kept; /dev/shm is freed."""
    work, disk = tmp_path / "node", tmp_path / "disk"
    flags = [
        *LIGHT,
        "--set",
        "train.inner_steps=2",
        "--set",
        "train.max_steps=400",
        "--set",
        f"checkpoint.dir={disk}",
    ]
    children = ChildProcesses()
    try:
        node = children.spawn(
            "node",
            [sys.executable, "-m", "p2ptrain", "join", "--work-dir", str(work), *flags],
            log_path=tmp_path / "node.log",
        )
        wait_until(lambda: any(disk.glob("step-*")), timeout=180, what="a checkpoint on disk")
        _replace_folder_with_a_file(disk, tmp_path / "gone")
        assert node.wait(timeout=180) != 0
    finally:
        assert children.stop_all() == []
    log = (tmp_path / "node.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert re.search(r"p2ptrain: error: stopped: 3 checkpoint copies in a row failed", log), log[-3000:]
    short_id = load_or_create_identity(work).short_id
    assert not Path(f"/dev/shm/p2ptrain-{short_id}").exists()


def test_a_ticket_names_its_runs_authority(tmp_path: Path) -> None:
    """A volunteer with a ticket but no run.authority joined an open run of its own and trained
    alone; a ticket of another run is one line."""
    authority = load_or_create_identity(tmp_path / "authority")
    node = load_or_create_identity(tmp_path / "node")
    ticket = issue_ticket(authority, node.public_key, time.time() + 3600).to_text()
    other = load_or_create_identity(tmp_path / "other").public_key.hex()
    wrong = cli(
        "drill",
        "--work-dir",
        str(tmp_path / "node"),
        "--set",
        f"node.ticket={ticket}",
        "--set",
        f"run.authority={other}",
    )
    assert_one_line_error(wrong, "node.ticket was issued by authority", authority.node_id[:12])
    taken = cli(
        "drill",
        "--work-dir",
        str(tmp_path / "node"),
        "--set",
        f"node.ticket={ticket}",
        "--steps",
        "1",
        "--inner",
        "0",
        "--size",
        "1000",
        "--set",
        "node.data_host=127.0.0.1",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        timeout=120,
    )
    assert taken.returncode == 0, taken.stderr
    assert f"run.authority {authority.node_id[:12]}… from node.ticket" in taken.stdout


def test_the_bootstraps_join_line_names_its_run(swarm: LocalSwarm) -> None:
    """The join line had no --config: a volunteer who pasted it joined p2ptrain-debug whatever the run."""
    swarm.start_bootstrap(extra=("--config", "debug", "--run-id", "run-42"))
    # its address file comes first, once its signal handlers are in place: the lines follow
    wait_until(lambda: "p2ptrain join --peer" in swarm.log("bootstrap"), 30, what="the join line")
    log = swarm.log("bootstrap")
    assert "join run 'run-42' with:" in log, log
    line = next(line for line in log.splitlines() if "p2ptrain join --peer" in line)
    assert "--config debug --set run.id=run-42" in line, line


def test_a_node_alone_in_its_run_says_so_and_does_not_wait_the_deadline_each_step(swarm: LocalSwarm) -> None:
    """A node whose config named another run trained alone, printing only `1 member(s), sync
    10.08 s` every step: each step waited the whole straggler deadline for nobody."""
    swarm.start_bootstrap()
    patient = ["--set", "swarm.straggler_deadline=120", "--set", "run.id=elsewhere"]
    run = [*patient, "--set", "train.inner_steps=2", "--set", "train.max_steps=8"]
    swarm.start_node("lonely", None, *run, command="join")
    assert swarm.children.wait("lonely", timeout=300) == 0, swarm.log("lonely")[-3000:]
    log = swarm.log("lonely")
    waits = [float(w) for w in re.findall(r"alone: waited ([0-9.]+) s for other nodes of the run", log)]
    assert len(waits) == 4, log[-3000:]
    assert max(waits) < 60, waits  # the grace (two heartbeat intervals), far below the deadline
    assert "no other node of run 'elsewhere' for 3 outer step(s)" in log, log[-3000:]
    assert log.count("no other node of run") == 1, "throttled: once, not every step"


def _replace_folder_with_a_file(folder: Path, aside: Path) -> None:
    """Move `folder` aside (atomically: a copy into it may be under way) and put a file in its
    place; again if the node made the folder anew meanwhile."""
    for attempt in range(100):
        with contextlib.suppress(FileNotFoundError):
            os.rename(folder, aside.with_name(f"{aside.name}{attempt}"))
        try:
            with folder.open("x") as file:
                file.write("not a folder any more")
            return
        except (FileExistsError, IsADirectoryError):
            continue
    raise AssertionError(f"{folder} kept coming back")
