from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import cli, socket_files


def test_demo_json_summary(tmp_path: Path):
    before = socket_files()
    result = cli("demo", "--json", "--work-dir", str(tmp_path / "demo"), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["nodes_max"] == 3 and summary["orphans"] == 0
    assert summary["outer_steps"] == 5 and summary["params_hash_agree"] is True
    assert socket_files() - before == set()


def test_demo_prints_the_swarm_table(tmp_path: Path):
    result = cli("demo", "--nodes", "2", "--steps", "2", "--work-dir", str(tmp_path / "demo"), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2/2 nodes in the swarm table" in result.stdout and "2 node(s)" in result.stdout
    assert "outer step 1: 2 members" in result.stdout and "results identical" in result.stdout
