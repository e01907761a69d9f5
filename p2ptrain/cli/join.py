"""The commands that run a node in a swarm: `join` (train), `drill` (synthetic pseudo-gradients,
to check the plumbing) and `watch` (train nothing, print the swarm table)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from p2ptrain.cli.common import (
    StopClock,
    address_file_writer,
    peers_of,
    resolve_config,
    run_until_signal,
    validate_dashboard,
    validate_listen,
)
from p2ptrain.cli.preflight import IdentityLock, dht_ports_free, port_free, writable_dir
from p2ptrain.config import Config, validate_shape
from p2ptrain.errors import UserError
from p2ptrain.identity import NodeIdentity

NodeMain = Callable[[Config, NodeIdentity, Any, Any], Coroutine[Any, Any, None]]
"""What a node command runs: (config, identity, dht or None, stop event)."""


def node_config(args: argparse.Namespace) -> tuple[Config, list[str]]:
    """The config of a node command, with its own flags applied, and its bootstrap peers."""
    peers = peers_of(args, resolve_config(args))
    options = {
        "swarm.peers": ("--peer", peers),
        "node.work_dir": ("--work-dir", args.work_dir),
        "node.identity": ("--identity", args.identity),
        "node.listen": ("--listen", validate_listen(args.listen)),
        "node.announce": ("--announce", validate_listen(args.announce)),
        "node.nproc": ("--nproc", getattr(args, "nproc", None)),
        "node.dashboard": ("--dashboard", args.dashboard),
    }
    config = resolve_config(args, options)
    authority = ticket_authority(config)
    if authority is not None and not config.run.authority:
        print(f"run.authority {authority[:12]}… from node.ticket (a ticket names its run's authority)")
        options["run.authority"] = ("node.ticket's authority", authority)
        config = resolve_config(args, options)
    validate_dashboard(config.node.dashboard)
    return config, peers


def ticket_authority(config: Config) -> str | None:
    """The run authority (hex) that `node.ticket` names, None without a ticket. A ticket of another
    authority than `run.authority` is a one-line error: the node would train alone in a run of
    its own, under a DHT key nobody else reads."""
    if not config.node.ticket:
        return None
    from p2ptrain.swarm.admission import TicketError, parse_ticket_text

    try:
        named = parse_ticket_text(config.node.ticket).authority.hex()
    except TicketError as exc:
        raise UserError(f"node.ticket: {exc}") from None
    if config.run.authority and config.run.authority != named:
        raise UserError(
            f"node.ticket was issued by authority {named[:12]}…, but run.authority is "
            f"{config.run.authority[:12]}…: this is another run's ticket or another run's config"
        )
    return named


def preflight(config: Config, *, data_plane: bool, checkpoints: bool) -> IdentityLock:
    """Check at start what would fail later (ports, folders; preflight.py) and take the identity's
    lock; the caller holds the lock (`with`) for as long as the node runs."""
    node = config.node
    writable_dir(Path(node.work_dir).expanduser(), "node.work_dir")
    # the lock first: a second node of this identity is told so, not that its ports are taken
    lock = IdentityLock(node.identity_dir, "the identity folder").acquire()
    try:
        _ports_free(config, data_plane=data_plane, checkpoints=checkpoints)
    except BaseException:
        lock.release()
        raise
    return lock


def _ports_free(config: Config, *, data_plane: bool, checkpoints: bool) -> None:
    node = config.node
    if data_plane:
        port_free(node.data_host, node.data_port, "node.data_port")
    if checkpoints:
        port_free(node.data_host, node.ckpt_port, "node.ckpt_port")
        if node.ckpt_port and node.ckpt_port == node.data_port:
            raise UserError(f"node.ckpt_port and node.data_port are both {node.ckpt_port}: they must differ")
    if node.dashboard:
        from p2ptrain.web.dashboard import parse_dashboard_address

        port_free(*parse_dashboard_address(node.dashboard), "--dashboard")
    dht_ports_free(list(node.listen), "node.listen")


def checkpoints_writable(config: Config, node_id: str) -> None:
    """The checkpoint folder takes a file now: a folder it cannot write lost every checkpoint of a
    run that trained on as if nothing were wrong."""
    from p2ptrain.ckpt.format import checkpoint_places

    places = checkpoint_places(config, node_id)
    writable_dir(places.disk, "checkpoint.dir")


def cmd_join(args: argparse.Namespace) -> int:
    if args.nproc is not None and not 1 <= args.nproc <= 64:
        raise UserError(f"--nproc must be between 1 and 64 (got {args.nproc})")
    config, peers = node_config(args)
    check_trainable(config)
    with preflight(config, data_plane=bool(peers), checkpoints=bool(peers)):
        return _join(args, config, peers)


def _join(args: argparse.Namespace, config: Config, peers: list[str]) -> int:
    from p2ptrain.identity import load_or_create_identity

    identity = load_or_create_identity(config.node.identity_dir)
    checkpoints_writable(config, identity.short_id)
    resume = resume_path(args.resume, config, identity.short_id)
    # only now the heavy imports (hivemind and the trainer): bad settings fail in seconds
    from p2ptrain.node.agent import TrainingNode

    def train(config: Config, identity: NodeIdentity, dht: Any, stop: Any) -> Coroutine[Any, Any, None]:
        node = TrainingNode(
            config, identity, dht=dht, stop=stop, out=sys.stdout, nproc=config.node.nproc, resume=resume
        )
        return node.run()

    if not peers:
        print("no --peer or PEER given: training alone (no network)", flush=True)
        run_until_signal(lambda stop: train(config, identity, None, stop), on_force=lambda: None)
        return 0
    return _run_in_swarm(args, config, train)


def cmd_drill(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.nodes < 1 or args.size < 1 or args.inner < 0:
        raise UserError("--steps, --nodes and --size must be at least 1, --inner not negative")
    config, peers = node_config(args)
    from p2ptrain.node.drill import DrillPlan, run_drill

    plan = DrillPlan(steps=args.steps, size=args.size, inner_seconds=args.inner, min_nodes=args.nodes)
    lock = preflight(config, data_plane=True, checkpoints=False)
    log_path = Path(config.node.work_dir).expanduser() / "drill.jsonl"
    if not peers:
        print(
            "no --peer or PEER given: drilling alone (no bootstrap peer to find others through)", flush=True
        )

    def drill(config: Config, identity: NodeIdentity, dht: Any, stop: Any) -> Coroutine[Any, Any, None]:
        return run_drill(config, identity, dht=dht, stop=stop, out=sys.stdout, plan=plan, log_path=log_path)

    with lock:
        return _run_in_swarm(args, config, drill)


def cmd_watch(args: argparse.Namespace) -> int:
    config, peers = node_config(args)
    from p2ptrain.node.observer import run_node

    lock = preflight(config, data_plane=False, checkpoints=False)
    if not peers:
        print(
            "no --peer or PEER given: watching alone (no bootstrap peer to find others through)", flush=True
        )

    def watch(config: Config, identity: NodeIdentity, dht: Any, stop: Any) -> Coroutine[Any, Any, None]:
        return run_node(config, identity, dht=dht, stop=stop, out=sys.stdout, table_every=args.table_every)

    with lock:
        return _run_in_swarm(args, config, watch)


def _run_in_swarm(args: argparse.Namespace, config: Config, main: NodeMain) -> int:
    """Start the node's DHT, run `main` until a signal, and shut the DHT down."""
    from p2ptrain.node.startup import start_node_dht

    identity, dht = start_node_dht(config)
    clock = StopClock()
    with dht:
        run_until_signal(
            lambda stop: main(config, identity, dht, stop),
            on_force=dht.shutdown,
            clock=clock,
            on_ready=address_file_writer(args.address_file, dht.visible_maddrs),
        )
    clock.mark("the DHT")
    clock.report()
    return 0


def check_trainable(config: Config) -> None:
    """Refuse a config whose model or data cannot work, before any process starts."""
    from p2ptrain.node.checkpoint_copies import check_remote
    from p2ptrain.train.data import list_files, load_tokenizer

    try:
        validate_shape(config.model)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    load_tokenizer(config.data, config.model.vocab_size)
    list_files(config.data)
    check_remote(config.checkpoint.remote)


def resume_path(resume: str | None, config: Config, node_id: str) -> Path | None:
    """The checkpoint folder `--resume` names, checked to be resumable before any process starts."""
    if resume is None:
        return None
    from p2ptrain.ckpt.format import INNER_FILE, META_FILE, checkpoint_places
    from p2ptrain.node.checkpoint_copies import flush_leftovers

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
