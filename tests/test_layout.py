"""The package layout's rules: which folder may import which, and modules of a readable size."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "p2ptrain"
MAX_LINES = 420

FORBIDDEN = {
    "train": ("p2ptrain.node", "p2ptrain.cli", "p2ptrain.swarm", "p2ptrain.comm"),
    "node": ("p2ptrain.train", "p2ptrain.cli"),
    "ckpt": ("p2ptrain.train", "p2ptrain.node", "p2ptrain.cli"),
    "comm": ("p2ptrain.train", "p2ptrain.node", "p2ptrain.cli", "p2ptrain.ckpt"),
    "swarm": ("p2ptrain.train", "p2ptrain.node", "p2ptrain.cli", "p2ptrain.ckpt"),
}
"""A rank never runs agent code; the libraries of the agent never reach back up into it."""


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folders_import_only_downwards(folder: str) -> None:
    offences = [
        f"{path.relative_to(PACKAGE.parent)} imports {module}"
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module.startswith(FORBIDDEN[folder])
    ]
    assert offences == []


def test_the_rank_entry_imports_nothing_of_the_agent_transitively() -> None:
    """What `python -m p2ptrain.train.rank` loads, followed through p2ptrain's own modules."""
    seen: set[str] = set()
    queue = ["p2ptrain.train.rank"]
    while queue:
        module = queue.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        path = PACKAGE.parent.joinpath(*parts).with_suffix(".py")
        if not path.is_file():
            path = PACKAGE.parent.joinpath(*parts, "__init__.py")
        if path.is_file():
            queue.extend(m for m in imported_modules(path) if m.startswith("p2ptrain"))
    agent_side = sorted(m for m in seen if m.startswith(("p2ptrain.node", "p2ptrain.swarm", "hivemind")))
    assert agent_side == []
    assert "p2ptrain.channel" in seen


def test_no_module_is_too_long_to_read() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_a_training_nodes_agent_and_the_identity_command_load_no_torch_without_a_gpu(tmp_path: Path) -> None:
    """The agent checks the model and the corpus and counts its ranks, and `p2ptrain identity`
    derives the DHT peer ID, without torch: importing it costs 3 s of CPU and ~300 MB in every
    node, and neither computes anything with it."""
    code = """if True:
        import sys
        from argparse import Namespace
        from p2ptrain.cli.commands import cmd_identity
        cmd_identity(Namespace(identity=sys.argv[1]))  # first: the agent's imports would hide it
        identity_loaded = "torch" in sys.modules
        import p2ptrain.node.agent
        from p2ptrain.cli.join import check_trainable
        from p2ptrain.config import load_config
        from p2ptrain.node.rank_launcher import default_nproc, gpu_driver_present
        check_trainable(load_config("debug"))
        gpu = gpu_driver_present()
        print(identity_loaded, 1 if gpu else default_nproc(), "torch" in sys.modules)
    """
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert loaded.stdout.splitlines()[-1].split() == ["False", "1", "False"], loaded.stdout + loaded.stderr
