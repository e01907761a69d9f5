"""The status page: its JSON API over real HTTP, and the page itself in a real headless chromium."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import signal
import sys
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING
from unittest.mock import ANY

import pytest

from p2ptrain.procs import free_port
from p2ptrain.swarm.records import (
    OUTER_STEPS_FIELD,
    STEP_TOKENS_FIELD,
    TOKENS_RATE_FIELD,
    TOKENS_TOTAL_FIELD,
    Heartbeat,
    NodeState,
)
from p2ptrain.swarm.status import format_table, status_json
from p2ptrain.train.metrics import read_metrics
from p2ptrain.web.dashboard import MAX_NODES, Dashboard, parse_dashboard_address
from tests.support.helpers import LocalSwarm, assert_one_line_error, cli, wait_until
from tests.support.records import record

if TYPE_CHECKING:  # selenium comes with '.[dev]'; the browser test is skipped without it
    from selenium.webdriver.chrome.webdriver import WebDriver


def beat(node: int, step: int, *, loss: float | None, state: NodeState = NodeState.TRAINING) -> Heartbeat:
    return record(
        node,
        state=state,
        outer_step=step,
        params_hash="ab" * 32,
        ckpt_digest="cd" * 32,
        extra={} if loss is None else {"loss": loss, "allreduce_mbps": 80.0, "rtt_ms": 212.5},
    )


def test_api_reports_nodes_ring_checkpoints_and_loss_history() -> None:
    readings = [
        [beat(1, 1, loss=4.0), beat(2, 1, loss=4.2)],
        [beat(1, 2, loss=3.5), beat(2, 2, loss=float("nan"))],
    ]

    async def scenario() -> dict:
        # the poller reads the newest heartbeats; an earlier reading was taken before
        dashboard = Dashboard(lambda: asyncio.sleep(0, readings[1]), "r", interval=3600)
        dashboard.observe(readings[0])
        port = await dashboard.start("127.0.0.1", 0)
        try:
            dashboard.observe(readings[1])  # history grows; a NaN loss is not a point
            return await asyncio.to_thread(
                lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status").read())
            )
        finally:
            await dashboard.close()

    status = asyncio.run(scenario())
    assert status["run"] == "r" and len(status["nodes"]) == 2
    assert status["nodes"][0]["loss"] == 3.5 and status["nodes"][0]["allreduce_mbps"] == 80.0
    assert status["nodes"][0]["rtt_ms"] == 212.5
    table = format_table(readings[1])
    assert "rtt" in table.splitlines()[0] and "212ms" in table.splitlines()[2]
    assert status["last_ring"]["step"] == 1 and len(status["last_ring"]["members"]) == 2
    assert status["checkpoint"] == {"digest": "cd" * 32, "agree": 2, "of": 2}
    assert status["history"][(bytes([1]) * 32).hex()] == [[0, 4.0], [1, 3.5]]
    assert status["history"][(bytes([2]) * 32).hex()] == [[0, 4.2]]


def at_work(node: int, step: int, *, total: int, state: NodeState = NodeState.TRAINING) -> Heartbeat:
    """A node's record after `step` - 1: its running total of tokens, 1000 a step at 500 tok/s."""
    fields = {OUTER_STEPS_FIELD: 40, TOKENS_TOTAL_FIELD: total, STEP_TOKENS_FIELD: 1000 * node}
    extra = {"loss": 3.0, "allreduce_mbps": 80.0, TOKENS_RATE_FIELD: 500.0, **fields}
    return dataclasses.replace(beat(node, step, loss=3.0, state=state), tokens=1000 * node, extra=extra)


def test_api_counts_tokens_shows_progress_access_and_what_was_last_seen_once_all_left() -> None:
    """Tokens are running totals that outlive their nodes; the run's progress counts outer steps
    of the run's planned ones; once every node has left, the page gets the last reading in which
    one was live (and when), not an empty table under old curves."""
    authority = bytes(range(32))

    dead = NodeState.DEAD
    readings = [
        [at_work(1, 3, total=3000), at_work(2, 3, total=6000)],
        [at_work(1, 4, total=4000, state=dead), at_work(2, 4, total=8000, state=dead)],
        [],  # their records have expired
    ]

    async def scenario() -> list[dict]:
        # the poller reads once, at the start: the first reading, as this test takes it in too
        dashboard = Dashboard(lambda: asyncio.sleep(0, readings[0]), "r", interval=3600, authority=authority)
        port = await dashboard.start("127.0.0.1", 0)
        dashboard.observe(readings[0])

        def get() -> dict:
            return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status").read())

        try:
            live = await asyncio.to_thread(get)
            for reading in readings[1:]:
                dashboard.observe(reading)
            return [live, await asyncio.to_thread(get)]
        finally:
            await dashboard.close()

    live, left = asyncio.run(scenario())
    assert (live["access"], live["authority"]) == ("closed", authority.hex())
    assert live["progress"] == {"done": 3, "outer_steps": 40, "tokens": 9000, "tokens_per_s": 1000.0}
    assert [(n["tokens"], n["share"]) for n in live["nodes"]] == [(3000, 0.3333), (6000, 0.6667)]
    assert live["live"] == 2 and live["last_known"] is None
    assert left["live"] == 0 and left["nodes"] == [] and left["last_ring"] is None
    assert left["progress"]["tokens"] == 12000, "the tokens of the nodes that left still count"
    known = left["last_known"]
    assert known["seen_at"] <= left["updated"] and known["progress"]["done"] == 3
    assert [node["state"] for node in known["nodes"]] == ["training", "training"]
    assert known["last_ring"]["step"] == 2 and len(left["history"]) == 2


def test_strangers_records_cannot_break_the_page_or_fill_its_memory() -> None:
    """Signed records of an open run, each a stranger's: a loss of inf (the page's JSON said
    `Infinity`, which browsers refuse), a params hash at step 0 (the ring's step came out -1 and
    every reading raised), and more node keys than the page keeps curves of."""
    lies = [beat(1, 0, loss=4.0), beat(2, 3, loss=float("inf")), beat(3, 3, loss=float("-inf"))]
    crowd = [
        dataclasses.replace(beat(4, 3, loss=1.0), node_key=i.to_bytes(2, "big") * 16)
        for i in range(2 * MAX_NODES)
    ]

    async def scenario() -> str:
        dashboard = Dashboard(lambda: asyncio.sleep(0, []), "r", interval=3600)
        port = await dashboard.start("127.0.0.1", 0)
        try:
            dashboard.observe(lies)
            dashboard.observe(crowd)
            return await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status").read().decode()
            )
        finally:
            await dashboard.close()

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is no JSON a browser reads")

    status = json.loads(asyncio.run(scenario()), parse_constant=refuse)
    assert len(status["history"]) == MAX_NODES
    assert crowd[-1].node_key.hex() in status["history"], "the last seen are kept"
    assert format_table(lies[:1]) and status_json(lies[:1])["last_ring"] is None  # alone at step 0
    assert status_json(lies)["last_ring"] == {"step": 2, "members": ANY}
    assert [node["loss"] for node in status_json(lies)["nodes"]] == [4.0, None, None]


@pytest.mark.procs
def test_bad_dashboard_addresses() -> None:
    assert parse_dashboard_address("8080") == ("127.0.0.1", 8080)
    assert parse_dashboard_address("0.0.0.0:9000") == ("0.0.0.0", 9000)
    for bad in ["", "x", "0", "70000", "host:"]:
        with pytest.raises(ValueError, match="--dashboard"):
            parse_dashboard_address(bad)
    assert_one_line_error(cli("bootstrap", "--dashboard", "nope"), "--dashboard nope")


def _browser() -> WebDriver:  # the chromium driver, or a skip that says why
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip(
            "no chromium/chromedriver here; `make test` installs them with apt-get where it can (root)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is installed with '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.mark.procs
def test_status_page_in_a_real_browser(swarm: LocalSwarm, tmp_path: Path) -> None:
    port = free_port()
    swarm.children.spawn(
        "bootstrap",
        [
            *_p2ptrain(),
            "bootstrap",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--identity",
            str(tmp_path / "boot"),
            "--address-file",
            str(tmp_path / "boot.addr"),
            "--dashboard",
            str(port),
        ],
        log_path=tmp_path / "bootstrap.log",
    )
    wait_until((tmp_path / "boot.addr").exists, 30, what="the bootstrap address")
    swarm.bootstrap_addr = (tmp_path / "boot.addr").read_text().split()[0]
    for name in ("a", "b"):
        swarm.start_node(
            name, None, "--set", "train.max_steps=400", "--set", "swarm.wait_nodes=2", command="join"
        )

    def steps(name: str) -> list[dict]:
        return [r for r in read_metrics(swarm.root / name / "metrics.jsonl") if r["kind"] == "outer"]

    wait_until(lambda: len(steps("a")) >= 2 and len(steps("b")) >= 2, 180, what="two outer steps on both")
    browser = _browser()
    try:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        browser.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(browser, 20)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#nodes tbody tr.node-row")) == 2)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#ring circle.ring-node")) == 2)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#loss polyline.loss-curve")) == 2)
        assert "p2ptrain-debug" in browser.find_element(By.ID, "run").text
        # read in one script: the page redraws the table every refresh, and an element found in one
        # call can be gone by the next ("stale element reference", seen on a loaded 2-core machine)
        rows = browser.execute_script(
            "return Array.from(document.querySelectorAll('#nodes tbody tr'),"
            " row => row.innerText.replace(/\\s+/g, ' '))"
        )
        assert len(rows) >= 2, rows
        assert all(("training" in row or "ready" in row or "syncing" in row) for row in rows), rows
        assert all(" open " in row for row in rows), rows  # each dialed the other back: reachable
        assert len(browser.find_elements(By.CSS_SELECTOR, "#ring line.ring-edge")) == 2
        # the run's progress, the tokens in all and the swarm's rate, open or closed
        text = "return document.getElementById(arguments[0]).textContent"
        wait.until(
            lambda d: re.fullmatch(
                r"tokens: [1-9][\d,]* in all · swarm [\d,]+ tok/s", d.execute_script(text, "tokens")
            )
        )
        assert re.fullmatch(r"outer steps: [1-9]\d* of 40 done", browser.execute_script(text, "steps"))
        assert browser.execute_script(text, "access") == "open run"
        assert any(re.search(r" \d+ % ", row) for row in rows), rows  # each node's share of the last step
        # each node's round trip to the other, as its kernel measured it: the round trip cell's title
        paths = browser.execute_script(
            "return Array.from(document.querySelectorAll('#nodes tbody tr td:nth-child(8)'),"
            " cell => cell.title)"
        )
        assert all(re.fullmatch(r"to [0-9a-f]{12}: \d+ ms", title) for title in paths), paths
        # the loss plot has its axes: ticks with labels on both, and what each one is
        for axis in ("x-axis", "y-axis"):
            assert len(browser.find_elements(By.CSS_SELECTOR, f"#loss .{axis} text.tick")) >= 2, axis
        labels = (
            "return Array.from(document.querySelectorAll('#loss .axis-label'), label => label.textContent)"
        )
        assert browser.execute_script(labels) == ["outer step", "loss"]
        # every node leaves: the page keeps the last known state, says so and since when
        for name in ("a", "b"):
            swarm.children.signal(name, signal.SIGTERM)
        for name in ("a", "b"):
            assert swarm.children.wait(name, 60) == 0, swarm.log(name)
        wait.until(lambda d: d.execute_script("return !document.getElementById('stale').hidden"))
        stale = browser.execute_script(text, "stale")
        assert "No live node now" in stale and "last known state, as seen at" in stale, stale
        assert len(browser.find_elements(By.CSS_SELECTOR, "#nodes.stale tbody tr.node-row")) == 2
        # the ring of the last step seen: both, or one alone if the second to get its SIGTERM
        # finished a step without the first (seen in CI on a loaded machine) -- whichever it was,
        # the page draws the ring the API holds
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status") as reply:
            last_ring = json.loads(reply.read())["last_known"]["last_ring"]
        assert 1 <= len(last_ring["members"]) <= 2, last_ring
        circles = browser.find_elements(By.CSS_SELECTOR, "#ring circle.ring-node")
        assert len(circles) == len(last_ring["members"]), last_ring
        assert "last seen" in browser.execute_script(text, "ring-step")
        assert "no completed step yet" not in browser.execute_script(text, "ring")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#loss polyline.loss-curve")) == 2
    finally:
        browser.quit()


def _p2ptrain() -> list[str]:
    return [sys.executable, "-m", "p2ptrain"]
