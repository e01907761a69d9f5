"""The small commands: `config show`, `identity`, `bootstrap`, `status`, `export`, `demo`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain.cli.common import (
    address_file_writer,
    peers_of,
    resolve_config,
    run_until_signal,
    to_toml,
    validate_dashboard,
    validate_listen,
)
from p2ptrain.cli.preflight import IdentityLock, dht_ports_free, port_free
from p2ptrain.errors import UserError

if TYPE_CHECKING:
    from p2ptrain.config import Config
    from p2ptrain.swarm.bootstrap import RelayOptions


def cmd_config_show(args: argparse.Namespace) -> int:
    config = resolve_config(args)
    if args.memory:
        from p2ptrain.node.rank_launcher import default_nproc, gpu_driver_present
        from p2ptrain.train.memory import available_memory, memory_report

        world_size = config.node.nproc or default_nproc()
        local = "cuda" if gpu_driver_present() and _has_gpu() else "cpu"
        device_type = local if args.device == "auto" else args.device
        available = available_memory(device_type, world_size) if device_type == local else None
        print("\n".join(memory_report(config, world_size, device_type=device_type, available=available)))
        return 0
    print(
        json.dumps(config.model_dump(), indent=2) if args.json else to_toml(config),
        end="\n" if args.json else "",
    )
    return 0


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def node_identity_dir(args: argparse.Namespace) -> Path:
    """`--identity`, else the folder `join` with the same --config, --set and --work-dir keeps its
    keys in (node.identity, else node.work_dir): a volunteer's key without knowing where it lives."""
    if args.identity:
        return Path(args.identity).expanduser()
    config = resolve_config(args, {"node.work_dir": ("--work-dir", getattr(args, "work_dir", None))})
    return config.node.identity_dir


def cmd_identity(args: argparse.Namespace) -> int:
    from p2ptrain.identity import load_or_create_identity
    from p2ptrain.swarm.p2p_key import ensure_p2p_identity, peer_id_of

    directory = node_identity_dir(args)
    identity = load_or_create_identity(directory)
    p2p_key = ensure_p2p_identity(directory)
    print(f"node key   {identity.node_id}  ({identity.path})")
    print(f"DHT peer   {peer_id_of(p2p_key)}  ({p2p_key})")
    return 0


MAX_TICKET_DAYS = 3650


def public_key_argument(text: str, what: str) -> bytes:
    """An Ed25519 public key given on the command line, or a one-line UserError."""
    from p2ptrain.swarm.admission import TicketError, parse_public_key

    try:
        return parse_public_key(text, what)
    except TicketError as exc:
        raise UserError(str(exc)) from None


def cmd_admit(args: argparse.Namespace) -> int:
    """Create a run authority's key (`--new`), or print a ticket that admits NODE_KEY to its run."""
    import datetime

    from p2ptrain.identity import create_key_file, load_key_file
    from p2ptrain.swarm.admission import issue_ticket

    path = Path(args.authority_key).expanduser()
    if args.new:
        if not create_key_file(path):
            raise UserError(f"{path} exists already: refusing to replace a run's authority key")
        authority = load_key_file(path)
        print(f"created the authority key {path}; give every node of the run this setting:")
        print(f'  [run]\n  authority = "{authority.node_id}"')
        if not args.node_key:
            return 0
    if not args.node_key:
        raise UserError("admit needs the NODE_KEY to admit (as 'p2ptrain identity' prints it), or --new")
    if not 0 < args.days <= MAX_TICKET_DAYS:
        raise UserError(f"--days must be above 0 and at most {MAX_TICKET_DAYS}")
    node_key = public_key_argument(args.node_key, "NODE_KEY")
    authority = load_key_file(path)
    expires = time.time() + args.days * 86400
    until = datetime.datetime.fromtimestamp(expires, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"ticket for {args.node_key[:12]} in the run of authority {authority.short_id}, until {until}:",
        file=sys.stderr,
    )
    print(issue_ticket(authority, node_key, expires).to_text())
    return 0


def relay_options(args: argparse.Namespace, announce: list[str], authority: bytes | None) -> RelayOptions:
    """`bootstrap --relay`'s settings, checked (a one-line UserError otherwise, before the DHT's
    heavy imports): where it listens, the host nodes dial, and the node key of the bootstrap's
    --identity that signs its record."""
    from p2ptrain.identity import load_or_create_identity
    from p2ptrain.swarm.admission import TicketError, check_admits, parse_ticket_text
    from p2ptrain.untrusted import decimal

    host, _, port_text = args.relay.rpartition(":")
    host, port = host.strip("[]") or "0.0.0.0", decimal(port_text, 5)  # a bare port: every interface
    if port is None or port > 65535:
        raise UserError(f"--relay {args.relay}: expected PORT or HOST:PORT with a port in 0-65535 (0: any)")
    port_free(host, port, "--relay")
    if not 0 < args.relay_mbps <= 100000:
        raise UserError("--relay-mbps must be above 0 and at most 100000")
    identity = load_or_create_identity(Path(args.identity).expanduser())
    ticket = b""
    if authority is not None:
        if not args.ticket:
            raise UserError(
                f"--run-id {args.run_id!r} is closed: --relay needs an admission ticket for the relay's key "
                f"{identity.node_id} (--ticket)"
            )
        try:
            parsed = parse_ticket_text(args.ticket)
            check_admits(parsed, identity.public_key, authority=authority, now=time.time())
        except TicketError as exc:
            raise UserError(f"--ticket: {exc}") from None
        ticket = parsed.to_bytes()
    from p2ptrain.node.reachability import WILDCARD_HOSTS, outbound_ip
    from p2ptrain.swarm.bootstrap import RelayOptions

    public = [address.split("/")[2] for address in announce if address.startswith(("/ip4/", "/ip6/"))]
    announce_host = (
        args.relay_announce or (host if host not in WILDCARD_HOSTS else "") or next(iter(public), "")
    )
    return RelayOptions(
        identity=identity,
        host=host,
        port=port,
        announce_host=announce_host or outbound_ip([]),
        mbps=args.relay_mbps,
        ticket=ticket,
    )


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from p2ptrain.config import Config, load_config

    announce = validate_listen(args.announce)
    validate_dashboard(args.dashboard)
    config = load_config(args.config) if args.config else None
    run = config.run if config is not None else Config().run
    args.run_id = args.run_id or run.id
    authority_hex = args.run_authority or run.authority
    authority = public_key_argument(authority_hex, "--run-authority") if authority_hex else None
    join = join_arguments(config_name=args.config, run_id=args.run_id, authority=authority_hex, config=config)
    from p2ptrain.swarm.bootstrap import DEFAULT_LISTEN, serve_bootstrap, start_bootstrap_dht

    listen = validate_listen(args.listen or [DEFAULT_LISTEN])
    identity_dir = Path(args.identity).expanduser()
    with IdentityLock(identity_dir, "--identity"):
        dht_ports_free(listen, "--listen")  # p2pd would share a taken port (SO_REUSEPORT), not fail
        if args.dashboard:
            from p2ptrain.web.dashboard import parse_dashboard_address

            port_free(*parse_dashboard_address(args.dashboard), "--dashboard")
        relay = relay_options(args, announce, authority) if args.relay else None
        dht = start_bootstrap_dht(identity_dir, listen, announce=announce)
        with dht:
            run_until_signal(
                lambda stop: serve_bootstrap(
                    dht,
                    stop,
                    out=sys.stdout,
                    dashboard=args.dashboard,
                    run_id=args.run_id,
                    authority=authority,
                    relay=relay,
                    join=join,
                ),
                on_force=dht.shutdown,
                on_ready=address_file_writer(args.address_file, dht.visible_maddrs),
            )
    print("bootstrap peer stopped", flush=True)
    return 0


def join_arguments(*, config_name: str | None, run_id: str, authority: str, config: Config | None) -> str:
    """What the bootstrap's join line adds to `p2ptrain join --peer …` so that a node that pastes
    it joins the bootstrap's run, not the default one: the config, and the run id and authority
    where they are not the config's."""
    from p2ptrain.config import Config

    run = config.run if config is not None else Config().run
    words = (
        ["--config", Path(config_name).name if Path(config_name).suffix else config_name]
        if config_name
        else []
    )
    if run_id != run.id:
        words += ["--set", f"run.id={run_id}"]
    if authority != run.authority:
        words += ["--set", f"run.authority={authority}"]
    return " ".join(words)


def cmd_status(args: argparse.Namespace) -> int:
    from p2ptrain.node.startup import dht_settings
    from p2ptrain.swarm.dht import SwarmDHT
    from p2ptrain.swarm.membership import observe, read_relays
    from p2ptrain.swarm.records import Heartbeat
    from p2ptrain.swarm.status import format_table, status_json

    config = resolve_config(args, {"run.id": ("--run-id", args.run_id)})
    peers = peers_of(args, config)
    if not peers:
        raise UserError("status needs a bootstrap peer: give --peer MADDR or set PEER")
    settings = dht_settings(
        config.model_copy(update={"swarm": config.swarm.model_copy(update={"peers": peers})}),
        p2p_key=None,
        client_mode=True,
    )
    settings.listen = ("/ip4/127.0.0.1/tcp/0",)
    watch = 0.0 if args.once else 2 * config.swarm.heartbeat_interval + 0.5

    async def read(dht: SwarmDHT) -> tuple[list[Heartbeat], dict[bytes, str], list[Heartbeat]]:
        heartbeats, verdicts = await observe(
            dht, config.run.id, watch=watch, authority=config.run.authority_key
        )
        return heartbeats, verdicts, await read_relays(dht, config.run.id, authority=config.run.authority_key)

    with SwarmDHT.start(settings) as dht:
        heartbeats, verdicts, relays = asyncio.run(read(dht))
    run_id, authority = config.run.id, config.run.authority_key  # the run, open or closed
    if args.json:
        status = status_json(heartbeats, verdicts=verdicts, relays=relays, run_id=run_id, authority=authority)
        print(json.dumps(status))
    else:
        print(format_table(heartbeats, verdicts=verdicts, relays=relays, run_id=run_id, authority=authority))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from p2ptrain.export import export

    config = resolve_config(args)  # the run's, for its tokenizer (data.tokenizer, data.eos_id)
    out = export(
        Path(args.checkpoint).expanduser(),
        Path(args.out_dir).expanduser(),
        dtype=args.dtype,
        allow_diverged=args.allow_diverged,
        data=config.data,
    )
    print(
        f"exported to {out} (model.safetensors, config.json, generation_config.json, tokenizer.json, "
        "tokenizer_config.json): load with transformers' AutoModelForCausalLM.from_pretrained and "
        "AutoTokenizer.from_pretrained"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from p2ptrain.config import load_config
    from p2ptrain.demo import run_demo

    if args.nodes < 1 or args.steps < 1 or args.kill_at < 0 or args.timeout <= 0:
        raise UserError("--nodes and --steps must be at least 1, --kill-at and --timeout not negative")
    load_config("debug", overrides=args.set)  # a bad --set is one line here, not in every node's log
    summary = run_demo(
        Path(args.work_dir),
        nodes=args.nodes,
        steps=args.steps,
        kill_at=args.kill_at,
        timeout=args.timeout,
        quiet=False,  # with --json too: progress lines first, the JSON summary last
        settings=args.set,
    )
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1
