"""The package layout's rules: which folder may import which, no import circles, and a warning
(not a failure) for a module whose code has grown past what one reads at a sitting."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "p2ptrain"
CODE_LINES_WARNING = 500
"""Lines of code (docstrings, comments and blank lines not counted) past which a module is flagged."""

FORBIDDEN = {
    "train": ("p2ptrain.node", "p2ptrain.cli", "p2ptrain.swarm", "p2ptrain.comm"),
    "node": ("p2ptrain.train", "p2ptrain.cli"),
    "ckpt": ("p2ptrain.train", "p2ptrain.node", "p2ptrain.cli"),
    "comm": ("p2ptrain.train", "p2ptrain.node", "p2ptrain.cli", "p2ptrain.ckpt"),
    "swarm": ("p2ptrain.train", "p2ptrain.node", "p2ptrain.cli", "p2ptrain.ckpt"),
}
"""A rank never runs agent code; the libraries of the agent never reach back up into it."""

COMM_LAYERS = ("transport", "codec", "net", "robust", "reduce")
"""comm/'s sub-packages, each importing only those before it (comm/__init__.py maps them)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


@pytest.mark.parametrize("layer", COMM_LAYERS)
def test_comm_layers_import_only_the_layers_below(layer: str) -> None:
    allowed = COMM_LAYERS[: COMM_LAYERS.index(layer) + 1]
    offences = [
        f"{path.relative_to(PACKAGE.parent)} imports {module}"
        for path in sorted((PACKAGE / "comm" / layer).rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module.startswith("p2ptrain.comm.") and module.split(".")[2] not in allowed
    ]
    assert offences == []


def test_no_import_circle() -> None:
    """No two modules import each other, directly or round a circle, `TYPE_CHECKING` imports
    included: a circle means two concerns share one module's state, or one was split by size."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {
        name: {
            target
            for module in imported_modules(path)
            for target in (module, module.rpartition(".")[0])
            if target in paths and target != name and not name.startswith(f"{target}.")
        }
        for name, path in paths.items()
    }
    circles = [sorted(component) for component in strongly_connected(graph) if len(component) > 1]
    assert circles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of a directed graph (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    found.append(component)
    return found


SKIPPED_TOKENS = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring (a string
    standing alone as a statement)."""
    docstrings: set[int] = set()  # a module's, class's or function's, and attributes' below them
    for node in ast.walk(ast.parse(source)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            docstrings.update(range(value.lineno, (value.end_lineno or value.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED_TOKENS:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_modules_of_a_readable_size() -> None:
    """A signal, not a rule: split a module when it holds two concerns, never to fit a number."""
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path in PACKAGE.rglob("*.py")
        if (count := code_lines(path.read_text())) > CODE_LINES_WARNING
    }
    if long:
        warnings.warn(f"modules past {CODE_LINES_WARNING} lines of code: {long}", stacklevel=1)
    assert code_lines('"""doc\nstring"""\n# a comment\n\nx = 1\n') == 1


@pytest.mark.procs
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
