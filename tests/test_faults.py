"""Faults injected into a training swarm: real node processes on 127.0.0.1 training the debug model.

One run takes the faults one after another — the bootstrap peer SIGKILLed and a node stopped with
SIGTERM after outer step 0, a node SIGKILLed in the middle of the all-reduce of step 2 — and then
checks what must hold after each: training goes on, every survivor holds the same params after
every outer step, no step stalls longer than heartbeat_timeout + the ring's failure bound, and the
checkpoints on disk (the killed node's included) load and hold exactly those params.
(SIGKILL during inner steps with a joiner is `p2ptrain demo`'s fault, tested in test_demo.py; a NaN
contribution and a node of another config in test_train_node.py.)
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from p2ptrain.ckpt.format import (
    FEEDBACK_FILE,
    MANIFEST_FILE,
    checkpoint_places,
    checkpoint_step,
    latest_checkpoint,
)
from p2ptrain.config import load_config
from p2ptrain.identity import load_or_create_identity
from p2ptrain.node.checkpoint_copies import flush_leftovers
from p2ptrain.node.rank_launcher import remove_stale_buffers
from tests.support.helpers import (
    LocalSwarm,
    assert_one_line_error,
    cli,
    metrics,
    params_hash_of,
    stalls,
    wait_until,
)

STEPS = 3
HEARTBEAT_TIMEOUT = 6.0
FAILURE_TIMEOUT = 5.0
RUN = [
    "--set",
    f"train.max_steps={STEPS * 10}",  # H = 10 on the debug config
    "--set",
    "swarm.wait_nodes=4",
    "--set",
    f"swarm.heartbeat_timeout={HEARTBEAT_TIMEOUT}",
    "--set",
    f"comm.failure_timeout={FAILURE_TIMEOUT}",
    "--set",
    "checkpoint.keep=10",
]


def flush_killed_node(work_dir: Path) -> None:
    """What a SIGKILLed node left in /dev/shm; its next start would do this."""
    identity = load_or_create_identity(work_dir)
    config = load_config("debug", overrides=[f'node.work_dir="{work_dir}"'])
    remove_stale_buffers(identity, work_dir)
    flush_leftovers(checkpoint_places(config, identity.short_id, work_dir), keep=10)


def overlap_flags(overlap: bool) -> list[str]:
    return ["--set", f"outer.overlap.enabled={str(overlap).lower()}"]


@pytest.mark.procs
@pytest.mark.parametrize("overlap", [False, True])
def test_training_survives_bootstrap_loss_sigterm_and_a_kill_mid_all_reduce(
    swarm: LocalSwarm, overlap: bool
) -> None:
    """With outer.overlap (its result taken on arrival, the default) the same faults hit the
    pipeline: step N syncs during phase N + 1, and the kill in step 2's all-reduce comes once the
    last phase is over (nothing left to overlap)."""
    swarm.start_bootstrap()
    for name in ("a", "b", "c", "d"):
        env = {"P2PTRAIN_INJECT_DIE_IN_SYNC": "2"} if name == "c" else None
        swarm.start_node(name, None, *RUN, *overlap_flags(overlap), command="join", env=env)
    wait_until(lambda: len(metrics(swarm.root / "a", "outer")) >= 1, 240, what="outer step 0")
    swarm.children.signal("bootstrap", signal.SIGKILL)
    swarm.children.signal("d", signal.SIGTERM)
    assert swarm.children.wait("d", 5) == 0, swarm.log("d")  # within 5 s of SIGTERM, mid-training
    assert "deathrattle sent" in swarm.log("d")

    for name in ("a", "b"):
        assert swarm.children.wait(name, 300) == 0, swarm.log(name)
    assert swarm.children.wait("c", 5) == -signal.SIGKILL, "c should have died in step 2's all-reduce"

    a, b = metrics(swarm.root / "a", "outer"), metrics(swarm.root / "b", "outer")
    assert [r["step"] for r in a] == list(range(STEPS)) == [r["step"] for r in b]
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    # d left by SIGTERM during step 1's inner steps (with overlap: once step 0 was taken in phase 1,
    # on arrival or at its end, so step 1 may still have synced with it), c died in step 2's all-reduce
    members = [r["members"] for r in a]
    assert members == [4, 3, 2] or (overlap and members == [4, 4, 2]), a
    assert "all-reduce of step 2 failed" in swarm.log("a") + swarm.log("b")
    waited = stalls([swarm.root / name for name in ("a", "b", "c", "d")])
    assert max(waited.values()) <= HEARTBEAT_TIMEOUT + FAILURE_TIMEOUT, waited
    assert waited[1] < HEARTBEAT_TIMEOUT, f"the deathrattle should spare the heartbeat timeout: {waited}"

    hashes = {r["step"]: r["params_hash"] for r in a}
    for name in ("a", "b"):
        latest = latest_checkpoint(swarm.root / name / "checkpoints")
        assert latest is not None and checkpoint_step(latest) == STEPS
        assert params_hash_of(latest) == hashes[STEPS - 1]
    flush_killed_node(swarm.root / "c")
    killed = latest_checkpoint(swarm.root / "c" / "checkpoints")
    # after step 1; step 2 never finished. With overlap the kill in step 2's all-reduce comes as the
    # checkpoint after step 1 is being written (the ranks hand step 2 over and save at once): that
    # one may be lost with the node, the one before it stands
    assert killed is not None and checkpoint_step(killed) in ((1, 2) if overlap else (2,)), killed
    assert params_hash_of(killed) == hashes[checkpoint_step(killed) - 1]


def assert_one_history(records: dict[str, list[dict]]) -> None:
    """The swarm's invariants over every node's outer-step records: one params hash per step, no
    one-member step while others were in the run, and every node ends on the same params."""
    by_step: dict[int, set[str]] = {}
    for name, node_records in records.items():
        for record in node_records:
            by_step.setdefault(record["step"], set()).add(record["params_hash"])
            assert record["members"] != 1, f"{name} took outer step {record['step']} alone"
    assert all(len(hashes) == 1 for hashes in by_step.values()), by_step
    assert len({node_records[-1]["params_hash"] for node_records in records.values()}) == 1


@pytest.mark.procs
@pytest.mark.parametrize(("overlap", "codec"), [(False, "dense"), (True, "dense"), (True, "sparse")])
def test_a_straggler_past_the_deadline_is_left_out_then_replays_the_step_and_rejoins(
    swarm: LocalSwarm, overlap: bool, codec: str
) -> None:
    """With the sparse codec (and overlap) the step replayed is every member's share, summed as they
    summed it."""
    swarm.start_bootstrap()
    # 3 outer steps of H=5: c's lateness counts from the others' ready(1), not from how long a phase is
    run = ["--set", "train.inner_steps=5", "--set", "train.max_steps=15", "--set", "swarm.wait_nodes=3"]
    run += [*overlap_flags(overlap), "--set", "swarm.straggler_deadline=4", "--set", f'comm.codec="{codec}"']
    faults = {
        "b": {"P2PTRAIN_INJECT_SLOW_START": "6"},  # its ranks start 6 s after its record is up
        "c": {"P2PTRAIN_INJECT_LATE": "1:8"},  # ready(1) 8 s after the others
    }
    for name in ("a", "b", "c"):
        swarm.start_node(name, None, *run, command="join", env=faults.get(name))
    for name in ("a", "b", "c"):
        assert swarm.children.wait(name, 300) == 0, swarm.log(name)
    records = {name: metrics(swarm.root / name, "outer") for name in ("a", "b", "c")}
    assert [r["step"] for r in records["c"]] == [0, 1, 2], records["c"]
    assert_one_history(records)
    # the run's first step waits for b, whose ranks started late (wait_nodes); c is left out of step 1
    assert [r["members"] for r in records["a"]][:2] == [3, 2]
    # c took step 1 from the others' all-reduce result (not a checkpoint), and so step 2 too if the
    # others were done with it first; a and b stayed in the swarm (finished) until c was done
    assert records["c"][1]["replayed"] is True and records["c"][1]["members"] == 0
    assert "took outer step 1 from the swarm's all-reduce result" in swarm.log("c")
    assert "recovered step" not in swarm.log("c")
    if codec == "sparse":  # each node's error feedback lies beside its checkpoints, never served
        kept = sorted((swarm.root / "a").rglob(f"step-*/{FEEDBACK_FILE}"))
        assert kept, list((swarm.root / "a").rglob("step-*"))
        assert FEEDBACK_FILE not in (kept[-1].parent / MANIFEST_FILE).read_text()


@pytest.mark.procs
def test_a_node_that_cannot_catch_up_says_it_diverged_and_its_checkpoint_is_not_exported(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    swarm.start_bootstrap()
    # 3 outer steps of H=5: c's lateness counts from the others' ready(2), not from how long a phase is
    run = ["--set", "train.inner_steps=5", "--set", "train.max_steps=15", "--set", "swarm.wait_nodes=3"]
    run += ["--set", "swarm.straggler_deadline=4", "--set", "swarm.finish_grace=0"]
    for name in ("a", "b", "c"):
        # c is ready for the last step 15 s after the others, who finish without it and leave at once
        env = {"P2PTRAIN_INJECT_LATE": "2:15"} if name == "c" else None
        swarm.start_node(name, None, *run, command="join", env=env)
    for name in ("a", "b"):
        assert swarm.children.wait(name, 300) == 0, swarm.log(name)
    assert swarm.children.wait("c", 120) == 1, swarm.log("c")
    errors = [line for line in swarm.log("c").splitlines() if line.startswith("p2ptrain: error:")]
    assert len(errors) == 1 and "diverged from the swarm at outer step 2" in errors[0], swarm.log("c")
    records = {name: metrics(swarm.root / name, "outer") for name in ("a", "b", "c")}
    assert [r["step"] for r in records["c"]] == [0, 1]  # never took step 2 alone
    assert_one_history({"a": records["a"], "b": records["b"]})

    latest = latest_checkpoint(swarm.root / "c" / "checkpoints")
    assert latest is not None and checkpoint_step(latest) == 2
    assert (
        "diverged from the swarm at outer step 2"
        in json.loads((latest / "meta.json").read_text())["diverged"]
    )
    refused = cli("export", str(swarm.root / "c"), str(tmp_path / "hf"))
    assert_one_line_error(refused, "not the swarm's model", "--allow-diverged")
    exported = cli("export", str(swarm.root / "c"), str(tmp_path / "hf"), "--allow-diverged")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
