"""A member that sends a well-shaped but wrong pseudo-gradient, as a real node process
(P2PTRAIN_INJECT_ATTACK), in an open run with the defaults: the README's join line sets nothing."""

from __future__ import annotations

import re

import pytest

from p2ptrain.identity import load_or_create_identity, short_id
from tests.support.helpers import LocalSwarm, outer_records


@pytest.mark.procs
def test_a_member_sending_the_opposite_of_what_it_learned_is_held_in_by_the_defaults(
    swarm: LocalSwarm,
) -> None:
    """Three nodes of an open run, c negating its pseudo-gradient from the first outer step on: at a
    typical norm, which norm clipping lets through whole. Centered clipping (comm.robust "auto" in
    an open run) is on with nothing set; every node applies the same result every step, and the
    honest owners say whose share they held in toward the others'."""
    swarm.start_bootstrap()
    run = ["--set", "train.max_steps=40", "--set", "swarm.wait_nodes=3"]  # 4 outer steps
    for name in ("a", "b"):
        swarm.start_node(name, None, *run, command="join")
    swarm.start_node("c", None, *run, command="join", env={"P2PTRAIN_INJECT_ATTACK": "0:opposite"})
    for name in ("a", "b", "c"):
        assert swarm.children.wait(name, 300) == 0, swarm.log(name)
    records = {name: outer_records(swarm.root / name) for name in ("a", "b", "c")}
    hashes = [[r["params_hash"] for r in records[name]] for name in ("a", "b", "c")]
    assert hashes[0] == hashes[1] == hashes[2] and len(hashes[0]) == 4, records
    assert all(r["members"] == 3 for r in records["a"]), records["a"]
    assert "fault injection: sending a opposite pseudo-gradient in step 0" in swarm.log("c")
    attacker = short_id(load_or_create_identity(swarm.root / "c").public_key)
    held = re.compile(r"step \d+: held (\S+)'s share in toward the members' median")
    named = {who for name in ("a", "b") for who in held.findall(swarm.log(name))}
    assert named == {attacker}, (named, attacker)
