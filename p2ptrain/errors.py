"""Errors a user can act on. The CLI prints them as one line and exits non-zero, without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Something the user gave us is wrong (a flag, a file, an address); the message says what."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, environment variable or flag is invalid; the message names the key and source."""


class IdentityError(UserError):
    """A key file is missing, unreadable, malformed or readable by others."""


class NetworkError(UserError):
    """A peer could not be reached or a port could not be bound; the message says what to check."""

    exit_code = 3


def cannot_listen(what: str, host: str, port: int, exc: OSError) -> NetworkError:
    """The one-line error for a port that will not take a listener (in use, or not this machine's)."""
    return NetworkError(
        f"{what}: cannot listen on {host}:{port} ({exc.strerror or exc}): choose another port, or 0 for any"
    )
