"""`p2ptrain join`: a training node, a drill (`--drill N`) or an observer (`--observe`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def cmd_join(args: argparse.Namespace) -> int:
    base = resolve_config(args)
    peers = peers_of(args, base)
    config = resolve_config(
        args,
        **{
            "swarm.peers": peers,
            "node.work_dir": args.work_dir,
            "node.identity": args.identity,
            "node.listen": validate_listen(args.listen),
            "node.announce": validate_listen(args.announce),
            "node.nproc": args.nproc,
            "node.dashboard": args.dashboard,
        },
    )
    if args.drill < 0 or args.drill_size < 1 or args.drill_inner < 0:
        raise UserError("--drill, --drill-size and --drill-inner must not be negative (size at least 1)")
    validate_dashboard(config.node.dashboard)
    if args.nproc is not None and not 1 <= args.nproc <= 64:
        raise UserError(f"--nproc must be between 1 and 64 (got {args.nproc})")
    if args.drill or args.observe:
        return _join_without_training(args, config, peers)
    from p2ptrain.identity import load_or_create_identity

    check_trainable(config)
    identity = load_or_create_identity(config.node.identity_dir)
    resume = resume_path(args.resume, config, identity.short_id)
    # only now the heavy imports (hivemind and the trainer): bad settings fail in seconds
    from p2ptrain.node.agent import TrainingNode
    from p2ptrain.node.startup import start_node_dht

    if not peers:
        print("no --peer or PEER given: training alone (no network)", flush=True)
        run_until_signal(
            lambda stop: TrainingNode(
                config, identity, None, stop, sys.stdout, config.node.nproc, resume
            ).run(),
            on_force=lambda: None,
        )
        return 0
    identity, dht = start_node_dht(config)
    clock = StopClock()
    with dht:
        run_until_signal(
            lambda stop: TrainingNode(
                config, identity, dht, stop, sys.stdout, config.node.nproc, resume
            ).run(),
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


def _join_without_training(args: argparse.Namespace, config: Config, peers: list[str]) -> int:
    from p2ptrain.node.observer import run_node
    from p2ptrain.node.startup import start_node_dht

    if not peers:
        print("no --peer or PEER given: running alone (no bootstrap peer to find others through)", flush=True)
    identity, dht = start_node_dht(config)
    clock = StopClock()
    with dht:
        if args.drill:
            from p2ptrain.node.drill import run_drill

            log_path = Path(config.node.work_dir).expanduser() / "drill.jsonl"
            run_until_signal(
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
                clock=clock,
                on_ready=address_file_writer(args.address_file, dht.visible_maddrs),
            )
        else:
            run_until_signal(
                lambda stop: run_node(config, identity, dht, stop, sys.stdout, table_every=args.table_every),
                on_force=dht.shutdown,
                clock=clock,
                on_ready=address_file_writer(args.address_file, dht.visible_maddrs),
            )
    clock.mark("the DHT")
    clock.report()
    return 0
