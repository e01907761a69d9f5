"""Checkpoint sharing over real HTTP on 127.0.0.1: manifests, the sidecar, and majority-checked fetches."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web

from p2ptrain.ckpt import fetch
from p2ptrain.ckpt.fetch import RecoveryError, fetch_checkpoint, majority_checkpoint
from p2ptrain.ckpt.format import SHARED_FILES, checkpoint_name
from p2ptrain.ckpt.manifest import FileEntry, Manifest, ManifestError, build_manifest, parse_manifest
from p2ptrain.ckpt.replay import fetch_result
from p2ptrain.ckpt.sidecar import CheckpointSidecar
from p2ptrain.rate import RateCap
from p2ptrain.swarm.records import Heartbeat, NodeState
from p2ptrain.web.server import ConnectionBudget, start_app
from tests.support.records import record

STEP = 7
T = TypeVar("T")
SHARED = os.urandom(3 << 20)  # θ_outer: the same bytes on every member


def make_checkpoint(root: Path, node: int, step: int = STEP) -> Path:
    folder = root / "checkpoints" / checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / "params.safetensors").write_bytes(SHARED if step == STEP else os.urandom(1000))
    (folder / "outer.safetensors").write_bytes(SHARED[:1000])
    (folder / "inner.safetensors").write_bytes(bytes([node]) * 5000)  # each node's own
    (folder / "meta.json").write_text(json.dumps({"node": node, "outer_step": step}))
    return folder


def heartbeat(
    node: int, url: str, *, digest: str, config: str = "c", state: NodeState = NodeState.TRAINING
) -> Heartbeat:
    return record(
        node,
        state=state,
        outer_step=STEP,
        ckpt_addr=url if "://" in url or not url else f"http://{url}:8080",
        ckpt_digest=digest,
        config_digest=config,
    )


class Peers:
    """Nodes' sidecars on 127.0.0.1, each serving its own checkpoints folder."""

    def __init__(self) -> None:
        self.sidecars: list[CheckpointSidecar] = []
        self.urls: list[str] = []

    async def add(self, root: Path, node: int, *, step: int = STEP, cap: float = 0.0) -> tuple[str, str]:
        folder = make_checkpoint(root, node, step)
        manifest = build_manifest(folder, step)
        sidecar = CheckpointSidecar(root / "checkpoints", serve_bytes_per_s=cap)
        sidecar.announce(manifest)
        port = await sidecar.start("127.0.0.1", 0)
        self.sidecars.append(sidecar)
        self.urls.append(f"http://127.0.0.1:{port}")
        return self.urls[-1], manifest.digest

    async def close(self) -> None:
        for sidecar in self.sidecars:
            await sidecar.close()


def run(coroutine: Coroutine[Any, Any, T]) -> T:  # a tiny wrapper for the async tests
    return asyncio.run(coroutine)


def test_manifest_parsing_refuses_bad_input(tmp_path: Path) -> None:
    good = build_manifest(make_checkpoint(tmp_path, 1), STEP)
    assert parse_manifest(good.to_json().encode()) == good
    raw = json.loads(good.to_json())
    entry = raw["files"]["params.safetensors"]
    bad_cases = {
        "not JSON": b"{nope",
        "traversal": json.dumps({**raw, "files": {"../../etc/passwd": entry}}).encode(),
        "a folder": json.dumps({**raw, "files": {"a/b": entry}}).encode(),
        "hidden": json.dumps({**raw, "files": {".bashrc": entry}}).encode(),
        "negative size": json.dumps({**raw, "files": {"x": {**entry, "size": -1}}}).encode(),
        "bad sha": json.dumps({**raw, "files": {"x": {**entry, "sha256": "zz"}}}).encode(),
        "wrong digest": json.dumps({**raw, "digest": "0" * 64}).encode(),
        "step is bool": json.dumps({**raw, "outer_step": True}).encode(),
        "huge": b" " * (1 << 17),
    }
    for what, data in bad_cases.items():
        with pytest.raises(ManifestError):
            parse_manifest(data)
            pytest.fail(what)


def test_sidecar_serves_ranges_and_only_manifest_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "secret.txt").write_text("not for you")

    async def scenario() -> None:
        peers = Peers()
        empty = CheckpointSidecar(tmp_path / "nothing")
        port = await empty.start("127.0.0.1", 0)
        try:
            url, _ = await peers.add(tmp_path, 1)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/manifest") as response:
                    assert response.status == 404
                async with session.get(f"{url}/manifest") as response:
                    assert parse_manifest(await response.read()).outer_step == STEP
                headers = {"Range": "bytes=1000-1999"}
                async with session.get(f"{url}/ckpt/{STEP}/params.safetensors", headers=headers) as response:
                    assert response.status == 206
                    assert await response.read() == SHARED[1000:2000]
                refused = [f"/ckpt/{STEP}/..%2Fsecret.txt", f"/ckpt/{STEP}/manifest.json", f"/ckpt/{STEP}/x"]
                for path in [
                    *refused,
                    "/ckpt/3/params.safetensors",
                    "/ckpt/-1/params.safetensors",
                    "/ckpt/%C2%B2/params.safetensors",  # '²' passes str.isdigit, not int()
                    "/delta/%C2%B2",
                ]:
                    async with session.get(url + path) as response:
                        assert response.status == 404, path
                        assert "not for you" not in await response.text()
        finally:
            await peers.close()
            await empty.close()

    with caplog.at_level(logging.WARNING, logger="p2ptrain.ckpt.sidecar"):
        run(scenario())
    # each refusal is logged, but a burst of them in one line (untrusted.ThrottledLog): a flood of
    # bad requests cannot fill the disk; the rest are counted in one line when the sidecar closes
    refused = [record.getMessage() for record in caplog.records if "refused" in record.getMessage()]
    assert len(refused) == 2, refused
    assert "more like it" not in refused[0] and "(and 5 more like it in the last" in refused[1], refused


JUNK_CLIENT = """
import socket, sys
port = int(sys.argv[1])
probes = [
    b"GARBAGE\\r\\n\\r\\n",
    b"GET / HTTP/1.1\\r\\nX-A: " + b"a" * 20000 + b"\\r\\n\\r\\n",
    b"\\x16\\x03\\x01\\x02\\x00\\x01\\x00\\x01\\xfc\\x03\\x03" + bytes(64),
    b"GET /manifest HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: -5\\r\\n\\r\\n",
    b"POST /manifest HTTP/1.1\\r\\nHost: x\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\nzz\\r\\n",
]
for _ in range(20):
    for probe in probes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(probe)
            assert sock.recv(64).startswith(b"HTTP/1.0 400"), probe[:20]
"""


@pytest.mark.procs
def test_malformed_http_from_a_stranger_is_one_throttled_line_not_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A separate process sends 100 requests that are not HTTP (junk, a header line past 8 KiB, a
    TLS hello, a bad Content-Length, a bad chunk): each is answered 400, the log holds no traceback
    and at most a line per 10 s with a count, and the sidecar serves an honest client after."""

    async def scenario() -> None:
        peers = Peers()
        try:
            url, _ = await peers.add(tmp_path, 1)
            port = url.rsplit(":", 1)[1]
            junk = await asyncio.create_subprocess_exec(sys.executable, "-c", JUNK_CLIENT, port)
            assert await asyncio.wait_for(junk.wait(), 120) == 0
            async with aiohttp.ClientSession() as session, session.get(f"{url}/manifest") as response:
                assert parse_manifest(await response.read()).outer_step == STEP
        finally:
            await peers.close()

    with caplog.at_level(logging.DEBUG, logger="aiohttp"), caplog.at_level(logging.INFO, logger="p2ptrain"):
        run(scenario())
    shown = [record for record in caplog.records if record.levelno >= logging.INFO]
    assert not [record for record in shown if record.exc_info], "a traceback in the log"
    said = [record.getMessage() for record in shown if "Error handling request" in record.getMessage()]
    assert 1 <= len(said) <= 3 and all("\n" not in line for line in said), said
    assert "more like it" in said[-1], said  # the rest counted, said at close


def test_majority_of_live_members_decides() -> None:
    beats = [
        heartbeat(1, "u1", digest="D1"),
        heartbeat(2, "u2", digest="D1"),
        heartbeat(3, "u3", digest="D2"),
    ]
    majority = majority_checkpoint(beats, me=bytes([9]) * 32, config_digest="c")
    assert majority is not None
    digest, holders = majority
    assert digest == "D1" and [h.ckpt_addr for h in holders] == ["http://u1:8080", "http://u2:8080"]
    assert majority_checkpoint(beats[1:], me=bytes([9]) * 32, config_digest="c") is None  # 1 vs 1
    # a member without a checkpoint yet still counts against a minority digest
    assert majority_checkpoint([*beats[:1], heartbeat(4, "", digest="")], bytes([9]) * 32, "c") is None
    others = [
        heartbeat(5, "u5", digest="D3", config="other"),
        heartbeat(6, "u6", digest="D3", state=NodeState.DEAD),
    ]
    assert majority_checkpoint(others, bytes([9]) * 32, "c") is None
    assert (
        majority_checkpoint([heartbeat(9, "u9", digest="D9")], bytes([9]) * 32, "c") is None
    )  # not from myself


def test_a_holder_behind_nat_votes_but_is_no_source(tmp_path: Path) -> None:
    """Its record says nobody can dial it: it counts for the majority, is never asked, and where
    only such nodes hold the checkpoint the joiner says so in one line instead of timing out."""
    behind = dataclasses.replace(heartbeat(2, "u2", digest="D1"), data_reach="closed")
    majority = majority_checkpoint([heartbeat(1, "u1", digest="D1"), behind], bytes([9]) * 32, "c")
    assert majority is not None
    digest, holders = majority
    assert digest == "D1" and [h.ckpt_addr for h in holders] == ["http://u1:8080"]
    found = majority_checkpoint([behind], bytes([9]) * 32, "c")
    assert found is not None and found[1] == []
    # the sidecar's own probe decides where there was one: a forwarded sidecar port behind NAT is a
    # source, a blocked sidecar beside an open data port is not
    forwarded = dataclasses.replace(behind, ckpt_reach="open")
    blocked = dataclasses.replace(heartbeat(3, "u3", digest="D1"), ckpt_reach="closed")
    majority = majority_checkpoint([forwarded, blocked], bytes([9]) * 32, "c")
    assert majority is not None
    digest, holders = majority
    assert [h.ckpt_addr for h in holders] == ["http://u2:8080"]
    with pytest.raises(RecoveryError, match="nobody can reach"):
        asyncio.run(fetch_checkpoint("D1", [], dest_dir=tmp_path / "joiner", timeout=5))


@pytest.mark.parametrize(
    "address", [f"http://{'x' * 64}:8080", f"http://a.{'b' * 300}", "ftp://u1:21", "http://[::1", "u1"]
)
def test_a_holder_whose_address_cannot_be_asked_is_no_source(tmp_path: Path, address: str) -> None:
    """A record may carry any string there: a host label over 63 characters raised UnicodeError
    out of a joiner's recovery and out of the replay of a result. Such a holder still votes."""
    odd = dataclasses.replace(heartbeat(2, "u2", digest="D1"), ckpt_addr=address)
    found = majority_checkpoint([odd, heartbeat(1, "u1", digest="D1")], bytes([9]) * 32, "c")
    assert found is not None and [h.ckpt_addr for h in found[1]] == ["http://u1:8080"]
    assert asyncio.run(fetch_result([address], STEP, limit=1000, timeout=1.0)) is None
    with pytest.raises(RecoveryError):
        asyncio.run(fetch_checkpoint("D1", [odd], dest_dir=tmp_path / "joiner", timeout=1.0))


def test_a_capped_sidecar_serves_files_and_ranges_no_faster_than_its_cap(tmp_path: Path) -> None:
    """node.serve_mbps: 3 MiB at 2 MB/s cannot come in much less than 1.5 s, however fast the machine;
    ranges (a resumed download) and the whole checkpoint come through intact."""

    async def scenario() -> tuple[float, Path]:
        peers = Peers()
        try:
            url, digest = await peers.add(tmp_path / "peer", 1, cap=2e6)
            async with aiohttp.ClientSession() as session:
                file = f"{url}/ckpt/{STEP}/params.safetensors"
                async with session.get(file, headers={"Range": f"bytes={len(SHARED) - 1000}-"}) as response:
                    assert response.status == 206
                    assert (
                        response.headers["Content-Range"]
                        == f"bytes {len(SHARED) - 1000}-{len(SHARED) - 1}/{len(SHARED)}"
                    )
                    assert await response.read() == SHARED[-1000:]
                async with session.get(file, headers={"Range": "bytes=1000-1999"}) as response:
                    assert response.status == 206 and await response.read() == SHARED[1000:2000]
                for bad in (f"bytes={len(SHARED) + 5}-", "bytes=x-y"):
                    async with session.get(file, headers={"Range": bad}) as response:
                        assert response.status in (404, 416), bad
            started = time.monotonic()
            folder = await fetch_checkpoint(
                digest, [heartbeat(1, url, digest=digest)], dest_dir=tmp_path / "joiner", timeout=5
            )
            return time.monotonic() - started, folder
        finally:
            await peers.close()

    elapsed, folder = run(scenario())
    assert (folder / "params.safetensors").read_bytes() == SHARED
    assert (folder / "inner.safetensors").read_bytes() == bytes([1]) * 5000
    assert elapsed >= len(SHARED) / 2e6 - RateCap.BURST_S - 0.05, elapsed


def test_tampered_copy_is_refused_and_fetched_elsewhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> Path:
        peers = Peers()
        try:
            for node in (1, 2, 3):
                _, digest = await peers.add(tmp_path / f"peer{node}", node)
            tampered = tmp_path / "peer1" / "checkpoints" / checkpoint_name(STEP) / "params.safetensors"
            tampered.write_bytes(b"\xff" + SHARED[1:])  # same size, one byte changed
            holders = [heartbeat(n, url, digest=digest) for n, url in zip((1, 2, 3), peers.urls, strict=True)]
            return await fetch_checkpoint(digest, holders, dest_dir=tmp_path / "joiner", timeout=5)
        finally:
            await peers.close()

    with caplog.at_level(logging.WARNING, logger="p2ptrain.ckpt.fetch"):
        folder = run(scenario())
    assert folder == tmp_path / "joiner" / checkpoint_name(STEP)
    assert (folder / "params.safetensors").read_bytes() == SHARED
    assert (folder / "inner.safetensors").read_bytes() == bytes([1]) * 5000  # the manifest's node's own
    assert any("sha256 mismatch" in record.message for record in caplog.records)
    assert not list((tmp_path / "joiner").glob(".*"))  # no staging folder left behind


class HalfwayPeer:
    """A holder that announces the good node's checkpoint and serves the good node's manifest, but
    sends half of a file and then does what `after_half(request, name)` does (stall, or drop the
    connection), unless that returns False: then it sends the rest."""

    def __init__(self, good: Path, digest: str, after_half: Callable[[web.Request, str], Awaitable[bool]]):
        self.folder = good / "checkpoints" / checkpoint_name(STEP)
        self.digest = digest
        self.after_half = after_half
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/manifest", self._manifest)
        app.router.add_get("/ckpt/{step}/{name}", self._file)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        assert isinstance(site._server, asyncio.Server)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _manifest(self, request: web.Request) -> web.Response:
        return web.Response(text=(self.folder / "manifest.json").read_text(), content_type="application/json")

    async def _file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        data = (self.folder / name).read_bytes()
        response = web.StreamResponse(headers={"X-Checkpoint-Digest": self.digest})
        response.content_length = len(data)
        await response.prepare(request)
        await response.write(data[: len(data) // 2])
        if not await self.after_half(request, name):
            await response.write(data[len(data) // 2 :])
        return response


def drop(request: web.Request) -> bool:
    assert request.transport is not None
    request.transport.close()  # as if the peer were killed halfway
    return True


@pytest.mark.parametrize("failure", ["stalls", "drops the connection"])
def test_download_resumes_elsewhere_after_a_peer_fails_halfway(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    """A peer that stops sending in the middle of the file: the rest comes from another, by Range."""

    async def scenario() -> Path:
        peers = Peers()
        released = asyncio.Event()
        good_url, digest = await peers.add(tmp_path / "good", 1)

        async def fail(request: web.Request, name: str) -> bool:
            if failure == "stalls":
                await released.wait()  # then nothing, until the test ends
                return True
            return drop(request)

        halfway = HalfwayPeer(tmp_path / "good", digest, fail)
        try:
            holders = [
                heartbeat(2, await halfway.start(), digest=digest),
                heartbeat(1, good_url, digest=digest),
            ]
            return await fetch_checkpoint(digest, holders, dest_dir=tmp_path / "joiner", timeout=1.0)
        finally:
            released.set()
            await halfway.close()
            await peers.close()

    with caplog.at_level(logging.INFO, logger="p2ptrain.ckpt.fetch"):
        folder = run(scenario())
    assert (folder / "params.safetensors").read_bytes() == SHARED
    assert (folder / "outer.safetensors").read_bytes() == SHARED[:1000]
    assert (folder / "inner.safetensors").read_bytes() == bytes([1]) * 5000  # the good node's set
    resumed = [r.message for r in caplog.records if "resuming" in r.message]
    assert any("at byte" in message and not message.endswith(" 0") for message in resumed), resumed


def test_a_holder_whose_set_is_lost_leaves_none_of_its_downloads_running(tmp_path: Path) -> None:
    """The first holder's own files are lost (it drops them halfway) while it sends a shared file
    slowly. That download must end with the holder's set, before the next holder's set writes the
    same staging files: left running, it wrote into them after they were verified (seen on a busy
    machine: a joiner with a wrong θ_outer)."""
    asked: Counter[str] = Counter()

    async def scenario() -> tuple[Path, list[str]]:
        peers = Peers()
        released = asyncio.Event()
        good_url, digest = await peers.add(tmp_path / "good", 1)

        async def lose_own_files_and_stall_shared_ones(request: web.Request, name: str) -> bool:
            asked[name] += 1
            if name not in SHARED_FILES:
                return drop(request)
            if asked[name] == 1:
                await released.wait()  # the first request of each shared file stalls (for 30 s)
                return True
            return False  # later ones are served in full

        halfway = HalfwayPeer(tmp_path / "good", digest, lose_own_files_and_stall_shared_ones)
        try:
            holders = [
                heartbeat(2, await halfway.start(), digest=digest),
                heartbeat(1, good_url, digest=digest),
            ]
            folder = await fetch_checkpoint(digest, holders, dest_dir=tmp_path / "joiner", timeout=30.0)
            return folder, running_in(fetch)
        finally:
            released.set()
            await halfway.close()
            await peers.close()

    folder, running = run(scenario())
    assert running == []
    assert asked["outer.safetensors"] == 2  # stalled in the first holder's set, served in the next
    assert (folder / "params.safetensors").read_bytes() == SHARED
    assert (folder / "outer.safetensors").read_bytes() == SHARED[:1000]
    assert (folder / "inner.safetensors").read_bytes() == bytes([1]) * 5000  # the good node's set


def running_in(module: ModuleType) -> list[str]:
    """The tasks of this event loop still running a coroutine of `module`."""
    return [
        repr(task)
        for task in asyncio.all_tasks()
        if not task.done()
        and getattr(getattr(task.get_coro(), "cr_code", None), "co_filename", "") == module.__file__
    ]


def test_a_peer_serving_an_older_step_is_skipped(tmp_path: Path) -> None:
    async def scenario() -> Path:
        peers = Peers()
        try:
            old_url, _ = await peers.add(tmp_path / "old", 1, step=STEP - 1)
            new_url, digest = await peers.add(tmp_path / "new", 2)
            holders = [heartbeat(1, old_url, digest=digest), heartbeat(2, new_url, digest=digest)]
            return await fetch_checkpoint(digest, holders, dest_dir=tmp_path / "joiner", timeout=5)
        finally:
            await peers.close()

    folder = run(scenario())
    assert json.loads((folder / "meta.json").read_text())["node"] == 2

    async def nobody() -> None:
        peers = Peers()
        try:
            url, _ = await peers.add(tmp_path / "other", 3, step=STEP - 1)
            await fetch_checkpoint(
                "0" * 64, [heartbeat(3, url, digest="0" * 64)], dest_dir=tmp_path / "j2", timeout=5
            )
        finally:
            await peers.close()

    with pytest.raises(RecoveryError, match="not recovered"):
        run(nobody())


def test_a_joiner_gets_the_checkpoint_it_chose_though_its_holders_saved_a_newer_one(tmp_path: Path) -> None:
    """The majority's digest is read from heartbeats; by the time the joiner asks, the holders may
    have announced the next checkpoint. They still serve the one named (while it is in RAM)."""

    async def scenario() -> None:
        peers = Peers()
        try:
            url, digest = await peers.add(tmp_path / "peer", 1)
            newer = make_checkpoint(tmp_path / "peer", 1, STEP + 1)
            peers.sidecars[0].announce(build_manifest(newer, STEP + 1))
            folder = await fetch_checkpoint(
                digest, [heartbeat(1, url, digest=digest)], dest_dir=tmp_path / "joiner", timeout=5.0
            )
            assert folder.name == checkpoint_name(STEP)
            assert (folder / "params.safetensors").read_bytes() == SHARED
            for step in (STEP + 2, STEP + 3):  # two newer ones: the first is no longer kept
                peers.sidecars[0].announce(build_manifest(make_checkpoint(tmp_path / "peer", 1, step), step))
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{url}/manifest", params={"digest": digest}) as response,
            ):
                assert response.status == 404
        finally:
            await peers.close()

    asyncio.run(scenario())


def test_a_download_evicted_while_its_reader_stalls_leaves_the_sidecar_answering(tmp_path: Path) -> None:
    """A stranger asks for a file and stops reading; newer connections evict it from the full
    budget. Served with sendfile, the eviction left asyncio watching its closed descriptor, and
    the next connection given that descriptor was never answered."""

    async def scenario() -> list[bytes]:
        folder = tmp_path / checkpoint_name(STEP)
        folder.mkdir()
        (folder / "params.safetensors").write_bytes(os.urandom(16 << 20))
        sidecar = CheckpointSidecar(tmp_path)
        sidecar.announce(build_manifest(folder, STEP))
        served, port = await start_app(
            sidecar._app, "127.0.0.1", port=0, budget=ConnectionBudget(total=2, per_source=1)
        )
        loop = asyncio.get_running_loop()

        async def raw(source: str) -> socket.socket:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.bind((source, 0))
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            return sock

        stalled = await raw("127.0.0.2")
        await loop.sock_sendall(
            stalled, f"GET /ckpt/{STEP}/params.safetensors HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        )
        await asyncio.sleep(0.5)  # it never reads: the sidecar is in the middle of the file
        newer = [await raw("127.0.0.3"), await raw("127.0.0.4")]  # the second evicts the stalled one
        await asyncio.sleep(0.5)
        for sock in [*newer, stalled]:
            sock.close()
        await asyncio.sleep(0.5)
        answers = []
        try:
            for index in range(4):
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(f"127.0.0.{10 + index}", 0)
                )
                writer.write(b"GET /manifest HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    answers.append(await asyncio.wait_for(reader.read(12), 5))
                except asyncio.TimeoutError:
                    answers.append(b"no answer")
                writer.close()
        finally:
            await served.close()
        return answers

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [b"HTTP/1.1 200"] * 4


@pytest.mark.parametrize("lie", ["inflated sizes", "a byte a second"])
def test_a_holder_that_lies_about_sizes_or_trickles_is_dropped_for_an_honest_one(
    tmp_path: Path, lie: str
) -> None:
    """A stranger's sidecar announces the majority's digest and comes first. "inflated sizes": its
    manifest keeps the digest (it covers the shared files' hashes, not their sizes) and says
    params.safetensors is 1 TiB; the joiner wrote until its disk was full. "a byte a second": its
    manifest is true, its files come a byte a second, which never tripped the stall timeout."""

    async def scenario() -> tuple[Path, float, int]:
        peers = Peers()
        url, digest = await peers.add(tmp_path / "honest", 1)
        honest = build_manifest(tmp_path / "honest" / "checkpoints" / checkpoint_name(STEP), STEP)
        files = dict(honest.files)
        if lie == "inflated sizes":
            files["params.safetensors"] = FileEntry(1 << 40, honest.files["params.safetensors"].sha256)
        forged = Manifest(STEP, files)
        assert forged.digest == digest

        async def manifest(request: web.Request) -> web.Response:
            return web.Response(text=forged.to_json(), content_type="application/json")

        async def file(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"X-Checkpoint-Digest": digest})
            await response.prepare(request)
            while True:  # zeros as fast as it can, or a byte a second
                await response.write(bytes(1 << 20) if lie == "inflated sizes" else b"x")
                await asyncio.sleep(0 if lie == "inflated sizes" else 1.0)

        app = web.Application()
        app.router.add_get("/manifest", manifest)
        app.router.add_get("/ckpt/{step}/{name}", file)
        served, port = await start_app(app, "127.0.0.1", port=0)
        holders = [heartbeat(0, f"http://127.0.0.1:{port}", digest=digest), heartbeat(1, url, digest=digest)]
        started, joiner = time.monotonic(), tmp_path / "joiner"
        try:
            folder = await fetch_checkpoint(digest, holders, dest_dir=joiner, timeout=2.0, max_bytes=64 << 20)
        finally:
            await served.close()
            await peers.close()
        written = sum(path.stat().st_size for path in joiner.rglob("*") if path.is_file())
        return folder, time.monotonic() - started, written

    folder, seconds, written = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert (folder / "params.safetensors").read_bytes() == SHARED
    assert (folder / "inner.safetensors").read_bytes() == bytes([1]) * 5000  # the honest node's set
    assert written < 8 << 20 and seconds < 30
