"""The command line's arguments: one sub-parser per command, each naming its handler."""

from __future__ import annotations

import argparse
import os

from p2ptrain import __version__
from p2ptrain.cli.commands import (
    cmd_admit,
    cmd_bootstrap,
    cmd_config_show,
    cmd_demo,
    cmd_export,
    cmd_identity,
    cmd_status,
)
from p2ptrain.cli.join import cmd_drill, cmd_join, cmd_watch
from p2ptrain.errors import UserError

DEFAULT_BOOTSTRAP_IDENTITY = "~/.local/share/p2ptrain/bootstrap"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help="TOML config file, or a bundled config's name (debug, 20m, 150m, 1b, 7b, 10b)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable); P2PTRAIN_SECTION__KEY variables work too",
    )


def _add_peer_arg(parser: argparse.ArgumentParser, required_help: str) -> None:
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="MADDR[,MADDR…]",
        help=f"bootstrap peer multiaddress (repeatable, or comma-separated; default: $PEER). {required_help}",
    )


def _add_node_args(parser: argparse.ArgumentParser, peers_help: str) -> None:
    """What every command that runs a node in a swarm takes (join, drill, watch)."""
    _add_peer_arg(parser, peers_help)
    _add_config_args(parser)
    parser.add_argument(
        "--identity", metavar="DIR", help="directory of node.key and p2p.key (default: the work directory)"
    )
    parser.add_argument(
        "--work-dir", metavar="DIR", help="node work directory (default from config node.work_dir)"
    )
    parser.add_argument(
        "--listen", action="append", default=[], metavar="MADDR", help="DHT listen multiaddress"
    )
    parser.add_argument(
        "--announce", action="append", default=[], metavar="MADDR", help="DHT multiaddress to announce"
    )
    parser.add_argument(
        "--address-file", metavar="FILE", help="write this node's DHT multiaddresses to FILE once up"
    )
    parser.add_argument("--dashboard", metavar="[HOST:]PORT", help="serve the swarm's status page here")


MOVED_JOIN_FLAGS = {
    "--drill": "p2ptrain drill --steps N",
    "--drill-nodes": "p2ptrain drill --nodes K",
    "--drill-size": "p2ptrain drill --size VALUES",
    "--drill-inner": "p2ptrain drill --inner S",
    "--observe": "p2ptrain watch",
    "--table-every": "p2ptrain watch --table-every S",
}
"""Flags `join` took before drills and watching became commands of their own."""


class Moved(argparse.Action):
    """A flag that moved to another command: refused with one line saying where it went."""

    def __init__(self, option_strings: list[str], dest: str, *, instead: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]
        self.instead = instead

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        raise UserError(f"{option_string} is no longer a flag of join: use {self.instead}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2ptrain", description="Peer-to-peer DiLoCo training over a DHT.")
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument(
        "--log-level", default=os.environ.get("P2PTRAIN_LOG_LEVEL", "WARNING"), help="python log level"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    boot = commands.add_parser("bootstrap", help="run a bootstrap DHT peer (trains nothing)")
    boot.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="MADDR",
        help="listen multiaddress (default /ip4/0.0.0.0/tcp/31337)",
    )
    boot.add_argument(
        "--announce", action="append", default=[], metavar="MADDR", help="public multiaddress to announce"
    )
    boot.add_argument(
        "--identity",
        default=DEFAULT_BOOTSTRAP_IDENTITY,
        metavar="DIR",
        help="directory of the persistent p2p.key (default %(default)s)",
    )
    boot.add_argument(
        "--address-file", metavar="FILE", help="write the visible multiaddresses to FILE once up"
    )
    boot.add_argument("--dashboard", metavar="[HOST:]PORT", help="serve the status page of --run-id here")
    boot.add_argument(
        "--config",
        "-c",
        metavar="NAME|FILE",
        help="the run's config: its run id and authority go into the join line this prints, and "
        "--dashboard and --relay serve that run",
    )
    boot.add_argument(
        "--run-id",
        help="run whose joins, leaves and steps it prints, shown by --dashboard, relayed by --relay and "
        "named in the join line (default: the "
        "--config's run.id, else p2ptrain-debug)",
    )
    boot.add_argument(
        "--run-authority", default="", metavar="KEY", help="run.authority of --run-id, if it is a closed run"
    )
    boot.add_argument(
        "--relay",
        metavar="[HOST:]PORT",
        help="also relay the edges between --run-id's nodes behind NAT where no member can (and answer "
        "their reachability probes), listening here",
    )
    boot.add_argument(
        "--relay-announce",
        metavar="HOST",
        help="the address nodes dial for --relay (default: its HOST, else the --announce address, else "
        "the interface of the default route)",
    )
    boot.add_argument(
        "--relay-mbps",
        type=float,
        default=100.0,
        metavar="N",
        help="cap of --relay (default %(default)s Mbit/s)",
    )
    boot.add_argument(
        "--ticket", default="", metavar="TICKET", help="the relay's admission ticket, if --run-id is closed"
    )
    boot.set_defaults(handler=cmd_bootstrap)

    join = commands.add_parser("join", help="join a swarm as a training node")
    _add_node_args(join, "Without any, the node trains alone.")
    join.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="trainer ranks on this node (default: one per visible GPU, one on a CPU-only machine)",
    )
    join.add_argument(
        "--resume",
        metavar="PATH|latest",
        help="continue exactly from a checkpoint folder, or the newest one in the checkpoint dir",
    )
    for flag, instead in MOVED_JOIN_FLAGS.items():
        join.add_argument(flag, nargs="?", action=Moved, instead=instead, help=argparse.SUPPRESS)
    join.set_defaults(handler=cmd_join)

    drill = commands.add_parser(
        "drill",
        help="check a swarm's plumbing: outer steps with synthetic pseudo-gradients instead of a model",
    )
    _add_node_args(drill, "Without any, the node drills alone.")
    drill.add_argument("--steps", type=int, default=10, metavar="N", help="outer steps (default %(default)s)")
    drill.add_argument(
        "--nodes", type=int, default=1, metavar="K", help="wait for K live nodes before step 0 (default 1)"
    )
    drill.add_argument(
        "--size", type=int, default=1 << 20, metavar="VALUES", help="vector length (default %(default)s)"
    )
    drill.add_argument(
        "--inner",
        type=float,
        default=2.0,
        metavar="S",
        help="inner phase: a random wait of up to S seconds (default %(default)s)",
    )
    drill.set_defaults(handler=cmd_drill)

    watch = commands.add_parser(
        "watch", help="train nothing: keep a heartbeat in the run and print the swarm table (a watcher)"
    )
    _add_node_args(watch, "Required to see anyone.")
    watch.add_argument(
        "--table-every",
        type=float,
        default=10.0,
        metavar="S",
        help="print the swarm table every S seconds (0: never)",
    )
    watch.set_defaults(handler=cmd_watch)

    status = commands.add_parser("status", help="print the nodes of a run, read from the DHT")
    _add_peer_arg(status, "Required (or $PEER).")
    _add_config_args(status)
    status.add_argument("--run-id", help="run to show (default: run.id of the config)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--once",
        action="store_true",
        help="read the records once (nodes whose port refuses are still shown gone; no 'silent')",
    )
    status.set_defaults(handler=cmd_status)

    config = commands.add_parser("config", help="inspect configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the resolved config")
    _add_config_args(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.add_argument(
        "--memory",
        action="store_true",
        help="print the memory one trainer rank needs, by part, and the micro-batch it would use here",
    )
    show.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="with --memory: estimate for a CPU or a GPU rank (default: this machine's)",
    )
    show.set_defaults(handler=cmd_config_show)

    ident = commands.add_parser("identity", help="create (if missing) and print a node or bootstrap identity")
    ident.add_argument(
        "--identity",
        metavar="DIR",
        help="identity directory (default: the node's, as join would use it: node.identity, else "
        "node.work_dir, of --config and --set)",
    )
    ident.add_argument("--work-dir", metavar="DIR", help="the node's work directory, as for join")
    _add_config_args(ident)
    ident.set_defaults(handler=cmd_identity)

    admit = commands.add_parser(
        "admit", help="closed runs: print a node's admission ticket, signed with the run's authority key"
    )
    admit.add_argument("node_key", nargs="?", metavar="NODE_KEY", help="the node's key (p2ptrain identity)")
    admit.add_argument(
        "--authority-key", required=True, metavar="FILE", help="the run authority's private key (0600)"
    )
    admit.add_argument(
        "--days", type=float, default=30.0, help="how long the ticket holds (default %(default)s)"
    )
    admit.add_argument("--new", action="store_true", help="create FILE first and print run.authority")
    admit.set_defaults(handler=cmd_admit)

    exp = commands.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face Llama model with its tokenizer (that of --config and "
        "--set: data.tokenizer, data.eos_id; default: bytes)",
    )
    exp.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint folder, checkpoints folder or node work dir"
    )
    exp.add_argument("out_dir", metavar="OUT_DIR", help="folder for the model's and the tokenizer's files")
    _add_config_args(exp)
    exp.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default %(default)s)")
    exp.add_argument(
        "--allow-diverged",
        action="store_true",
        help="export a checkpoint whose node ended off the swarm's track (its meta says so)",
    )
    exp.set_defaults(handler=cmd_export)

    demo = commands.add_parser(
        "demo", help="train a local swarm on 127.0.0.1: kill a node, take in a new one (about 75 s)"
    )
    demo.add_argument("--nodes", type=int, default=3, help="number of nodes (default %(default)s)")
    demo.add_argument(
        "--work-dir", default=".p2ptrain-demo", metavar="DIR", help="where identities, checkpoints, logs go"
    )
    demo.add_argument("--steps", type=int, default=12, help="outer steps to run (default %(default)s)")
    demo.add_argument(
        "--kill-at", type=int, default=4, metavar="N", help="SIGKILL a node after outer step N (0: never)"
    )
    demo.add_argument("--timeout", type=float, default=600.0, metavar="S", help="give up after S seconds")
    demo.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every node, e.g. --set outer.overlap.enabled=true (repeatable)",
    )
    demo.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object on the last line"
    )
    demo.set_defaults(handler=cmd_demo)
    return parser
