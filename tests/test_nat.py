"""Volunteers behind NAT (network namespaces with masquerading routers, see netlab.py): they dial
out, nobody dials in, and they are members of every step all the same."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterator

import pytest

from p2ptrain.identity import load_or_create_identity
from tests.support.drills import assert_agreement, drill_args, drill_log, finish
from tests.support.helpers import LocalSwarm, data_port, outer_records, wait_until
from tests.support.netlab import NetLab, leftover_namespaces, missing

ANYWHERE = "/ip4/0.0.0.0/tcp/0"


@pytest.fixture
def lab() -> Iterator[NetLab]:
    """One public network and two home networks, each behind its own NAT router (requested before
    `swarm`, so the processes are stopped before their namespaces go)."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    network = NetLab().start(homes=2)
    try:
        yield network
    finally:
        network.stop()
    assert leftover_namespaces(network.tag) == []


def start_drill_swarm(
    lab: NetLab,
    swarm: LocalSwarm,
    *,
    steps: int,
    homes: int,
    public: int = 2,
    bootstrap: tuple[str, ...] = (),
) -> list[str]:
    """A bootstrap peer (with `bootstrap` flags) and `public` drill nodes in the public network,
    `homes` behind NAT."""
    swarm.start_bootstrap(
        listen=f"/ip4/{lab.public_ip}/tcp/0", prefix=lab.run_in(lab.public), extra=bootstrap
    )
    return start_drill_nodes(lab, swarm, steps=steps, homes=homes, public=public)


def start_drill_nodes(lab: NetLab, swarm: LocalSwarm, *, steps: int, homes: int, public: int) -> list[str]:
    nodes = public + homes
    drill = [*drill_args(steps, nodes), "--size", "50000"]
    placed = [(f"node{index}", lab.public) for index in range(public)]
    placed += [(f"home{index}", lab.homes[index]) for index in range(homes)]
    for name, namespace in placed:
        swarm.start_node(name, None, *drill, command="drill", prefix=lab.run_in(namespace), listen=ANYWHERE)
    return [name for name, _ in placed]


def flood_relays(lab: NetLab, swarm: LocalSwarm, *, key: str, port: str, from_step: int = 0) -> None:
    """A stranger in the public network asking the relay at `port` (whose key is `key`) to relay
    edges, 300 connections at a time, each request validly signed by a fresh key; from the relay's
    outer step `from_step` on."""
    flood = ["--mode", "relays", "--claim", key, "--count", "300", "--source", lab.public_ip]
    flood += ["--from-step", str(from_step)]
    flood += ["--target", f"{lab.public_ip}:{port}"]
    swarm.children.spawn(
        "flooder",
        [*lab.run_in(lab.public), sys.executable, "-m", "tests.support.flooder", *flood],
        log_path=swarm.root / "flooder.log",
    )


def assert_refusals_logged(log: str) -> None:
    refusals = [line for line in log.splitlines() if "relay request from" in line]
    assert 0 < len(refusals) < 30, "refusals are logged, a few lines per 10 s"


def test_volunteers_behind_nat_are_members_of_every_drill_step(lab: NetLab, swarm: LocalSwarm) -> None:
    """Two public nodes, two behind different NAT routers. Each of those learns from a dial-back
    probe that it cannot be reached, says so in its record, and dials its own connections
    (connection reversal) and goes on as a DHT client; as they cannot reach each other, the ring
    keeps them apart. Every step has every member. The public nodes announce the address the
    others see (not 127.0.0.1), and status shows who is where."""
    homes = 2
    names = start_drill_swarm(lab, swarm, steps=1000, homes=homes)

    # nobody can dial their DHT peers either: they go on as DHT clients, publishing through the
    # others. The switch runs beside the steps and takes seconds (a DHT starts), so the drill runs
    # until both have switched and three more steps are done, whatever the machine's speed
    def as_clients() -> bool:
        return all("DHT goes on as a client" in swarm.log(f"home{index}") for index in range(homes))

    wait_until(as_clients, 120, what="both home nodes going on as DHT clients")
    after = len(drill_log(swarm, "node0")) + 3
    wait_until(lambda: len(drill_log(swarm, "node0")) >= after, 60, what="three steps after the switch")
    done = min(len(drill_log(swarm, name)) for name in names)
    for name in names:  # the steps in flight now may lose members: the ones done before are checked
        swarm.children.signal(name, signal.SIGTERM)
    logs = finish(swarm, names)
    assert done >= after - 1, done
    assert_agreement(logs, range(done))
    members = [entry["members"] for entry in logs["node0"][:done]]
    assert all(len(entry) == 2 + homes for entry in members), members
    assert all("not reachable from outside" in swarm.log(f"home{index}") for index in range(homes))
    assert not any("DHT goes on as a client" in swarm.log(f"node{index}") for index in range(2))
    nodes = swarm.status(prefix=lab.run_in(lab.public))["nodes"]  # their last records
    assert sorted(node["reach"] for node in nodes) == ["closed"] * homes + ["open", "open"], nodes
    public = [node for node in nodes if node["reach"] == "open"]
    assert all(node["data_addr"].startswith(f"{lab.public_ip}:") for node in public), nodes


def test_two_volunteers_behind_nat_reach_each_other_through_a_relay_even_under_a_flood(
    lab: NetLab, swarm: LocalSwarm
) -> None:
    """One public node, two behind different NAT routers: in a ring of three the two are neighbours,
    and neither can dial the other, so their edge goes through the public node (relay.py). From the
    second step on a stranger in the public network asks the relay, 300 connections at a time, to
    relay edges of its current or next step (valid signatures of fresh keys, memberships nobody
    has): each request is refused or waits bounded in the strangers' share. Every step has all
    three members and one hash, and the relay counts the bytes it relayed."""
    steps = 8
    names = start_drill_swarm(lab, swarm, steps=steps, homes=2, public=1)
    port = data_port(swarm, "node0", timeout=60)
    relay = load_or_create_identity(swarm.root / "node0").public_key.hex()
    flood_relays(lab, swarm, key=relay, port=str(port), from_step=1)  # started now: its imports take seconds
    logs = finish(swarm, names)
    assert all(len(log) == steps for log in logs.values()), {name: len(log) for name, log in logs.items()}
    assert_agreement(logs, range(steps))
    assert all(len(entry["members"]) == 3 for entry in logs["node0"]), logs["node0"]
    relayed = [entry["relayed_bytes"] for entry in logs["node0"]]
    assert relayed == sorted(relayed) and relayed[-1] >= steps * 50_000 // 3 // 4, relayed  # ≥ ¼ B/value
    assert all(entry["relayed_bytes"] == 0 for name in ("home0", "home1") for entry in logs[name])
    assert re.search(r"step [1-9]", swarm.log("flooder")), "the flood never learned node0's step"
    assert re.search(r"closed by the node [1-9]", swarm.log("flooder")), "the flood never got an answer"
    assert_refusals_logged(swarm.log("node0"))


def test_with_no_public_member_the_bootstrap_peer_relays_and_probes(lab: NetLab, swarm: LocalSwarm) -> None:
    """Two drill nodes behind different NAT routers and no public member: nobody of the swarm can
    dial anyone. The bootstrap peer opts in with --relay: it answers their dial-back probes (so
    they learn they are behind NAT) and relays their edges both ways, while a stranger floods it
    with relay requests from the start. Every step has both members and one hash, and the
    bootstrap peer says what it relayed when it stops."""
    steps = 5
    relay = ("--relay", f"{lab.public_ip}:0", "--relay-mbps", "1000")
    swarm.start_bootstrap(listen=f"/ip4/{lab.public_ip}/tcp/0", prefix=lab.run_in(lab.public), extra=relay)
    announced = re.compile(r"standby relay for run '[^']+' at \S+:(\d+) \(key ([0-9a-f]{64})")
    wait_until(lambda: announced.search(swarm.log("bootstrap")) is not None, 30, what="the relay's line")
    found = announced.search(swarm.log("bootstrap"))
    assert found is not None
    flood_relays(lab, swarm, key=found.group(2), port=found.group(1))
    names = start_drill_nodes(lab, swarm, steps=steps, homes=2, public=0)
    logs = finish(swarm, names)
    assert all(len(log) == steps for log in logs.values()), {name: len(log) for name, log in logs.items()}
    assert_agreement(logs, range(steps))
    assert all(len(entry["members"]) == 2 for entry in logs["home0"]), logs["home0"]
    assert all("not reachable from outside" in swarm.log(name) for name in names)
    swarm.children.signal("bootstrap", signal.SIGTERM)
    assert swarm.children.wait("bootstrap", 20) == 0, swarm.log("bootstrap")
    relayed = re.search(r"standby relay: (\d+) edges, (\d+) bytes relayed", swarm.log("bootstrap"))
    assert relayed is not None, swarm.log("bootstrap")
    # every step sends both ways through it: at least a quarter byte per value, each way
    assert int(relayed.group(1)) >= 2 * steps and int(relayed.group(2)) >= steps * 2 * 50_000 // 4
    assert_refusals_logged(swarm.log("bootstrap"))
    assert re.search(r"closed by the node [1-9]", swarm.log("flooder")), "the flood never got an answer"


def test_a_training_node_behind_nat_contributes_to_every_outer_step(lab: NetLab, swarm: LocalSwarm) -> None:
    """Real trainers (debug config): two public nodes and one behind NAT train 3 outer steps
    together; every step has all three members and one params hash. The sidecars are probed with
    the data ports: the home node's says closed, the public ones' open."""
    swarm.start_bootstrap(listen=f"/ip4/{lab.public_ip}/tcp/0", prefix=lab.run_in(lab.public))
    run = ["--set", "train.max_steps=30", "--set", "swarm.wait_nodes=3"]
    placed = {"a": lab.public, "b": lab.public, "home": lab.homes[0]}
    for shard, (name, namespace) in enumerate(placed.items()):
        pinned = ["--set", f"data.shard={shard}"]
        swarm.start_node(
            name, None, *run, *pinned, command="join", prefix=lab.run_in(namespace), listen=ANYWHERE
        )
    for name in placed:
        assert swarm.children.wait(name, 240) == 0, swarm.log(name)
    records = {name: outer_records(swarm.root / name) for name in placed}
    assert all([r["step"] for r in steps] == [0, 1, 2] for steps in records.values()), records
    for step in range(3):
        at_step = [steps[step] for steps in records.values()]
        assert {r["members"] for r in at_step} == {3}, at_step
        assert len({r["params_hash"] for r in at_step}) == 1, at_step
    assert "not reachable from outside" in swarm.log("home")
    # its checkpoint sidecar was probed too: nobody could reach it, so it is nobody's source
    assert "checkpoint sidecar http" in swarm.log("home")
    nodes = swarm.status(prefix=lab.run_in(lab.public))["nodes"]
    assert sorted(node["ckpt_reach"] for node in nodes) == ["closed", "open", "open"], nodes
