"""Bytes that came from the network: decoded with every size bounded before it is allocated, and
refused with log lines that a flood of them cannot multiply; and who sent them, for budgets."""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import Any

import msgpack


class UndecodableError(ValueError):
    """The bytes are not msgpack within the given limits."""


def unpack_untrusted(data: bytes, max_bytes: int, max_items: int = 64) -> Any:
    """msgpack.unpackb with bounded strings, binaries, arrays and maps, and str map keys only.

    msgpack raises a handful of exception types on garbage; they all become UndecodableError.
    """
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_items,
            max_map_len=max_items,
        )
    except Exception as exc:
        raise UndecodableError(f"not msgpack ({type(exc).__name__})") from None


def decimal(text: str, max_digits: int = 12) -> int | None:
    """A non-negative integer written in ASCII digits (at most `max_digits`), else None.

    `str.isdigit` also accepts '²' or '٣', which `int` then refuses or reads as another number."""
    if not text or len(text) > max_digits or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def lower_hex(text: str) -> bool:
    """Only the digits 0-9a-f: how keys, prefixes and nonces are written (`bytes.hex`). Not
    `str.isalnum` nor `int(text, 16)`: those take other scripts' digits, upper case or '0x'."""
    return all(char in "0123456789abcdef" for char in text)


LOG_INTERVAL = 10.0


class ThrottledLog:
    """Logs the first of a kind of event, then at most once per `interval` with the count in between."""

    def __init__(
        self, logger: logging.Logger, interval: float = LOG_INTERVAL, *, level: int = logging.WARNING
    ):
        """`level`: WARNING for what a stranger (or a broken peer) does; INFO for what honest
        nodes cause in normal operation too."""
        self.logger = logger
        self.interval = interval
        self.level = level
        self._last = -1e9
        self._skipped = 0
        self._latest: tuple[str, tuple[object, ...]] = ("", ())
        """The last event counted but not logged (its line, at a flush)."""

    def warning(self, message: str, *args: object) -> None:
        """Log the event (at the log's level: WARNING unless it was made with another)."""
        now = time.monotonic()
        if now - self._last < self.interval:
            self._skipped += 1
            self._latest = (message, args)
            return
        self._emit(message, args, others=self._skipped, now=now)

    def flush(self) -> None:
        """Log the events counted since the last line, if any (at close, so none go unsaid)."""
        if self._skipped:
            message, args = self._latest
            self._emit(message, args, others=self._skipped - 1, now=time.monotonic())

    def _emit(self, message: str, args: tuple[object, ...], *, others: int, now: float) -> None:
        suffix = f" (and {others} more like it in the last {now - self._last:.0f} s)" if others else ""
        self._last = now
        self._skipped = 0
        self.logger.log(self.level, message + suffix, *args)


def budget_source(peer: object) -> str:
    """Whom a connection from `peer` (a socket's peername) counts against in per-source budgets:
    its IPv4 address, or its IPv6 /64 — one host is often given a whole /64, and a budget per
    address would give it 2⁶⁴ shares. An IPv4 peer on a dual-stack socket counts as its IPv4."""
    host = peer[0] if isinstance(peer, tuple) and peer else None
    if not isinstance(host, str):
        return "?"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # a link-local scope id aside
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)
