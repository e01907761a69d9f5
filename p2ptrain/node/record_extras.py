"""What a node's ready record says beyond its fields: the slow links it measured, which the
elections use to order the ring (election.py), its round trips (the status shows them), and the
members it names for a step (evidence.py)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from p2ptrain.comm.net.paths import PathBook
from p2ptrain.swarm.election import LINK_PREFIX_HEX, LINKS_FIELD
from p2ptrain.swarm.evidence import BLAME_FIELD, blame_field
from p2ptrain.swarm.records import ROUND_TRIPS_FIELD

MAX_PUBLISHED_LINKS = 16
"""Paths a node keeps in its heartbeat, of each kind (~30 bytes each; records stay below 4 KiB)."""


class RecordExtras:
    def __init__(self, paths: PathBook) -> None:
        self.paths = paths
        """What this node measured of its paths (the data port's, comm/net/paths.py): its slow
        links' rates (the elections order the ring by them) and its round trips (the status's)."""

    def extra_for(
        self, current: Mapping[str, Any], step: int, *, named: Collection[bytes], report: bool = False
    ) -> dict[str, Any]:
        """The `current` extra fields with our measured paths and the members we name for `step`:
        `report` after a failed attempt, even if we name no one."""
        extra = {
            key: value
            for key, value in current.items()
            if key not in (LINKS_FIELD, ROUND_TRIPS_FIELD, BLAME_FIELD)
        }
        if named or report:
            extra[BLAME_FIELD] = blame_field(step, named)
        return extra | self.path_fields()

    def path_fields(self) -> dict[str, Any]:
        """Our slow links' rates (bytes/s) and our round trips (ms), the newest of each, by peer
        key prefix; in every record the node publishes (the elections read the links of ready
        records only)."""
        fields: dict[str, Any] = {}
        if links := newest(self.paths.rates):
            fields[LINKS_FIELD] = {key.hex()[:LINK_PREFIX_HEX]: round(rate) for key, rate in links}
        if round_trips := newest(self.paths.round_trips):
            fields[ROUND_TRIPS_FIELD] = {
                key.hex()[:LINK_PREFIX_HEX]: round(1000 * seconds, 1) for key, seconds in round_trips
            }
        return fields


def newest(book: Mapping[bytes, float]) -> list[tuple[bytes, float]]:
    """The MAX_PUBLISHED_LINKS entries measured last (a PathBook keeps them in that order)."""
    return list(book.items())[-MAX_PUBLISHED_LINKS:]
