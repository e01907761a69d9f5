"""The checkpoint sidecar: each node serves its latest checkpoints over HTTP (aiohttp).

    GET /config                the run settings every member shares (to explain a digest mismatch)
    GET /manifest              the manifest of the newest checkpoint (404 before the first one);
                               `?digest=D`: of the kept checkpoint with that digest (a joiner that
                               read D from a heartbeat just before this node saved a newer one)
    GET /ckpt/{step}/{name}    one file of checkpoint step-N; Range requests work, so a download
                               can resume and be split across peers
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
from p2ptrain.comm.reach import NONCE_BYTES
from p2ptrain.untrusted import ThrottledLog, decimal
from p2ptrain.web.server import Served, start_app

log = logging.getLogger(__name__)


class CheckpointSidecar:
    def __init__(
        self,
        checkpoint_dir: Path,
        shared_config: dict[str, Any] | None = None,
        results: RecentResults | None = None,
        reach_proof: Callable[[bytes], None] | None = None,
    ):
        self.checkpoint_dir = checkpoint_dir
        self.reach_proof = reach_proof
        """Called with the nonce of a peer's dial-back GET (comm/reach.py): our sidecar can be reached."""
        self.shared_config = shared_config or {}
        self.results = results or RecentResults(0)
        self.latest: Manifest | None = None
        self._kept: OrderedDict[str, Manifest] = OrderedDict()
        """Manifests of the checkpoints still in RAM, by digest, oldest first."""
        self._served: Served | None = None
        self._refusals = ThrottledLog(log)
        app = web.Application()
        app.router.add_get("/manifest", self._manifest)
        app.router.add_get("/config", self._config)
        app.router.add_get("/ckpt/{step}/{name}", self._file)
        app.router.add_get("/delta/{step}", self._delta)
        app.router.add_get("/reach/{nonce}", self._reach)
        self._app = app

    async def start(self, host: str, port: int) -> int:
        self._served, bound = await start_app(self._app, host, port)
        return bound

    async def close(self) -> None:
        if self._served is not None:
            await self._served.close()

    def announce(self, manifest: Manifest) -> None:
        self.latest = manifest
        self._kept.pop(manifest.digest, None)
        self._kept[manifest.digest] = manifest
        while len(self._kept) > STAGED_KEEP:
            self._kept.popitem(last=False)

    async def _reach(self, request: web.Request) -> web.Response:
        """A prober's GET with the nonce we gave it: proof that others can reach this sidecar."""
        text = request.match_info["nonce"]
        if len(text) != 2 * NONCE_BYTES or not all(c in "0123456789abcdef" for c in text):
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
        return web.FileResponse(path, headers={"X-Checkpoint-Digest": manifest.digest})

    async def _delta(self, request: web.Request) -> web.Response:
        step = decimal(request.match_info["step"])
        packed = await asyncio.to_thread(self.results.packed, step) if step is not None else None
        if packed is None:
            return self._refuse(request, f"no all-reduce result of step {step} kept")
        return web.Response(body=packed, content_type="application/octet-stream")

    def _refuse(self, request: web.Request, reason: str) -> web.Response:
        self._refusals.warning(
            "checkpoint sidecar: refused %s from %s: %s", request.path[:200], request.remote, reason
        )
        return web.Response(status=404, text=reason)
