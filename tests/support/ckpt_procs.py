"""A checkpoint holder's sidecar and a joiner's download, each its own process, so that the internet
lab can run them in its hosts (and a test can SIGKILL a holder halfway through a transfer).

    python -m tests.support.ckpt_procs serve --checkpoints DIR --step N --host IP --url-file FILE
                                       [--mbps M]
    python -m tests.support.ckpt_procs fetch --digest HEX --holders URL[,URL...] --step N
                                       --dest DIR --out FILE [--timeout S]

`serve` announces DIR/step-N (a folder of a node's checkpoint files) on the real sidecar
(ckpt/sidecar.py), serving at most M Mbit/s (node.serve_mbps; 0: uncapped), and writes its URL to
FILE once it listens; it runs until SIGTERM. `fetch` runs
the joiner's real download (ckpt/fetch.py: fetch_checkpoint) from the holders in the order given,
logs what it does on stderr (its "resuming … at byte N" lines among them), and writes
{"folder": …, "seconds": …} to FILE when the checkpoint is in place, verified.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import time
from pathlib import Path

from p2ptrain.ckpt.fetch import fetch_checkpoint
from p2ptrain.ckpt.format import checkpoint_name
from p2ptrain.ckpt.manifest import build_manifest
from p2ptrain.ckpt.sidecar import CheckpointSidecar
from tests.support.records import record


async def serve(checkpoints: Path, step: int, host: str, url_file: Path, mbps: float) -> None:
    sidecar = CheckpointSidecar(checkpoints, serve_bytes_per_s=mbps * 1e6 / 8)
    sidecar.announce(build_manifest(checkpoints / checkpoint_name(step), step))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    port = await sidecar.start(host, 0)
    written = url_file.with_suffix(".tmp")
    written.write_text(f"http://{host}:{port}")
    written.rename(url_file)  # whole, or not there
    try:
        await stop.wait()
    finally:
        await sidecar.close()


async def fetch(digest: str, urls: list[str], step: int, dest: Path, out: Path, timeout: float) -> None:
    holders = [
        record(index, outer_step=step, ckpt_addr=url, ckpt_digest=digest)
        for index, url in enumerate(urls, start=1)
    ]
    started = time.monotonic()
    folder = await fetch_checkpoint(digest, holders, dest_dir=dest, timeout=timeout)
    out.write_text(json.dumps({"folder": str(folder), "seconds": round(time.monotonic() - started, 2)}))


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = args.add_subparsers(dest="command", required=True)
    serving = commands.add_parser("serve")
    serving.add_argument("--checkpoints", type=Path, required=True)
    serving.add_argument("--step", type=int, required=True)
    serving.add_argument("--host", required=True)
    serving.add_argument("--url-file", type=Path, required=True)
    serving.add_argument("--mbps", type=float, default=0.0)
    fetching = commands.add_parser("fetch")
    fetching.add_argument("--digest", required=True)
    fetching.add_argument("--holders", required=True, help="comma-separated URLs, tried in this order")
    fetching.add_argument("--step", type=int, required=True)
    fetching.add_argument("--dest", type=Path, required=True)
    fetching.add_argument("--out", type=Path, required=True)
    fetching.add_argument("--timeout", type=float, default=10.0)
    options = args.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options.command == "serve":
        asyncio.run(serve(options.checkpoints, options.step, options.host, options.url_file, options.mbps))
    else:
        urls = options.holders.split(",")
        asyncio.run(fetch(options.digest, urls, options.step, options.dest, options.out, options.timeout))


if __name__ == "__main__":
    main()
