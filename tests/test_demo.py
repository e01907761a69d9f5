"""`p2ptrain demo`: the whole system end to end — training, a SIGKILLed node, a joiner that recovers."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.ckpt.format import latest_checkpoint
from p2ptrain.procs import descendants, is_alive
from p2ptrain.train.metrics import read_metrics
from tests.support.helpers import LIGHT, cli, params_hash_of, socket_files, stale_sockets, stalls, wait_until


def log_tails(logs: Path, lines: int = 15) -> str:
    """The last lines each node wrote (its DEBUG lines left out): what a failure in CI can be read from."""
    tails = []
    for log in sorted(logs.glob("*.log")):
        kept = [line for line in log.read_text(errors="replace").splitlines() if " DEBUG " not in line]
        tails.append(f"\n--- {log.name}\n" + "\n".join(kept[-lines:]))
    return "".join(tails)


@pytest.mark.procs
@pytest.mark.parametrize("overlap", [False, True])
def test_demo_trains_loses_a_node_takes_in_a_new_one(tmp_path: Path, overlap: bool) -> None:
    """With outer.overlap too: the node is killed with a step in flight, and the joiner loads S from a
    checkpoint taken with one pending (its first phase without inner steps, weight 0), then replays
    the steps taken meanwhile. Phases of H = 30 (60 under overlap): the joiner must be on the network
    before the run ends (then the finished nodes stay for it); on one busy core it took 5 s to get
    there, and the 4 phases of 10 light steps left after the kill ended in 5.5 s, before anyone knew
    of it."""
    before = socket_files()
    # the members serve the joiner's checkpoint through the capped path (16 Mbit/s: the 6 MB of a
    # node's own files take about 3 s), and it collects the results of the steps taken meanwhile
    work = str(tmp_path / "demo")
    extra = ("--set", "node.serve_mbps=16", *LIGHT)  # and the tests' light batches
    # the demo sets train.max_steps to 6 × H. Under overlap the 4 phases after the kill follow one
    # another with no sync between them: at H = 30 they ended 5.8 s after the kill on a fast CI
    # machine, before the joiner was on the network (the run was over, nobody stayed for it)
    inner_steps = 60 if overlap else 30
    extra += ("--set", f"train.inner_steps={inner_steps}")
    if overlap:
        extra += ("--set", "outer.overlap.enabled=true")
    result = cli("demo", "--json", "--steps", "6", "--kill-at", "2", "--work-dir", work, *extra, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr + log_tails(Path(work) / "logs")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True, str(summary) + log_tails(Path(work) / "logs")
    # the progress a person sees: a line per outer step, the fault, the summary
    assert f"6 outer steps of H={inner_steps}" in result.stdout  # the demo's H follows the override
    assert "outer step 1: loss" in result.stdout and "SIGKILL node2" in result.stdout
    assert "done: 6 outer steps" in result.stdout and "0 orphans" in result.stdout
    assert summary["outer_steps"] == 6 and summary["params_hash_agree"] is True
    assert summary["nodes_max"] == 3 and summary["orphans"] == 0
    assert summary["loss_last"] < summary["loss_first"]
    # the summary's losses are the first and last per-step lines' (it used to take node0's first
    # inner step and the survivors' mean, which no line showed)
    lines = re.findall(r"outer step (\d+): loss (\S+),", result.stdout)
    assert [int(step) for step, _ in lines] == list(range(6)), result.stdout
    assert (lines[0][1], lines[-1][1]) == (f"{summary['loss_first']:.3f}", f"{summary['loss_last']:.3f}")
    assert f"loss {lines[0][1]} → {lines[-1][1]} (the first and last steps' lines)" in result.stdout
    assert [f"{step['loss']:.3f}" for step in summary["steps"]] == [loss for _, loss in lines]
    assert (
        summary["joiner_caught_up"] is True and summary["killed"] == "node2" and summary["joined"] == "node3"
    )
    assert all(step["members"] >= 2 for step in summary["steps"])
    assert stale_sockets(before) == set()
    assert list(Path(summary["checkpoints"]).glob("step-*"))
    # the joiner's own records: from its first outer step on, each one a member of the step or (where
    # the swarm had done the step by the time the joiner was ready: a slow machine) the step
    # replayed, and to the end of the run (the others stayed, finished, until it was done)
    joined = [r for r in read_metrics(tmp_path / "demo" / "node3" / "metrics.jsonl") if r["kind"] == "outer"]
    joiner_log = (tmp_path / "demo" / "logs" / "node3.log").read_text()
    loaded = re.search(r"recovered step-(\d+)", joiner_log)
    assert loaded is not None, joiner_log
    if int(loaded[1]) < 6:  # it came while the others were at it (on a slow machine they may be done)
        assert joined and joined[-1]["step"] == 5
        assert all(r["members"] >= 2 or r["replayed"] for r in joined), joined
    else:  # the run was over: the final checkpoint is the majority's final params, with no step taken
        assert joined == [] and summary["joiner_caught_up"] is True
    # one download: steps the swarm took meanwhile were replayed, not chased with a newer checkpoint
    assert joiner_log.count("recovered step-") == 1, joiner_log
    # the SIGKILL during inner steps held no step up: the killed node's port refuses connections, so
    # the survivors went on without waiting for its heartbeat timeout (6 s) or the deadline (5 s)
    nodes = [tmp_path / "demo" / f"node{i}" for i in range(4)]
    assert max(stalls(nodes).values()) < 4, stalls(nodes)
    # and the checkpoints on disk load and hold the params every node had after the last step
    latest = latest_checkpoint(Path(summary["checkpoints"]))
    final = [r for r in read_metrics(nodes[0] / "metrics.jsonl") if r["kind"] == "outer"][-1]
    assert latest is not None and params_hash_of(latest) == final["params_hash"]


@pytest.mark.procs
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT ignored at start"])
def test_a_signal_stops_the_demo_and_every_process_it_started_within_five_seconds(
    tmp_path: Path, stop: str
) -> None:
    """SIGINT too when the demo started with it ignored (nohup, a shell's background job: `trap ''
    INT`), where Python turns it into no KeyboardInterrupt: the demo's handlers are its own."""
    out = tmp_path / "demo.out"
    ignoring = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh"] if stop != "SIGTERM" else []
    with out.open("w") as handle:
        demo = subprocess.Popen(
            [
                *ignoring,
                sys.executable,
                "-m",
                "p2ptrain",
                "demo",
                "--nodes",
                "1",
                "--steps",
                "50",
                "--kill-at",
                "0",
                "--work-dir",
                str(tmp_path / "d"),
                *LIGHT,
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_until(lambda: "outer step 0:" in out.read_text(), 240, what="the first outer step")
        tree = descendants(demo.pid)
        started = time.monotonic()
        demo.send_signal(signal.SIGTERM if stop == "SIGTERM" else signal.SIGINT)
        assert demo.wait(timeout=5) == 1  # interrupted: the run did not finish
        assert time.monotonic() - started < 5
        assert not [pid for pid in tree if is_alive(pid)]
        assert f"FAILED: interrupted ({stop.split()[0]})" in out.read_text()
        assert "0 orphans" in out.read_text()
    finally:
        demo.kill()
        demo.wait()
