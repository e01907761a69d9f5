"""Drill nodes (`p2ptrain drill`) of a LocalSwarm: their flags, their step logs, and the checks
that every member of every step ended it with the same bytes."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.support.helpers import LocalSwarm, wait_until

DRILL = ["--set", 'node.data_host="127.0.0.1"', "--size", "50000"]


def drill_log(swarm: LocalSwarm, name: str) -> list[dict]:
    path = swarm.root / name / "drill.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drill_args(steps: int, nodes: int, inner: float = 0.3) -> list[str]:
    """`p2ptrain drill` flags of a drill of `steps` outer steps among `nodes` nodes."""
    return ["--steps", str(steps), "--nodes", str(nodes), "--inner", str(inner)]


def start_drill(
    swarm: LocalSwarm,
    steps: int,
    *extra: str,
    nodes: int = 3,
    env: dict[str, dict[str, str]] | None = None,
    bootstrap: bool = True,
    extra_for: dict[str, list[str]] | None = None,
    after_node0: Callable[[], None] | None = None,
) -> list[str]:
    """Bootstrap peer (unless started already) plus `nodes` drill nodes (`env` and more flags
    `extra_for` by name; `after_node0` runs once node0 is started, before the others, who hold
    back step 0); returns once node0 has done three steps."""
    if bootstrap:
        swarm.start_bootstrap()
    names = [f"node{i}" for i in range(nodes)]
    for name in names:
        flags = [*drill_args(steps, nodes), *extra, *(extra_for or {}).get(name, []), *DRILL]
        swarm.start_node(name, None, *flags, command="drill", env=(env or {}).get(name))
        if name == "node0" and after_node0 is not None:
            after_node0()
    wait_until(lambda: len(drill_log(swarm, "node0")) >= 3, timeout=120, what="three drill steps")
    return names


def finish(swarm: LocalSwarm, names: list[str]) -> dict[str, list[dict]]:
    """Wait for the drill nodes to exit cleanly; their step logs."""
    for name in names:
        assert swarm.children.wait(name, timeout=180) == 0, swarm.log(name)
    return {name: drill_log(swarm, name) for name in names}


def assert_agreement(logs: dict[str, list[dict]], steps: range) -> None:
    for step in steps:
        entries = [next(entry for entry in log if entry["step"] == step) for log in logs.values()]
        assert all("given_up" not in entry for entry in entries), entries
        assert len({entry["hash"] for entry in entries}) == 1, f"step {step}: results differ"
        assert len({entry["digest"] for entry in entries}) == 1, f"step {step}: memberships differ"
        assert len({tuple(entry["members"]) for entry in entries}) == 1
