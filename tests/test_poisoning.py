"""A member that sends a well-shaped but wrong pseudo-gradient, as a real node process
(P2PTRAIN_INJECT_ATTACK), in an open run with the defaults: the README's join line sets nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest

from p2ptrain.errors import UserError
from p2ptrain.faults import Poisoner
from p2ptrain.identity import load_or_create_identity, short_id
from tests.support.helpers import LocalSwarm, outer_records


def test_each_attack_sends_a_finite_share_of_a_typical_norm_from_its_step_on() -> None:
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(1000).astype(np.float32) for _ in range(6)]
    result = rng.standard_normal(1000).astype(np.float32)
    for kind in Poisoner.KINDS:
        poisoner = Poisoner.parse(f"2:{kind}" if kind != "stale" else "2:stale:2")
        sent = []
        for step, delta in enumerate(deltas):
            vector = delta.copy()
            changed = poisoner.corrupt(step, vector)
            assert changed == (step >= 2), (kind, step)
            sent.append(vector)
            poisoner.remember(result)
        assert all(np.array_equal(sent[step], deltas[step]) for step in (0, 1)), kind
        for step in range(2, 6):
            assert np.isfinite(sent[step]).all()
            size, own = np.linalg.norm(sent[step]), np.linalg.norm(deltas[step])
            if kind == "opposite":
                assert np.array_equal(sent[step], -deltas[step])
            elif kind == "zero":
                assert size == 0
            elif kind == "stale":
                assert np.array_equal(sent[step], deltas[step - 2])
            else:
                assert abs(size - own) < 1e-3 * own, kind  # its own norm: what norm clipping passes
            if kind == "against_result":
                cosine = float(np.dot(sent[step], result)) / (size * np.linalg.norm(result))
                assert cosine < -0.999


@pytest.mark.parametrize("text", ["x:opposite", "1:sideways", "1:opposite:2", "1:stale:0", "1"])
def test_a_malformed_attack_is_a_one_line_error(text: str) -> None:
    with pytest.raises(UserError, match="P2PTRAIN_INJECT_ATTACK"):
        Poisoner.parse(text)


@pytest.mark.procs
def test_a_member_sending_the_opposite_of_what_it_learned_is_held_in_by_the_defaults(
    swarm: LocalSwarm,
) -> None:
    """Three nodes of an open run, c negating its pseudo-gradient from the first outer step on: at a
    typical norm, which norm clipping lets through whole. The reweighted mean (comm.robust "auto" in
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
    held = re.compile(r"step \d+: counted (\S+)'s share at under half its weight")
    named = {who for name in ("a", "b") for who in held.findall(swarm.log(name))}
    assert named == {attacker}, (named, attacker)
