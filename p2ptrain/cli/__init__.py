"""Console entry point: `p2ptrain bootstrap | join | status | config show | identity | admit | export | demo`.

Errors a user can fix print as one line (`p2ptrain: error: ...`) with a non-zero exit code;
SIGINT and SIGTERM stop a running node or bootstrap peer cleanly, children included; SIGUSR1 prints
every thread's stack to stderr (the node's log), for a node that seems stuck.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from p2ptrain.cli.parser import build_parser
from p2ptrain.errors import UserError
from p2ptrain.faults import shift_wall_clock
from p2ptrain.procs import exit_without_teardown, raise_open_file_limit

__all__ = ["build_parser", "main", "run"]


def run() -> NoReturn:
    """The `p2ptrain` command (and `python -m p2ptrain`): `main`, then a quick exit."""
    exit_without_teardown(main())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UserError as exc:  # a flag that moved (parser.Moved)
        print(f"p2ptrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    raise_open_file_limit()  # every connection a stranger opens costs a file: take what we may
    try:
        shift_wall_clock()  # a fault hook for tests; before hivemind binds its clock
        return args.handler(args)
    except UserError as exc:
        print(f"p2ptrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of our output went away (`p2ptrain identity ... | head -1`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
