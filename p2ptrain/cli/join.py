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
from p2ptrain.config import Config, validate_shape
from p2ptrain.errors import UserError
from p2ptrain.identity import NodeIdentity

NodeMain = Callable[[Config, NodeIdentity, Any, Any], Coroutine[Any, Any, None]]
"""What a node command runs: (config, identity, dht or None, stop event)."""


def node_config(args: argparse.Namespace) -> tuple[Config, list[str]]:
    """The config of a node command, with its own flags applied, and its bootstrap peers."""
    peers = peers_of(args, resolve_config(args))
    config = resolve_config(
        args,
        {
            "swarm.peers": ("--peer", peers),
            "node.work_dir": ("--work-dir", args.work_dir),
            "node.identity": ("--identity", args.identity),
            "node.listen": ("--listen", validate_listen(args.listen)),
            "node.announce": ("--announce", validate_listen(args.announce)),
            "node.nproc": ("--nproc", getattr(args, "nproc", None)),
            "node.dashboard": ("--dashboard", args.dashboard),
        },
    )
    validate_dashboard(config.node.dashboard)
    return config, peers


def cmd_join(args: argparse.Namespace) -> int:
    if args.nproc is not None and not 1 <= args.nproc <= 64:
        raise UserError(f"--nproc must be between 1 and 64 (got {args.nproc})")
    config, peers = node_config(args)
    from p2ptrain.identity import load_or_create_identity

    check_trainable(config)
    identity = load_or_create_identity(config.node.identity_dir)
    resume = resume_path(args.resume, config, identity.short_id)
    # only now the heavy imports (hivemind and the trainer): bad settings fail in seconds
    from p2ptrain.node.agent import TrainingNode

    def train(config: Config, identity: NodeIdentity, dht: Any, stop: Any) -> Coroutine[Any, Any, None]:
        return TrainingNode(config, identity, dht, stop, sys.stdout, config.node.nproc, resume).run()

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
    log_path = Path(config.node.work_dir).expanduser() / "drill.jsonl"
    if not peers:
        print(
            "no --peer or PEER given: drilling alone (no bootstrap peer to find others through)", flush=True
        )

    def drill(config: Config, identity: NodeIdentity, dht: Any, stop: Any) -> Coroutine[Any, Any, None]:
        return run_drill(config, identity, dht, stop, out=sys.stdout, plan=plan, log_path=log_path)

    return _run_in_swarm(args, config, drill)


def cmd_watch(args: argparse.Namespace) -> int:
    config, peers = node_config(args)
    from p2ptrain.node.observer import run_node

    if not peers:
        print(
            "no --peer or PEER given: watching alone (no bootstrap peer to find others through)", flush=True
        )

    def watch(config: Config, identity: NodeIdentity, dht: Any, stop: Any) -> Coroutine[Any, Any, None]:
        return run_node(config, identity, dht, stop, out=sys.stdout, table_every=args.table_every)

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
