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
from p2ptrain.cli.join import cmd_join

DEFAULT_BOOTSTRAP_IDENTITY = "~/.local/share/p2ptrain/bootstrap"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", metavar="FILE", help="TOML config file, or a name in configs/ (debug, 20m, …)"
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
        "--run-id",
        default="p2ptrain-debug",
        help="run shown by --dashboard and relayed by --relay (default %(default)s)",
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

    join = commands.add_parser("join", help="join a swarm as a node")
    _add_peer_arg(join, "Without any, the node runs alone.")
    _add_config_args(join)
    join.add_argument(
        "--identity", metavar="DIR", help="directory of node.key and p2p.key (default: the work directory)"
    )
    join.add_argument(
        "--work-dir", metavar="DIR", help="node work directory (default from config node.work_dir)"
    )
    join.add_argument(
        "--listen", action="append", default=[], metavar="MADDR", help="DHT listen multiaddress"
    )
    join.add_argument(
        "--announce", action="append", default=[], metavar="MADDR", help="DHT multiaddress to announce"
    )
    join.add_argument(
        "--address-file", metavar="FILE", help="write this node's DHT multiaddresses to FILE once up"
    )
    join.add_argument(
        "--drill",
        type=int,
        default=0,
        metavar="N",
        help="instead of training, run N outer steps with synthetic pseudo-gradients (tests the plumbing)",
    )
    join.add_argument(
        "--drill-nodes", type=int, default=1, metavar="K", help="drill: wait for K live nodes before step 0"
    )
    join.add_argument("--drill-size", type=int, default=1 << 20, metavar="VALUES", help="drill vector length")
    join.add_argument(
        "--drill-inner", type=float, default=2.0, metavar="S", help="drill inner phase: up to S s"
    )
    join.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="trainer ranks on this node (default: one per visible GPU, one on a CPU-only machine)",
    )
    join.add_argument("--dashboard", metavar="[HOST:]PORT", help="serve the swarm's status page here")
    join.add_argument(
        "--resume",
        metavar="PATH|latest",
        help="continue exactly from a checkpoint folder, or the newest one in the checkpoint dir",
    )
    join.add_argument(
        "--observe",
        action="store_true",
        help="train nothing: keep a heartbeat and print the swarm table (an extra DHT peer, a watcher)",
    )
    join.add_argument(
        "--table-every",
        type=float,
        default=10.0,
        metavar="S",
        help="print the swarm table every S seconds (0: never)",
    )
    join.set_defaults(handler=cmd_join)

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
    ident.add_argument("--identity", required=True, metavar="DIR", help="identity directory")
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

    exp = commands.add_parser("export", help="write a checkpoint as a Hugging Face Llama model")
    exp.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint folder, checkpoints folder or node work dir"
    )
    exp.add_argument("out_dir", metavar="OUT_DIR", help="folder for config.json and model.safetensors")
    exp.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default %(default)s)")
    exp.add_argument(
        "--allow-diverged",
        action="store_true",
        help="export a checkpoint whose node ended off the swarm's track (its meta says so)",
    )
    exp.set_defaults(handler=cmd_export)

    demo = commands.add_parser(
        "demo", help="train a local swarm on 127.0.0.1: kill a node, take in a new one (about 2 minutes)"
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
