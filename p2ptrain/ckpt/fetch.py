"""Live recovery: a joining node downloads the swarm's current checkpoint from its peers.

1. From the signed heartbeats, take the checkpoint digest announced by a majority of the live
   members of the run (one peer alone cannot feed a poisoned state).
2. Fetch the manifest from a peer announcing that digest, and check it hashes to that digest.
3. Download the files in parallel, each from a different peer where there are several; a stalled
   peer, a dropped connection or a wrong hash moves that file on to the next peer, resuming from the
   bytes already there (HTTP Range). Every file's sha256 is checked; the shared files (θ_outer, the
   momentum) are thereby covered by the majority's digest.
4. Rename the finished folder into the checkpoint directory, so it is never seen half-written.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import yarl

from p2ptrain.ckpt.format import MANIFEST_FILE, SHARED_FILES, checkpoint_name
from p2ptrain.ckpt.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    file_sha256,
    parse_manifest,
)
from p2ptrain.comm.net.reach import sidecar_can_be_reached
from p2ptrain.errors import NetworkError
from p2ptrain.swarm.records import Heartbeat, NodeState

log = logging.getLogger(__name__)
CHUNK = 1 << 20
MIN_BYTES_PER_S = 16 << 10
"""The slowest a peer may send a checkpoint file or a result (128 kbit/s) before it is dropped."""
MANIFEST_TIMEOUT = 3.0
"""Seconds a holder has to send its manifest (a few KiB): one that cannot is not asked for files."""
ACTIVE = (NodeState.TRAINING, NodeState.READY, NodeState.SYNCING, NodeState.FINISHED)
"""Members of a run, and holders of its state: nodes that train, and nodes that finished it."""


class RecoveryError(NetworkError):
    """No peer could provide a verified copy of the swarm's checkpoint."""


def majority_checkpoint(
    heartbeats: Sequence[Heartbeat], me: bytes, config_digest: str
) -> tuple[str, list[Heartbeat]] | None:
    """(digest, the peers announcing it that can be reached) when more than half of the live
    members announce one digest. A node whose sidecar cannot be reached (behind NAT) counts in the
    vote but is no source."""
    members = [
        b for b in heartbeats if b.node_key != me and b.state in ACTIVE and b.config_digest == config_digest
    ]
    announced = [b for b in members if b.ckpt_digest and b.ckpt_addr]
    if not announced:
        return None
    digest, count = Counter(b.ckpt_digest for b in announced).most_common(1)[0]
    if 2 * count <= len(members):
        return None
    return digest, [b for b in announced if b.ckpt_digest == digest and checkpoint_source(b)]


def checkpoint_source(beat: Heartbeat) -> bool:
    """The node serves its checkpoints and results where others can fetch them: it announces a
    sidecar that peers could reach when they probed it (or, never probed, a data port they could)."""
    return fetchable(beat.ckpt_addr) and sidecar_can_be_reached(beat.ckpt_reach, beat.data_reach)


def fetchable(address: str) -> bool:
    """An http(s) URL with a host aiohttp can ask for. A record may carry any string of its
    length: a host label over 63 characters raised UnicodeError out of a joiner's recovery."""
    try:
        url = yarl.URL(address)
        if url.scheme not in ("http", "https") or not url.raw_host or url.port is None:
            return False
        url.raw_host.encode("idna")
    except ValueError:  # UnicodeError among them
        return False
    return True


def stall_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """No bound on a whole transfer (files are large), only on a peer that goes silent."""
    return aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)


async def read_body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or its first limit + 1 bytes if longer (the caller's parser then refuses it).

    `content.read(n)` returns what has arrived, possibly less than n: a body split across TCP
    segments must be read in a loop."""
    body, floor = bytearray(), RateFloor(MANIFEST_TIMEOUT)
    while len(body) <= limit:
        piece = await response.content.read(limit + 1 - len(body))
        if not piece:
            break
        floor.took(len(piece))
        body += piece
    return bytes(body)


class TooSlow(asyncio.TimeoutError):
    """A peer sends, but slower than MIN_BYTES_PER_S."""


class RateFloor:
    """Ends a transfer whose peer sends less than MIN_BYTES_PER_S over a window of `window`
    seconds. The stall timeout catches a peer that goes silent; one that sent a byte a second never
    tripped it and held a joiner's recovery (or the replay of a result) for good."""

    def __init__(self, window: float):
        self.window = window
        self.since = time.monotonic()
        self.got = 0

    def took(self, count: int) -> None:
        self.got += count
        elapsed = time.monotonic() - self.since
        if elapsed >= self.window:
            if self.got < MIN_BYTES_PER_S * elapsed:
                raise TooSlow(
                    f"{self.got / elapsed:.0f} bytes/s over {elapsed:.0f} s, under {MIN_BYTES_PER_S}"
                )
            self.since, self.got = time.monotonic(), 0


async def _get_manifest(session: aiohttp.ClientSession, url: str, digest: str) -> Manifest | None:
    try:
        within = aiohttp.ClientTimeout(total=MANIFEST_TIMEOUT)
        async with session.get(f"{url}/manifest", params={"digest": digest}, timeout=within) as response:
            if response.status != 200:
                log.warning("recovery: %s answered %d for its manifest", url, response.status)
                return None
            manifest = parse_manifest(await read_body(response, MAX_MANIFEST_BYTES))
    except (aiohttp.ClientError, asyncio.TimeoutError, ManifestError, ValueError) as exc:
        log.warning("recovery: no usable manifest from %s (%s)", url, exc)
        return None
    if manifest.digest != digest:
        log.warning("recovery: %s serves step %d, not the majority's checkpoint", url, manifest.outer_step)
        return None
    return manifest


def _within(manifest: Manifest, max_bytes: int | None, url: str) -> bool:
    total = sum(entry.size for entry in manifest.files.values())
    if max_bytes is None or total <= max_bytes:
        return True
    log.warning(
        "recovery: %s announces %d bytes of files, more than a checkpoint holds (%d)", url, total, max_bytes
    )
    return False


async def _download(
    session: aiohttp.ClientSession, url: str, *, manifest: Manifest, digest: str, name: str, target: Path
) -> None:
    """Fetch (the rest of) one file into `target`; raises on any problem with this peer."""
    expected = manifest.files[name]
    offset = target.stat().st_size if target.exists() else 0
    if offset > expected.size:
        target.unlink()
        offset = 0
    headers = {"Range": f"bytes={offset}-"} if 0 < offset < expected.size else {}
    resumed = bool(headers)
    if resumed:
        log.info("recovery: resuming %s from %s at byte %d", name, url, offset)
    if offset < expected.size:
        async with session.get(f"{url}/ckpt/{manifest.outer_step}/{name}", headers=headers) as response:
            if response.status not in (200, 206):
                raise RecoveryError(f"HTTP {response.status}")
            if response.headers.get("X-Checkpoint-Digest") != digest:
                raise RecoveryError("serves another checkpoint now")
            if response.status == 200:
                offset, resumed = 0, False  # the peer ignored the range: start over
            floor = RateFloor(session.timeout.sock_read or MANIFEST_TIMEOUT)
            with target.open("r+b" if offset else "wb") as handle:
                handle.seek(offset)
                async for block in response.content.iter_chunked(CHUNK):
                    floor.took(len(block))
                    offset += len(block)
                    if offset > expected.size:
                        raise RecoveryError("sent more bytes than the manifest says")
                    handle.write(block)
    if offset != expected.size:
        raise RecoveryError(f"stopped at {offset} of {expected.size} bytes")
    if await asyncio.to_thread(file_sha256, target) != expected.sha256:
        target.unlink()
        raise (
            MixedCopy("sha256 mismatch of a copy resumed here")
            if resumed
            else RecoveryError("sha256 mismatch")
        )


class MixedCopy(RecoveryError):
    """A copy of several peers' bytes failed its hash: whose bytes were wrong is unknown."""


async def _download_whole(
    session: aiohttp.ClientSession, url: str, *, manifest: Manifest, digest: str, name: str, target: Path
) -> None:
    """`_download`; a resumed copy that fails its hash comes again from this peer alone, from the
    start. Resumed copies alone, a peer that sent a few wrong bytes (or trickled) before each
    honest peer's turn failed every copy of the file."""
    try:
        await _download(session, url, manifest=manifest, digest=digest, name=name, target=target)
    except MixedCopy as exc:
        log.warning("recovery: %s (%s): all of it from %s", name, exc, url)
        await _download(
            session, url, manifest=manifest, digest=digest, name=name, target=target
        )  # unlinked: from byte 0


async def _fetch_set(
    session: aiohttp.ClientSession,
    urls: list[str],
    *,
    source: str,
    manifest: Manifest,
    digest: str,
    staging: Path,
) -> None:
    """Every file of `manifest` into `staging`, in parallel; raises RecoveryError naming the first loss."""

    async def fetch_one(index: int, name: str) -> None:
        # θ_outer and the momentum are the same bytes on every holder, so any of them serves them;
        # the rest (AdamW state, meta) is the manifest's own node's, and only it can serve that
        sources = urls if name in SHARED_FILES else [source]
        problems = []
        for attempt in range(2 * len(sources)):  # every peer, twice: a second try resumes the bytes
            url = sources[(index + attempt) % len(sources)]
            try:
                await _download_whole(
                    session, url, manifest=manifest, digest=digest, name=name, target=staging / name
                )
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, RecoveryError, OSError, ValueError) as exc:
                log.warning("recovery: %s from %s failed (%s); trying the next peer", name, url, exc)
                problems.append(f"{url}: {exc}")
        raise RecoveryError(f"{name}: no peer delivered a verified copy ({problems[-1]})")

    tasks = [asyncio.ensure_future(fetch_one(i, name)) for i, name in enumerate(sorted(manifest.files))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        # one file lost ends the set: the others stop here, before the next holder's set starts
        # writing the same staging files (a download left running wrote into them after they were
        # verified, and into the renamed folder)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    lost = [error for task in tasks if not task.cancelled() and (error := task.exception()) is not None]
    if lost:
        raise lost[0]


async def _fetch_from(
    session: aiohttp.ClientSession,
    urls: list[str],
    *,
    source: str,
    manifest: Manifest,
    digest: str,
    dest_dir: Path,
) -> Path:
    """The files of `source`'s manifest into dest_dir/step-N, renamed into place when all are verified."""
    staging = dest_dir / f".{checkpoint_name(manifest.outer_step)}.download"
    staging.mkdir(parents=True, exist_ok=True)
    for stale in staging.iterdir():
        if stale.name not in SHARED_FILES:
            stale.unlink()  # another node's own files: not this manifest's
    await _fetch_set(session, urls, source=source, manifest=manifest, digest=digest, staging=staging)
    (staging / MANIFEST_FILE).write_text(manifest.to_json())
    final = dest_dir / checkpoint_name(manifest.outer_step)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


async def fetch_checkpoint(
    digest: str, holders: Sequence[Heartbeat], *, dest_dir: Path, timeout: float, max_bytes: int | None = None
) -> Path:
    """Download the checkpoint with `digest` from `holders` into dest_dir/step-N; returns its path.

    Every holder is asked for its manifest at once, within MANIFEST_TIMEOUT: only those that
    answered (a frozen or far-away holder does not, and would stall every file it is asked for) serve
    the files. Then one holder's manifest (and its node-specific files) at a time; if that holder
    fails, the next one's, keeping the shared files already verified. A manifest whose files add up
    to more than `max_bytes` (what a checkpoint of this model can hold) is a lie and is not used: the
    digest covers the shared files' hashes, not their sizes, and a holder once made a joiner write
    terabytes before any hash was checked."""
    if not holders:
        raise RecoveryError(
            f"checkpoint {digest[:12]} is held only by nodes nobody can reach (behind NAT); one of them "
            "must open its ckpt_port (and set node.ckpt_announce) or a reachable node must hold it"
        )
    client_timeout = stall_timeout(timeout)
    urls = [holder.ckpt_addr.rstrip("/") for holder in holders]
    last_problem = "no peer served the majority's checkpoint manifest"
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        answers = await asyncio.gather(*(_get_manifest(session, url, digest) for url in urls))
        manifests = {
            url: manifest
            for url, manifest in zip(urls, answers, strict=True)
            if manifest and _within(manifest, max_bytes, url)
        }
        responsive = list(manifests)
        for source, manifest in manifests.items():
            try:
                return await _fetch_from(
                    session, responsive, source=source, manifest=manifest, digest=digest, dest_dir=dest_dir
                )
            except RecoveryError as exc:
                last_problem = str(exc)
    raise RecoveryError(f"checkpoint {digest[:12]} not recovered from {len(urls)} peer(s): {last_problem}")
