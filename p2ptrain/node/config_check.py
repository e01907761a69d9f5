"""Refusing, with one line, to train in a run whose members mostly use other settings.

Checked when a node joins and again before every outer step: a node's first read of the DHT may not
show the others yet, and a node of another config is never elected with them, so it would otherwise
train alone beside the run. The line says which settings differ, read from a member's sidecar.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

import aiohttp

from p2ptrain.ckpt.fetch import ACTIVE, read_body
from p2ptrain.config import Config, config_differences
from p2ptrain.errors import UserError
from p2ptrain.swarm.membership import live
from p2ptrain.swarm.records import Heartbeat

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 1 << 16
"""A member's /config answer is a stranger's bytes: read at most this many."""


class ConfigMismatch(UserError):
    """This node's shared settings differ from those of the run's live members."""


async def refuse_other_settings(config: Config, me: bytes, heartbeats: list[Heartbeat]) -> None:
    """Raise ConfigMismatch when a strict majority of the other active nodes share another digest."""
    others = [b for b in live(heartbeats) if b.node_key != me and b.state in ACTIVE and b.config_digest]
    if not others:
        return
    majority, count = Counter(b.config_digest for b in others).most_common(1)[0]
    if majority == config.digest() or 2 * count <= len(others):
        return
    holder = next(b for b in others if b.config_digest == majority)
    differences = await fetch_config_differences(holder.ckpt_addr, config.shared())
    detail = "; ".join(differences[:3]) if differences else "its settings digest differs from the swarm's"
    raise ConfigMismatch(f"run {config.run.id!r} trains with other settings: {detail}")


async def fetch_config_differences(url: str, mine: dict[str, Any]) -> list[str]:
    """What differs between `mine` and the settings a member's sidecar reports ([] if unreachable)."""
    if not url:
        return []
    try:
        timeout = aiohttp.ClientTimeout(total=5)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{url}/config") as response,
        ):
            theirs = json.loads(await read_body(response, MAX_CONFIG_BYTES))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError) as exc:
        # a peer's answer: JSON nested past the parser's depth is refused like any other junk
        reason = "nested too deep" if isinstance(exc, RecursionError) else exc
        log.warning("could not read the swarm's settings from %s: %s", url, reason)
        return []
    return config_differences(mine, theirs) if isinstance(theirs, dict) else []
