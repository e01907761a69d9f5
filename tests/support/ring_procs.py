"""Members of a ring all-reduce, each in its own process with its own sockets (spawned, stopped by PID)."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.comm.codec import sparse
from p2ptrain.comm.net.attempt import AllReduceError
from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce import allreduce
from p2ptrain.comm.reduce.allreduce import all_reduce
from p2ptrain.comm.reduce.barrier import ToSuccessor
from p2ptrain.comm.reduce.gather import WITNESS_BYTES, GatherPlan, share_statement
from p2ptrain.comm.reduce.plan import ReducePlan, ReduceStats
from p2ptrain.comm.reduce.transfer import Slots
from p2ptrain.comm.robust import claims, clipping
from p2ptrain.comm.transport import lanes
from p2ptrain.config import CommConfig
from p2ptrain.identity import load_or_create_identity
from p2ptrain.procs import free_port

STEP = 11
"""The step every run_ring all-reduces."""


@dataclass(kw_only=True)
class Outcome:
    index: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    failed_at: float = 0.0
    """time.time() when the error was raised, to bound detection time."""
    link_rates: dict[int, float] | None = None
    """Peer index → bytes/s this member measured sending to it (ReduceStats.link_rates)."""
    attempts: int = 1
    bytes_sent: int = 0
    relayed: int = 0
    """Bytes this member copied for edges between two others behind NAT (relay.py)."""
    named: int = -1
    """The member its last error named (AllReduceError.unresponsive), -1 for none."""
    clipped: dict[int, int] | None = None
    """Robust aggregation: member index → chunks of this member's segment its share was clipped in."""
    left_out: dict[int, int] | None = None
    """Robust aggregation: member index → chunks in which its share counted at under half its weight."""
    rebound: int = 0
    """Kept lanes this member re-bound to a later step, at either end (transport/resume.py)."""


def member_data(index: int, length: int, outlier: bool, correlated: bool = False) -> np.ndarray:
    """Member `index`'s input: independent normal values; `correlated`: a direction every member
    shares plus its own noise (as pseudo-gradients of one run agree)."""
    data = np.random.default_rng(1000 + index).standard_normal(length).astype(np.float32)
    if correlated:
        data = np.random.default_rng(999).standard_normal(length).astype(np.float32) + np.float32(0.7) * data
    if outlier and length > 10:
        data[:: max(1, length // 4)][:4] = 100.0  # a few values at 100 sigma
    return data


@dataclass(frozen=True, kw_only=True)
class MemberSpec:
    """What one member process of `run_ring` is told."""

    index: int
    root: str
    length: int
    outlier: bool
    correlated: bool
    comm: CommConfig
    setup_timeout: float
    step: int
    fault: str | None
    fault_after: float
    """The fault's number: a frame count, milliseconds, a factor (a scale's may be a fraction)."""
    retries: int
    steps: int


def _member(spec: MemberSpec, inbox: Any, outbox: Any) -> None:
    index, length, step = spec.index, spec.length, spec.step
    fault, fault_after = spec.fault, spec.fault_after

    async def main() -> None:
        identity = load_or_create_identity(Path(spec.root) / f"id{index}")
        server = DataPlaneServer(identity=identity, comm=spec.comm, setup_timeout=spec.setup_timeout)
        host, port = await server.start()
        outbox.put(("address", index, identity.public_key, host, port))
        members = await asyncio.get_running_loop().run_in_executor(None, inbox.get)
        if fault == "vanish":  # elected, then gone before dialing anyone: its port refuses
            die(outbox)
        buffer = member_data(index, length, spec.outlier, spec.correlated)
        frames = 0

        def progress(phase: str, rnd: int, chunk: int) -> None:
            nonlocal frames
            frames += 1
            if fault == "kill" and frames >= fault_after:
                die(outbox)
            if fault == "stall" and frames >= fault_after:
                time.sleep(3600)  # a hung process: nothing moves, the sockets stay open
            if fault == "slow":
                time.sleep(fault_after / 1000)  # reads one frame per fault_after ms: a slow link into us

        if fault in ("nan", "inf"):
            buffer[length // 2] = np.nan if fault == "nan" else -np.inf
        if fault in ("scale", "lying_owner", "low_claims"):  # a poisoner: fault_after times its own
            buffer *= np.float32(fault_after)
        if fault in (
            "lying_owner",
            "low_claims",
            "tamper_forward",
            "withhold_last",
            "forge_barrier",
            "malformed_share",
            "equivocate",
            "equivocate_unsigned",
            "bad_testimony",
        ):
            lie(fault, int(fault_after))
        if fault == "freeze_at_barrier":
            freeze_at_barrier()
        if fault == "slow_send":
            send_slowly(fault_after)

        async def one_step(step: int, buffer: np.ndarray, attempts: int) -> tuple[ReduceStats | None, int]:
            """Step `step`'s all-reduce, tried up to spec.retries times in all; (None, …) once the
            failure is reported."""
            while True:
                attempts += 1
                # "stale_view": the first fault_after attempts elect another order (another digest),
                # as a node whose view of the ready records lags; every member retries at once.
                view = members[::-1] if fault == "stale_view" and attempts <= fault_after else members
                try:
                    stats = await all_reduce(
                        server, step=step, members=view, buffer=buffer, progress=progress
                    )
                    return stats, attempts
                except AllReduceError as exc:
                    if attempts >= spec.retries:
                        named = [m.key for m in members].index(exc.unresponsive) if exc.unresponsive else -1
                        outcome = Outcome(
                            index=index,
                            ok=False,
                            error=str(exc),
                            seconds=time.monotonic() - started,
                            failed_at=time.time(),
                            attempts=attempts,
                            named=named,
                        )
                        outbox.put(("done", outcome))
                        return None, attempts

        started = time.monotonic()
        attempts = 0
        stats: ReduceStats | None = None
        try:
            for offset in range(spec.steps):
                if offset:
                    buffer = member_data(index, length, spec.outlier, spec.correlated)
                    between_steps(fault, server)
                stats, attempts = await one_step(step + offset, buffer, attempts)
                if stats is None:
                    return
        finally:
            await server.close()
        assert stats is not None
        np.save(Path(spec.root) / f"result{index}.npy", buffer)
        keys = [member.key for member in members]
        rates = {keys.index(key): rate for key, rate in stats.link_rates.items()}
        outcome = Outcome(
            index=index,
            ok=True,
            seconds=time.monotonic() - started,
            link_rates=rates,
            attempts=attempts,
            bytes_sent=stats.bytes_sent,
            relayed=server.relay.bytes_relayed,
            clipped={keys.index(key): count for key, count in stats.clipped.items()},
            left_out={keys.index(key): count for key, count in stats.left_out.items()},
            rebound=server.warm.rebound,
        )
        outbox.put(("done", outcome))

    asyncio.run(main())


def between_steps(fault: str | None, server: DataPlaneServer) -> None:
    """Before each step after the first: "drop_kept" closes every lane this member kept (its peers'
    rebinds find them closed); "junk_on_kept" sends bytes that are no frame on the lanes it dialed
    and kept (its peers must drop those lanes, and nothing else)."""
    if fault == "drop_kept":
        server.warm.close()
    if fault == "junk_on_kept":
        for lane in list(server.warm._lanes.values()):
            if lane.session.dialed:
                lane.sock.sendall(b"\x00junk" * 64)


def die(outbox: Any) -> None:
    """SIGKILL this member, but only once its queue's feeder thread has let go of the queue's write
    lock, which every member shares: a member killed between writing its address and releasing
    that lock (a busy machine can leave the thread unscheduled that long) would hold it forever,
    and the survivors' outcomes would never reach the test."""
    outbox.close()
    outbox.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def send_slowly(rate: float) -> None:
    """Send this member's data frames at `rate` bytes/s, a small piece at a time: a slow uplink
    (its frames keep moving), so that the others' frames which depend on them come late."""
    send = lanes.send_frame

    class Trickle:
        def __init__(self, sock: socket.socket):
            self.sock = sock

        def setsockopt(self, *args: Any) -> None:
            self.sock.setsockopt(*args)

        def sendmsg(self, views: list[memoryview]) -> int:
            piece = b"".join(bytes(view) for view in views)[: max(1, int(rate / 8))]
            time.sleep(len(piece) / rate)
            return self.sock.sendmsg([piece])

    def slowly(channel: lanes.Channel, header: Mapping[str, Any], **kwargs: Any) -> None:
        if header.get("kind") in ("rs", "ag"):
            channel = lanes.Channel(Trickle(channel.sock), channel.seal)  # type: ignore[arg-type]
        send(channel, header, **kwargs)

    lanes.send_frame = slowly


def freeze_at_barrier() -> None:
    """Stop this process (SIGSTOP: a frozen machine) once every data frame of its is in and out,
    before it sends its set of holders."""
    check = ReducePlan.check_results

    def frozen(plan: Any) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)
        check(plan)

    ReducePlan.check_results = frozen  # type: ignore[method-assign,assignment]


def lie(fault: str, factor: int) -> None:
    """Make this process a dishonest member of a robust all-reduce (comm.robust), as an attacker
            would run modified code: "lying_owner" sums its segment without clipping; "low_claims" claims
            norms `factor` times smaller than its values; "tamper_forward" changes a byte of every chunk of
            the all-gather it passes on (the owner's signature then no longer matches). Against the
            completion barrier, two accomplices among `factor` members (ring topology): "withhold_last"
            never sends its successor the chunks of its last all-gather round, "forge_barrier" sends its
            successor a set naming every member, its own signatures junk, as soon as its data are in.
            Under the sparse codec (gather.py): "malformed_share" sends a share whose first chunk repeats
            an index, "equivocate" sends member `factor` a share with one byte changed and signs both,
        "equivocate_unsigned" the same with the honest share's signature, "bad_testimony" shows its
    successor a testimony whose signatures are junk."""
    if fault == "bad_testimony":
        GatherPlan.testimony = lambda self: bytes(WITNESS_BYTES * self.n)  # type: ignore[method-assign]
        return
    if fault == "malformed_share":
        honest_encode = sparse.encode

        def malformed(*args: Any, **kwargs: Any) -> bytearray:
            share = honest_encode(*args, **kwargs)
            share[8:11] = b"\x00\x00\x00"  # the first two indices of chunk 0 are both 0
            return share

        sparse.encode = malformed
        return
    if fault in ("equivocate", "equivocate_unsigned"):
        honest_outgoing, honest_send = GatherPlan._outgoing, GatherPlan.send_lane
        honest_signature = GatherPlan._signature
        sending_to = threading.local()  # each sending thread serves one peer

        def other_share(self: GatherPlan) -> bytearray:
            share = bytearray(self.shares[self.index])
            share[0] ^= 0x40  # the first chunk's lo magnitude: a well-formed, other share
            return share

        def send_lane(self: GatherPlan, peer: int, lane: int, channel: Any) -> None:
            sending_to.peer = peer
            honest_send(self, peer, lane, channel)

        def two_faced(self: GatherPlan, spec: Any, scratch: bytearray, channel: Any) -> tuple[Any, None]:
            payload, _ = honest_outgoing(self, spec, scratch, channel)
            if sending_to.peer == factor and spec[1] == 0:
                start, stop = spec[3], spec[4]
                payload = other_share(self)[self._range(start, stop)]
            return payload, None

        def signs_both(self: GatherPlan, spec: Any) -> bytes | None:
            signature = honest_signature(self, spec)
            if signature is None or sending_to.peer != factor or fault == "equivocate_unsigned":
                return signature
            other = hashlib.sha256(other_share(self)).digest()
            return self.identity.sign(share_statement(self.digest, other))

        GatherPlan._outgoing = two_faced  # type: ignore[method-assign]
        GatherPlan.send_lane = send_lane  # type: ignore[method-assign,assignment]
        GatherPlan._signature = signs_both  # type: ignore[method-assign]
        return
    if fault == "lying_owner":

        def unclipped(
            arrived: dict[int, np.ndarray],
            fractions: Sequence[float],
            limits: Sequence[float] | np.ndarray,
            *,
            reweighted: bool,
            reference: np.ndarray | None = None,
        ) -> clipping.RobustSum:
            return clipping.RobustSum(np.asarray(np.sum(list(arrived.values()), axis=0, dtype=np.float32)))

        clipping.robust_sum = unclipped
    elif fault == "low_claims":
        honest = claims.chunk_norms
        claims.chunk_norms = lambda values, bounds: honest(values, bounds) / factor
    elif fault == "withhold_last":
        put = Slots.put

        def withheld(self: Slots, key: tuple[str, int, int], payload: Any, spare: Any = None) -> None:
            if key[:2] != ("ag", factor - 2):
                put(self, key, payload, spare)

        Slots.put = withheld  # type: ignore[method-assign]
    elif fault == "forge_barrier":

        def forged(*args: Any, **kwargs: Any) -> None:
            everyone = ((1 << factor) - 1).to_bytes((factor + 7) // 8, "little")
            header = {"kind": "done", "step": STEP, "holders": everyone, "proofs": bytes(64 * factor)}
            next(arg for arg in (*args, *kwargs.values()) if isinstance(arg, ToSuccessor)).send(header)

        allreduce.await_every_holder = forged  # type: ignore[attr-defined]
    else:
        put = Slots.put

        def tampered(self: Slots, key: tuple[str, int, int], payload: Any, spare: Any = None) -> None:
            if key[0] == "ag" and key[1] > 0:  # a chunk we received and now pass on
                payload = bytearray(payload)
                payload[0] ^= 0xFF
            put(self, key, payload, spare)

        Slots.put = tampered  # type: ignore[method-assign]


def run_ring(
    root: Path,
    n: int,
    length: int,
    *,
    weights: list[float] | None = None,
    outlier: bool = False,
    correlated: bool = False,
    comm: CommConfig | None = None,
    setup_timeout: float = 30.0,
    faults: Mapping[int, tuple[str, float]] | None = None,
    timeout: float = 60.0,
    retries: int = 1,
    proxy: Callable[[str, int], tuple[str, int]] | None = None,
    proxied: int = -1,
    behind_nat: frozenset[int] = frozenset(),
    steps: int = 1,
) -> tuple[dict[int, Outcome], dict[int, np.ndarray], list[np.ndarray]]:
    """Run one all-reduce over `n` member processes (`steps`: that many steps in a row, the same
    inputs each time); returns outcomes, the last step's results and the inputs.

    With `retries` > 1 each member tries again at once after an AllReduceError, as OuterSync does.
    `proxy(host, port)` puts something on the path to member `proxied`: the others reach it at the
    address it returns. Members in `behind_nat` are listed as unreachable, at an address where
    nobody listens: the all-reduce completes only if nobody dials them.
    """
    context = mp.get_context("spawn")
    outbox = context.Queue()
    inboxes = [context.Queue() for _ in range(n)]
    comm = comm or CommConfig(chunk_bytes=1 << 16)
    faults = faults or {}
    specs = [
        MemberSpec(
            index=i,
            root=str(root),
            length=length,
            outlier=outlier,
            correlated=correlated,
            comm=comm,
            setup_timeout=setup_timeout,
            step=STEP,
            fault=faults.get(i, (None, 0))[0],
            fault_after=faults.get(i, (None, 0))[1],
            retries=retries,
            steps=steps,
        )
        for i in range(n)
    ]
    processes = [
        context.Process(target=_member, args=(spec, inboxes[spec.index], outbox), daemon=True)
        for spec in specs
    ]
    for process in processes:
        process.start()
    try:
        addresses: dict[int, tuple[bytes, str, int]] = {}
        while len(addresses) < n:
            _, index, key, host, port = outbox.get(timeout=timeout)
            addresses[index] = (key, host, port)
        weights = weights or [1.0] * n
        if proxy is not None:
            key, host, port = addresses[proxied]
            addresses[proxied] = (key, *proxy(host, port))
        for index in behind_nat:
            key, host, _ = addresses[index]
            addresses[index] = (key, host, free_port())
        members = [
            Member(
                key=addresses[i][0],
                host=addresses[i][1],
                port=addresses[i][2],
                weight=weights[i],
                reachable=i not in behind_nat,
            )
            for i in range(n)
        ]
        for inbox in inboxes:
            inbox.put(members)
        outcomes: dict[int, Outcome] = {}
        gone = ("kill", "stall", "vanish", "freeze_at_barrier")
        expected = n - sum(1 for kind, _ in faults.values() if kind in gone)
        deadline = time.monotonic() + timeout
        while len(outcomes) < expected and time.monotonic() < deadline:
            try:
                _, outcome = outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                break
            outcomes[outcome.index] = outcome
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    results = {i: np.load(root / f"result{i}.npy") for i, outcome in outcomes.items() if outcome.ok}
    inputs = [member_data(i, length, outlier, correlated) for i in range(n)]
    return outcomes, results, inputs


BUDGET = 0.01


def weighted_mean(inputs: list[np.ndarray], weights: list[float]) -> np.ndarray:
    fractions = shares_of(weights)
    mean = sum(f * x.astype(np.float64) for f, x in zip(fractions, inputs, strict=True))
    assert isinstance(mean, np.ndarray), "no inputs"
    return mean


def shares_of(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights] if total else [1 / len(weights)] * len(weights)


def relative_error(result: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(result - exact) / np.linalg.norm(exact))
