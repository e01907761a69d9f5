"""What a node's ready record says beyond its fields: the slow links it measured, which the
elections use to order the ring (election.py), and the members it names for a step (evidence.py)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from p2ptrain.swarm.election import LINK_PREFIX_HEX, LINKS_FIELD
from p2ptrain.swarm.evidence import BLAME_FIELD, blame_field

MAX_PUBLISHED_LINKS = 16
"""Slow links a node keeps in its heartbeat (~30 bytes each; records stay far below 16 KiB)."""


class RecordExtras:
    def __init__(self) -> None:
        self.links: dict[bytes, float] = {}
        """Receiver key → bytes/s of our slow links, latest measurement; published when ready."""

    def remember_links(self, rates: Mapping[bytes, float]) -> None:
        for key, rate in rates.items():
            self.links.pop(key, None)
            if math.isfinite(rate):
                self.links[key] = rate  # the newest last, so the oldest go first below
        while len(self.links) > MAX_PUBLISHED_LINKS:
            self.links.pop(next(iter(self.links)))

    def extra_for(
        self, current: Mapping[str, Any], step: int, *, named: Collection[bytes], report: bool = False
    ) -> dict[str, Any]:
        """The `current` extra fields with our slow links and the members we name for `step`:
        `report` after a failed attempt, even if we name no one."""
        extra = {key: value for key, value in current.items() if key not in (LINKS_FIELD, BLAME_FIELD)}
        if named or report:
            extra[BLAME_FIELD] = blame_field(step, named)
        if self.links:
            extra[LINKS_FIELD] = {
                key.hex()[:LINK_PREFIX_HEX]: round(rate) for key, rate in self.links.items()
            }
        return extra
