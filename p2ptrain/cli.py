"""Console entry point: `p2ptrain bootstrap | join | status | config show | identity | demo`.

Errors a user can fix print as one line (`p2ptrain: error: ...`) with a non-zero exit code;
SIGINT and SIGTERM stop a running node or bootstrap peer cleanly, children included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from p2ptrain import __version__
from p2ptrain.config import Config, load_config, to_toml
from p2ptrain.errors import UserError
from p2ptrain.faults import shift_wall_clock

log = logging.getLogger("p2ptrain")

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
        "--run-id", default="p2ptrain-debug", help="run shown by --dashboard (default %(default)s)"
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
    status.set_defaults(handler=cmd_status)

    config = commands.add_parser("config", help="inspect configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the resolved config")
    _add_config_args(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(handler=cmd_config_show)

    ident = commands.add_parser("identity", help="create (if missing) and print a node or bootstrap identity")
    ident.add_argument("--identity", required=True, metavar="DIR", help="identity directory")
    ident.set_defaults(handler=cmd_identity)

    exp = commands.add_parser("export", help="write a checkpoint as a Hugging Face Llama model")
    exp.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint folder, checkpoints folder or node work dir"
    )
    exp.add_argument("out_dir", metavar="OUT_DIR", help="folder for config.json and model.safetensors")
    exp.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default %(default)s)")
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
        "--json", action="store_true", help="print the summary as one JSON object on the last line"
    )
    demo.set_defaults(handler=cmd_demo)
    return parser


def resolve_config(args: argparse.Namespace, **extra: Any) -> Config:
    overrides = list(getattr(args, "overrides", []))
    config = load_config(args.config, overrides=overrides)
    updates = {key: value for key, value in extra.items() if value}
    if updates:
        flags = [f"{key}={json.dumps(value)}" for key, value in updates.items()]
        config = load_config(args.config, overrides=overrides + flags)
    return config


def _peers(args: argparse.Namespace, config: Config) -> list[str]:
    from p2ptrain.swarm.maddr import parse_peers

    given = (
        list(args.peer)
        or ([os.environ["PEER"]] if os.environ.get("PEER") else [])
        or list(config.swarm.peers)
    )
    return parse_peers(given)


def _validate_listen(addresses: list[str]) -> list[str]:
    import multiaddr

    for address in addresses:
        try:
            multiaddr.Multiaddr(address)
        except Exception as exc:
            raise UserError(f"malformed listen/announce multiaddress '{address}': {exc}") from None
    return addresses


def cmd_config_show(args: argparse.Namespace) -> int:
    config = resolve_config(args)
    print(
        json.dumps(config.model_dump(), indent=2) if args.json else to_toml(config),
        end="\n" if args.json else "",
    )
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    from p2ptrain.identity import ensure_p2p_identity, load_or_create_identity, peer_id_of

    identity = load_or_create_identity(args.identity)
    p2p_key = ensure_p2p_identity(args.identity)
    print(f"node key   {identity.node_id}  ({identity.path})")
    print(f"DHT peer   {peer_id_of(p2p_key)}  ({p2p_key})")
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from p2ptrain.swarm.bootstrap import DEFAULT_LISTEN, serve_bootstrap, start_bootstrap_dht

    listen = _validate_listen(args.listen or [DEFAULT_LISTEN])
    announce = _validate_listen(args.announce)
    _validate_dashboard(args.dashboard)
    dht = start_bootstrap_dht(Path(args.identity).expanduser(), listen, announce)
    with dht:
        if args.address_file:
            _write_atomic(Path(args.address_file), "\n".join(dht.visible_maddrs()) + "\n")
        _run_until_signal(
            lambda stop: serve_bootstrap(dht, stop, sys.stdout, args.dashboard, args.run_id),
            on_force=dht.shutdown,
        )
    print("bootstrap peer stopped", flush=True)
    return 0


def _validate_dashboard(address: str | None) -> None:
    if address:
        from p2ptrain.web.dashboard import parse_dashboard_address

        try:
            parse_dashboard_address(address)
        except ValueError as exc:
            raise UserError(str(exc)) from None


def cmd_join(args: argparse.Namespace) -> int:
    base = resolve_config(args)
    peers = _peers(args, base)
    config = resolve_config(
        args,
        **{
            "swarm.peers": peers,
            "node.work_dir": args.work_dir,
            "node.identity": args.identity,
            "node.listen": _validate_listen(args.listen),
            "node.announce": _validate_listen(args.announce),
            "node.nproc": args.nproc,
            "node.dashboard": args.dashboard,
        },
    )
    if args.drill < 0 or args.drill_size < 1 or args.drill_inner < 0:
        raise UserError("--drill, --drill-size and --drill-inner must not be negative (size at least 1)")
    _validate_dashboard(config.node.dashboard)
    if args.nproc is not None and not 1 <= args.nproc <= 64:
        raise UserError(f"--nproc must be between 1 and 64 (got {args.nproc})")
    if args.drill or args.observe:
        return _join_without_training(args, config, peers)
    from p2ptrain.identity import load_or_create_identity

    _check_trainable(config)
    identity = load_or_create_identity(config.node.identity_dir)
    resume = _resume_path(args.resume, config, identity.short_id)
    # only now the heavy imports (hivemind and the trainer): bad settings fail in seconds
    from p2ptrain.node import start_node_dht
    from p2ptrain.train.agent import TrainingNode

    if not peers:
        print("no --peer or PEER given: training alone (no network)", flush=True)
        _run_until_signal(
            lambda stop: TrainingNode(
                config, identity, None, stop, sys.stdout, config.node.nproc, resume
            ).run(),
            on_force=lambda: None,
        )
        return 0
    identity, dht = start_node_dht(config)
    with dht:
        if args.address_file:
            _write_atomic(Path(args.address_file), "\n".join(dht.visible_maddrs()) + "\n")
        _run_until_signal(
            lambda stop: TrainingNode(
                config, identity, dht, stop, sys.stdout, config.node.nproc, resume
            ).run(),
            on_force=dht.shutdown,
        )
    return 0


def _check_trainable(config: Config) -> None:
    """Refuse a config whose model or data cannot work, before any process starts."""
    from p2ptrain.train.data import list_files, load_tokenizer
    from p2ptrain.train.model import validate_shape
    from p2ptrain.train.places import check_remote

    try:
        validate_shape(config.model)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    load_tokenizer(config.data, config.model.vocab_size)
    list_files(config.data)
    check_remote(config.checkpoint.remote)


def _resume_path(resume: str | None, config: Config, node_id: str) -> Path | None:
    """The checkpoint folder `--resume` names, checked to be resumable before any process starts."""
    if resume is None:
        return None
    from p2ptrain.train.checkpoint import INNER_FILE, META_FILE
    from p2ptrain.train.places import checkpoint_places, flush_leftovers

    if resume == "latest":
        places = checkpoint_places(config, node_id)
        flush_leftovers(places, config.checkpoint.keep)  # a killed run's newest may still be in RAM
        found = places.latest()
        if found is None:
            raise UserError(f"--resume latest: no checkpoint in {places.disk}")
        return found
    path = Path(resume).expanduser()
    if not (path / META_FILE).is_file() or not (path / INNER_FILE).is_file():
        raise UserError(f"--resume {resume}: not a checkpoint folder (needs {META_FILE} and {INNER_FILE})")
    return path


def _join_without_training(args: argparse.Namespace, config: Config, peers: list[str]) -> int:
    from p2ptrain.node import run_node, start_node_dht

    if not peers:
        print("no --peer or PEER given: running alone (no bootstrap peer to find others through)", flush=True)
    identity, dht = start_node_dht(config)
    with dht:
        if args.address_file:
            _write_atomic(Path(args.address_file), "\n".join(dht.visible_maddrs()) + "\n")
        if args.drill:
            from p2ptrain.drill import run_drill

            log_path = Path(config.node.work_dir).expanduser() / "drill.jsonl"
            _run_until_signal(
                lambda stop: run_drill(
                    config,
                    identity,
                    dht,
                    stop,
                    sys.stdout,
                    args.drill,
                    args.drill_size,
                    args.drill_inner,
                    log_path,
                    min_nodes=args.drill_nodes,
                ),
                on_force=dht.shutdown,
            )
        else:
            _run_until_signal(
                lambda stop: run_node(config, identity, dht, stop, sys.stdout, table_every=args.table_every),
                on_force=dht.shutdown,
            )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from p2ptrain.node import dht_settings
    from p2ptrain.swarm.dht import SwarmDHT
    from p2ptrain.swarm.membership import read_heartbeats
    from p2ptrain.swarm.status import format_table, status_json

    config = resolve_config(args, **{"run.id": args.run_id})
    peers = _peers(args, config)
    if not peers:
        raise UserError("status needs a bootstrap peer: give --peer MADDR or set PEER")
    settings = dht_settings(
        config.model_copy(update={"swarm": config.swarm.model_copy(update={"peers": peers})}),
        p2p_key=None,
        client_mode=True,
    )
    settings.listen = ("/ip4/127.0.0.1/tcp/0",)
    with SwarmDHT.start(settings) as dht:
        heartbeats = asyncio.run(read_heartbeats(dht, config.run.id))
    if args.json:
        print(json.dumps(status_json(heartbeats)))
    else:
        print(f"run {config.run.id!r}")
        print(format_table(heartbeats))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from p2ptrain.export import export

    out = export(Path(args.checkpoint).expanduser(), Path(args.out_dir).expanduser(), args.dtype)
    print(f"exported to {out} (config.json, model.safetensors): load with LlamaForCausalLM.from_pretrained")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from p2ptrain.demo import run_demo

    if args.nodes < 1 or args.steps < 1 or args.kill_at < 0 or args.timeout <= 0:
        raise UserError("--nodes and --steps must be at least 1, --kill-at and --timeout not negative")
    summary = run_demo(
        Path(args.work_dir),
        nodes=args.nodes,
        steps=args.steps,
        kill_at=args.kill_at,
        timeout=args.timeout,
        quiet=args.json,
    )
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _run_until_signal(
    main: Callable[[asyncio.Event], Coroutine[Any, Any, None]], on_force: Callable[[], None]
) -> None:
    """Run `main(stop)`; the first SIGINT/SIGTERM sets `stop`, a second one forces the shutdown."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def request_stop(signum: int) -> None:
            if stop.is_set():
                print("second signal: forcing shutdown", file=sys.stderr, flush=True)
                on_force()
                os._exit(128 + signum)
            print(f"received {signal.Signals(signum).name}, shutting down…", file=sys.stderr, flush=True)
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, request_stop, signum)
        await main(stop)

    asyncio.run(runner())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        shift_wall_clock()  # a fault hook for tests; before hivemind binds its clock
        return args.handler(args)
    except UserError as exc:
        print(f"p2ptrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
