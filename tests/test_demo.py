"""`p2ptrain demo`: the whole system end to end — training, a SIGKILLed node, a joiner that recovers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2ptrain.train.metrics import read_metrics
from tests.helpers import cli, socket_files


@pytest.mark.slow
def test_demo_trains_loses_a_node_takes_in_a_new_one(tmp_path: Path) -> None:
    before = socket_files()
    result = cli(
        "demo", "--json", "--steps", "6", "--kill-at", "2", "--work-dir", str(tmp_path / "demo"), timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True, summary
    assert summary["outer_steps"] == 6 and summary["params_hash_agree"] is True
    assert summary["nodes_max"] == 3 and summary["orphans"] == 0
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["join_s"] is not None and summary["killed"] == "node2" and summary["joined"] == "node3"
    assert all(step["members"] >= 2 for step in summary["steps"])
    assert socket_files() - before == set()
    assert list(Path(summary["checkpoints"]).glob("step-*"))
    # the joiner's own records: a member from its first outer step on, with the others' params
    joined = [r for r in read_metrics(tmp_path / "demo" / "node3" / "metrics.jsonl") if r["kind"] == "outer"]
    assert joined and joined[0]["members"] >= 2 and joined[-1]["step"] == 5


def test_demo_prints_progress_and_a_summary(tmp_path: Path) -> None:
    result = cli(
        "demo",
        "--nodes",
        "1",
        "--steps",
        "2",
        "--kill-at",
        "0",
        "--work-dir",
        str(tmp_path / "d"),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "outer step 1: loss" in result.stdout and "done: 2 outer steps" in result.stdout
    assert "0 orphans" in result.stdout
