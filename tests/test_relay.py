"""Relays (comm/relay.py) on a real data-plane server over 127.0.0.1: two ends behind NAT spliced
byte for byte, every request that does not hold refused with its reason, the cap on what a relay
copies, and the pure choice of an edge's relay."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from p2ptrain.comm.net.members import Member, membership_digest
from p2ptrain.comm.net.relay import RelayRefused, RelayRequest, open_relayed, relay_for, route
from p2ptrain.comm.net.relay_service import MAX_PER_SIGNER
from p2ptrain.comm.net.server import MAX_ATTEMPT_JUMP, DataPlaneServer
from p2ptrain.comm.transport.wire import WireError, read_frame, write_frame
from p2ptrain.config import CommConfig
from p2ptrain.identity import NodeIdentity, load_or_create_identity
from p2ptrain.rate import RateCap
from tests.support.helpers import discard, settle

STEP = 7


class Swarm:
    """A relay's server and the identities of the members of one step: the relay and `reachable`
    other public members first, then two behind NAT (listed at a port nobody listens on)."""

    def __init__(
        self, root: Path, reachable: int = 0, *, setup_timeout: float = 2.0, relay_mbps: float = 100.0
    ) -> None:
        names = ["relay", *(f"public{i}" for i in range(reachable)), "home0", "home1"]
        self.ids = {name: load_or_create_identity(root / name) for name in names}
        self.setup_timeout = setup_timeout
        self.server = DataPlaneServer(
            identity=self.ids["relay"], comm=CommConfig(), setup_timeout=setup_timeout, relay_mbps=relay_mbps
        )
        self.members: list[Member] = []
        self.step = STEP

    async def start(self) -> Swarm:
        host, port = await self.server.start("127.0.0.1", 0)
        self.members = [
            Member(
                key=identity.public_key,
                host=host,
                port=port if name == "relay" else 1,
                weight=1.0,
                reachable=not name.startswith("home"),
            )
            for name, identity in self.ids.items()
        ]
        homes = self.ids["home0"].public_key, self.ids["home1"].public_key
        # a step at which the edge home0 → home1 is ours to relay (with public members, not every one)
        self.step = next(
            s
            for s in range(STEP, STEP + 100)
            if relay_for(s, self.members, sender=homes[0], receiver=homes[1]) == self.members[0]
        )
        self.server.relay.allow(self.step, self.digest, self.members)
        return self

    @property
    def digest(self) -> bytes:
        return membership_digest(self.step, self.members)

    def request(self, role: str, sender: str = "home0", receiver: str = "home1") -> RelayRequest:
        key = {name: identity.public_key for name, identity in self.ids.items()}
        return RelayRequest(
            step=self.step,
            attempt=0,
            digest=self.digest,
            sender=key[sender],
            receiver=key[receiver],
            lane=0,
            role=role,  # type: ignore[arg-type]
            relay=key["relay"],
        )

    async def ask(self, identity: NodeIdentity, request: RelayRequest) -> tuple:
        return await open_relayed(identity, self.members[0], request=request, timeout=5.0)


def test_a_relay_splices_the_two_ends_of_an_edge_and_counts_what_it_copies(tmp_path: Path) -> None:
    async def main() -> None:
        swarm = await Swarm(tmp_path).start()
        try:
            (r0, w0), (r1, w1) = await asyncio.gather(
                swarm.ask(swarm.ids["home0"], swarm.request("send")),
                swarm.ask(swarm.ids["home1"], swarm.request("accept")),
            )
            assert swarm.server.relay.active == 1
            payload = bytes(range(256)) * 4096  # 1 MiB each way, at once
            w0.write(payload)
            w1.write(payload[::-1])
            got0, got1 = await asyncio.gather(r1.readexactly(len(payload)), r0.readexactly(len(payload)))
            assert got0 == payload and got1 == payload[::-1]
            w0.close()  # one end hangs up: the other sees the end of its stream
            assert await asyncio.wait_for(r1.read(), 5) == b""
            w1.close()
            await asyncio.wait_for(swarm.server.relay.drained(10), 10)
            assert swarm.server.relay.active == 0
            assert swarm.server.relay.bytes_relayed == 2 * len(payload)
        finally:
            await swarm.server.close()

    asyncio.run(main())


async def refusal(swarm: Swarm, header: dict) -> str:
    """Send one relay request as `header` and return the relay's reason for refusing it."""
    reader, writer = await asyncio.open_connection(swarm.members[0].host, swarm.members[0].port)
    try:
        await write_frame(writer, header)
        answer = await read_frame(reader, swarm.setup_timeout + 5, 0)
        assert answer.kind == "refuse", answer.header
        return str(answer.header["reason"])
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("signed by the other end", "not signed by"),
        ("a stranger's own edge", "two members of the step"),
        ("an end that can be dialed", "needs no relay"),
        ("another relay named", "names another relay"),
        ("not this edge's relay", "not that edge's relay"),
        ("an older step", "no attempt of step"),
        ("another membership", "no attempt of step"),
        ("junk fields", "malformed relay request"),
        ("a lane beyond comm.connections", "lane 1 of 1"),
    ],
)
def test_a_relay_request_that_does_not_hold_is_refused_with_its_reason(
    tmp_path: Path, case: str, reason: str
) -> None:
    """Every such request gets a one-line reason at once, and nothing is spliced."""

    async def main() -> None:
        swarm = await Swarm(tmp_path, reachable=3).start()
        try:
            request = swarm.request("send")
            identity = swarm.ids["home0"]
            header = None
            if case == "signed by the other end":
                header = {**request.header(identity), "signature": swarm.ids["home1"].sign(request.message())}
            elif case == "a stranger's own edge":
                identity = load_or_create_identity(tmp_path / "stranger")
                request = replace(request, sender=identity.public_key)
            elif case == "an end that can be dialed":
                request = replace(request, receiver=swarm.ids["public0"].public_key)
            elif case == "another relay named":
                request = replace(request, relay=swarm.ids["public1"].public_key)
            elif case == "not this edge's relay":  # a step whose relay for the edge is a public member
                step = next(
                    step
                    for step in range(swarm.step + 1, swarm.step + 100)
                    if relay_for(step, swarm.members, sender=request.sender, receiver=request.receiver)
                    != swarm.members[0]
                )
                digest = membership_digest(step, swarm.members)
                swarm.server.relay.allow(step, digest, swarm.members)
                request = replace(request, step=step, digest=digest)
            elif case == "an older step":
                swarm.server.relay.allow(swarm.step + 1, swarm.digest, swarm.members)
                request = replace(request, digest=bytes(32))
            elif case == "another membership":
                request = replace(request, digest=bytes(32))
            elif case == "a lane beyond comm.connections":
                request = replace(request, lane=1)
            elif case == "junk fields":
                header = {**request.header(identity), "lane": -1, "step": "7"}
            started = time.monotonic()
            assert reason in await refusal(swarm, header or request.header(identity))
            # refused at once; a membership of the newest step that may yet come waits for it (bounded)
            bound = swarm.setup_timeout + 2 if case == "another membership" else 2.0
            assert time.monotonic() - started < bound
            assert swarm.server.relay.active == 0 and swarm.server.relay.edges_relayed == 0
        finally:
            await swarm.server.close()

    asyncio.run(main())


def test_an_end_whose_partner_never_asks_is_told_who_did_not_come(tmp_path: Path) -> None:
    async def main() -> None:
        swarm = await Swarm(tmp_path, setup_timeout=1.0).start()
        try:
            with pytest.raises(RelayRefused, match="did not ask") as refused:
                await swarm.ask(swarm.ids["home0"], swarm.request("send"))
            assert refused.value.absent == swarm.ids["home1"].public_key
            # the same end twice is no pair: the second is refused, the first still waits
            first = asyncio.create_task(swarm.ask(swarm.ids["home1"], swarm.request("accept")))
            await settle(lambda: swarm.server.relay.waiting_ends == 1, "the first end waits")
            with pytest.raises(RelayRefused, match="asked already"):
                await swarm.ask(swarm.ids["home1"], swarm.request("accept"))
            with pytest.raises(RelayRefused, match="did not ask") as refused:
                await first
            assert refused.value.absent == swarm.ids["home0"].public_key
            # the partner asks under another membership (it elected differently): the waiting end
            # is told at once, and no one is blamed
            waiting = asyncio.create_task(swarm.ask(swarm.ids["home0"], swarm.request("send")))
            await settle(lambda: swarm.server.relay.waiting_ends == 1, "the end waits")
            other = replace(swarm.request("accept"), digest=bytes(32))
            with pytest.raises(RelayRefused):
                await swarm.ask(swarm.ids["home1"], other)
            with pytest.raises(RelayRefused, match="another attempt or membership") as refused:
                await asyncio.wait_for(waiting, 0.5)  # at once, not after the partner's timeout
            assert refused.value.views_differ and refused.value.absent is None
            assert refused.value.attempt is None  # another membership: no attempt to take over
            # the same membership, attempts apart: the end behind learns the other's attempt at
            # once, whichever of the two came first
            ahead = asyncio.create_task(
                swarm.ask(swarm.ids["home0"], replace(swarm.request("send"), attempt=2))
            )
            await settle(lambda: swarm.server.relay.waiting_ends == 1, "the end ahead waits")
            with pytest.raises(RelayRefused, match="is at attempt 2") as refused:
                await swarm.ask(swarm.ids["home1"], swarm.request("accept"))
            assert refused.value.views_differ and refused.value.attempt == 2
            assert swarm.server.relay.waiting_ends == 1  # the one ahead still waits for its partner
            (_, w0), (_, w1) = await asyncio.gather(
                ahead, swarm.ask(swarm.ids["home1"], replace(swarm.request("accept"), attempt=2))
            )
            w0.close()
            w1.close()
            behind = asyncio.create_task(swarm.ask(swarm.ids["home0"], swarm.request("send")))
            await settle(lambda: swarm.server.relay.waiting_ends == 1, "the end behind waits")
            newer = replace(swarm.request("accept"), attempt=3)
            later = asyncio.create_task(swarm.ask(swarm.ids["home1"], newer))
            with pytest.raises(RelayRefused, match="another attempt") as refused:
                await asyncio.wait_for(behind, 5)
            assert refused.value.attempt == 3
            await discard(later)
        finally:
            await swarm.server.close()

    asyncio.run(main())


def test_what_a_relay_copies_is_capped(tmp_path: Path) -> None:
    """At relay_mbps 8 (1 MB/s) 3 MB cannot pass in much less than 3 s, however fast the machine."""

    async def main() -> None:
        swarm = await Swarm(tmp_path, relay_mbps=8.0).start()
        try:
            (_, w0), (r1, w1) = await asyncio.gather(
                swarm.ask(swarm.ids["home0"], swarm.request("send")),
                swarm.ask(swarm.ids["home1"], swarm.request("accept")),
            )
            started = time.monotonic()
            w0.write(bytes(3_000_000))
            await r1.readexactly(3_000_000)
            elapsed = time.monotonic() - started
            w0.close()
            w1.close()
            assert elapsed >= 3.0 - RateCap.BURST_S - 0.05, elapsed
        finally:
            await swarm.server.close()

    asyncio.run(main())


def test_an_edges_relay_is_one_reachable_member_that_every_member_computes_alike() -> None:
    keys = [bytes([i]) * 32 for i in range(8)]
    members = [
        Member(key=key, host="10.0.0.1", port=7000 + i, weight=1.0, reachable=i < 3)
        for i, key in enumerate(keys)
    ]
    chosen = {relay_for(step, members, sender=keys[5], receiver=keys[6]) for step in range(60)}
    assert chosen <= set(members[:3]) and len(chosen) == 3  # spread over the reachable members
    assert relay_for(3, members[::-1], sender=keys[5], receiver=keys[6]) == relay_for(
        3, members, sender=keys[5], receiver=keys[6]
    )
    assert relay_for(3, members[3:], sender=keys[5], receiver=keys[6]) is None
    with pytest.raises(WireError, match="none can relay"):
        route(
            3, 0, digest=bytes(32), members=members[3:], sender=keys[5], receiver=keys[6], lane=0, role="send"
        )


def test_one_member_cannot_fill_the_relays_waiting_room(tmp_path: Path) -> None:
    """A member behind NAT asking for edges nobody pairs (every attempt number it likes) holds at
    most its share of the requests waiting for a partner; the others' still wait."""

    async def main() -> None:
        swarm = await Swarm(tmp_path, setup_timeout=20.0).start()
        try:
            asks = [
                asyncio.create_task(swarm.ask(swarm.ids["home0"], replace(swarm.request("send"), attempt=n)))
                for n in range(MAX_PER_SIGNER)
            ]
            await settle(lambda: swarm.server.relay.waiting_ends == MAX_PER_SIGNER, "its requests wait")
            with pytest.raises(RelayRefused, match="of that node wait already"):
                await swarm.ask(swarm.ids["home0"], replace(swarm.request("send"), attempt=99))
            other = asyncio.create_task(
                swarm.ask(swarm.ids["home1"], replace(swarm.request("accept"), lane=0))
            )
            await settle(lambda: swarm.server.relay.waiting_ends == MAX_PER_SIGNER, "home1 pairs at once")
            _, w1 = await other  # home1's accept for attempt 0 met home0's waiting send
            _, w0 = await asks[0]
            w0.close()
            w1.close()
            await discard(*asks)
        finally:
            await swarm.server.close()

    asyncio.run(main())


def test_a_learned_attempt_number_moves_ours_a_bounded_step_at_a_time(tmp_path: Path) -> None:
    """A peer or a relay claiming attempt 2³¹ − 1 cannot send the step where no hello can follow."""

    async def main() -> None:
        server = DataPlaneServer(identity=load_or_create_identity(tmp_path / "n"), comm=CommConfig())
        server.learn_attempt(3, 2**31 - 1)
        assert server.expect(3, (), digest=bytes(32)).attempt == MAX_ATTEMPT_JUMP
        server.forget(3)
        server.learn_attempt(3, 2**31 - 1)
        assert (
            server.expect(3, (), digest=bytes(32)).attempt == 2 * MAX_ATTEMPT_JUMP + 1
        )  # one past, then 8 on

    asyncio.run(main())
