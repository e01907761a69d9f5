"""The checkpoint sidecar: each node serves its latest checkpoints over HTTP (aiohttp).

    GET /config                the run settings every member shares (to explain a digest mismatch)
    GET /manifest              the manifest of the newest checkpoint (404 before the first one);
                               `?digest=D`: of the kept checkpoint with that digest (a joiner that
                               read D from a heartbeat just before this node saved a newer one)
    GET /ckpt/{step}/{name}    one file of checkpoint step-N; Range requests work, so a download
                               can resume and be split across peers; all of them together at most
                               `node.serve_mbps` (0: no cap), so a joiner's download leaves the
                               node's own all-reduce its share of the uplink
    GET /delta/{step}          the encoded all-reduce result of outer step N, while kept in RAM
                               (ckpt/replay.py)
    GET /reach/{nonce}         a peer's dial-back probe of this sidecar (comm/reach.py): 204

Only files listed in that checkpoint's own manifest.json are served, and only from inside its
folder: a request for anything else (`../`, another name) gets 404 and a log line.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from p2ptrain.ckpt.format import MANIFEST_FILE, STAGED_KEEP, checkpoint_name
from p2ptrain.ckpt.manifest import Manifest, ManifestError, parse_manifest
from p2ptrain.ckpt.replay import RecentResults
from p2ptrain.comm.net.reach import NONCE_BYTES
from p2ptrain.rate import RateCap
from p2ptrain.untrusted import ThrottledLog, decimal, lower_hex
from p2ptrain.web.server import Served, start_app

log = logging.getLogger(__name__)
SERVE_BLOCK = 1 << 18
"""Bytes read and sent at a time: a cap's bursts stay short, and 256 connections that stop
reading hold 64 MiB of blocks at most."""


class CheckpointSidecar:
    def __init__(
        self,
        checkpoint_dir: Path,
        shared_config: dict[str, Any] | None = None,
        *,
        results: RecentResults | None = None,
        reach_proof: Callable[[bytes], None] | None = None,
        serve_bytes_per_s: float = 0.0,
    ):
        self.checkpoint_dir = checkpoint_dir
        self.cap = RateCap(serve_bytes_per_s) if serve_bytes_per_s > 0 else None
        """Shared by every checkpoint file this sidecar sends (None: at full speed)."""
        self.reach_proof = reach_proof
        """Called with the nonce of a peer's dial-back GET (comm/reach.py): our sidecar can be reached."""
        self.shared_config = shared_config or {}
        self.results = results or RecentResults(0)
        self.latest: Manifest | None = None
        self._kept: OrderedDict[str, Manifest] = OrderedDict()
        """Manifests of the checkpoints still in RAM, by digest, oldest first."""
        self._served: Served | None = None
        self._refusals = ThrottledLog(log)
        self._misses = ThrottledLog(log, level=logging.INFO)
        """Results asked for that this node does not keep (any more, or yet): routine in every join."""
        app = web.Application()
        app.router.add_get("/manifest", self._manifest)
        app.router.add_get("/config", self._config)
        app.router.add_get("/ckpt/{step}/{name}", self._file)
        app.router.add_get("/delta/{step}", self._delta)
        app.router.add_get("/reach/{nonce}", self._reach)
        self._app = app

    async def start(self, host: str, port: int) -> int:
        self._served, bound = await start_app(self._app, host, port=port)
        return bound

    async def close(self) -> None:
        if self._served is not None:
            await self._served.close()
        self._refusals.flush()
        self._misses.flush()

    def announce(self, manifest: Manifest) -> None:
        self.latest = manifest
        self._kept.pop(manifest.digest, None)
        self._kept[manifest.digest] = manifest
        while len(self._kept) > STAGED_KEEP:
            self._kept.popitem(last=False)

    async def _reach(self, request: web.Request) -> web.Response:
        """A prober's GET with the nonce we gave it: proof that others can reach this sidecar."""
        text = request.match_info["nonce"]
        if len(text) != 2 * NONCE_BYTES or not lower_hex(text):
            return self._refuse(request, "a reachability nonce is 32 hex digits")
        if self.reach_proof is not None:
            self.reach_proof(bytes.fromhex(text))
        return web.Response(status=204)

    async def _config(self, request: web.Request) -> web.Response:
        return web.json_response(self.shared_config)

    async def _manifest(self, request: web.Request) -> web.Response:
        wanted = request.query.get("digest")
        manifest = self._kept.get(wanted) if wanted else self.latest
        if manifest is None:
            raise web.HTTPNotFound(text="no such checkpoint kept" if wanted else "no checkpoint yet")
        return web.Response(text=manifest.to_json(), content_type="application/json")

    async def _file(self, request: web.Request) -> web.StreamResponse:
        step, name = decimal(request.match_info["step"]), request.match_info["name"]
        if step is None:
            return self._refuse(request, "bad step")
        folder = self.checkpoint_dir / checkpoint_name(step)
        try:
            manifest = parse_manifest((folder / MANIFEST_FILE).read_bytes())
        except (OSError, ManifestError):
            return self._refuse(request, f"no checkpoint for step {step}")
        path = (folder / name).resolve()
        if name not in manifest.files or path.parent != folder.resolve() or not path.is_file():
            return self._refuse(request, f"{name!r} is not a file of checkpoint {step}")
        return await self._send_file(request, path, digest=manifest.digest, cap=self.cap)

    async def _send_file(
        self, request: web.Request, path: Path, *, digest: str, cap: RateCap | None
    ) -> web.StreamResponse:
        """`path` (or the range asked for) in blocks, each taken from the cap first (if any).
        Never sendfile: a connection the budget evicted in the middle of one (a stranger that stopped
        reading) left asyncio's selector watching a closed descriptor, and the next connection
        given that descriptor was never read."""
        size = path.stat().st_size
        try:
            wanted = request.http_range
        except ValueError:
            return self._refuse(request, "malformed Range header")
        start = wanted.start or 0
        start = max(0, size + start) if start < 0 else start
        stop = size if wanted.stop is None else min(wanted.stop, size)
        if start > stop or (start == stop and size):
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        partial = "Range" in request.headers
        response = web.StreamResponse(status=206 if partial else 200, headers={"X-Checkpoint-Digest": digest})
        response.content_length = stop - start
        if partial:
            response.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        await response.prepare(request)
        with path.open("rb") as handle:
            handle.seek(start)
            left = stop - start
            while left > 0:
                block = await asyncio.to_thread(handle.read, min(SERVE_BLOCK, left))
                if not block:
                    break  # the file shrank under us: the fetcher sees a short body and moves on
                if cap is not None:
                    await cap.take(len(block))
                await response.write(block)
                left -= len(block)
        await response.write_eof()
        return response

    async def _delta(self, request: web.Request) -> web.Response:
        step = decimal(request.match_info["step"])
        if step is None:
            return self._refuse(request, "bad step")
        packed = await asyncio.to_thread(self.results.packed, step)
        if packed is None:
            # a joiner asks every node past a step: one that dropped it already, or is still at it,
            # says so; normal in every join, so not a warning
            reason = f"no all-reduce result of step {step} kept"
            self._misses.warning("checkpoint sidecar: %s for %s", reason, request.remote)
            return web.Response(status=404, text=reason)
        return web.Response(body=packed, content_type="application/octet-stream")

    def _refuse(self, request: web.Request, reason: str) -> web.Response:
        self._refusals.warning(
            "checkpoint sidecar: refused %s from %s: %s", request.path[:200], request.remote, reason
        )
        return web.Response(status=404, text=reason)
