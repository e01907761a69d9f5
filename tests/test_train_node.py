"""Training nodes as real processes: agent + trainer ranks, solo and in a swarm on 127.0.0.1."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from p2ptrain.ckpt.format import checkpoint_places
from p2ptrain.config import load_config
from p2ptrain.identity import load_or_create_identity
from p2ptrain.node.checkpoint_copies import flush_leftovers
from p2ptrain.node.rank_launcher import remove_stale_buffers
from p2ptrain.procs import command_line, descendants, is_alive
from p2ptrain.train.metrics import read_metrics
from tests.support.helpers import (
    LIGHT,
    LIGHT_SETTINGS,
    LocalSwarm,
    assert_one_line_error,
    cli,
    outer_records,
    wait_until,
)

pytestmark = pytest.mark.procs
"""Every test here starts processes."""

SHORT = ["--set", "train.max_steps=30"]  # 3 outer steps of H=10 on the debug config
SOLO = [*LIGHT, "--set", "train.inner_steps=5", "--set", "train.max_steps=15"]
"""3 outer steps of H=5 (of the tests' light batches): alone, what is tested is the outer steps
(checkpoints, resume, export), not how long each inner phase is."""


def solo_node(work_dir: Path, **popen: Any) -> subprocess.Popen:
    """A node training alone with two ranks, long enough to be stopped in the middle."""
    argv = ["join", "--config", "debug", "--work-dir", str(work_dir), "--nproc", "2"]
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", *argv], **popen)


def rank_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the trainer ranks below `agent_pid`."""
    found = {}
    for pid in descendants(agent_pid):
        if "p2ptrain.train.rank" in command_line(pid):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(item[5:]) for item in environ if item.startswith(b"RANK="))
            found[rank] = pid
    return found


@pytest.mark.procs
@pytest.mark.parametrize(
    ("overlap", "merge_after", "on_arrival"), [(False, 0, False), (True, 4, False), (True, 1, True)]
)
def test_two_nodes_of_two_ranks_hold_the_same_params_after_every_outer_step(
    swarm: LocalSwarm, overlap: bool, merge_after: int, on_arrival: bool
) -> None:
    """With outer.overlap too: each step syncs during the next inner phase (its result taken 4 inner
    steps into it; taken at the end of the phase, test_faults' [True] cases; or, on arrival, after the
    first step from the first on at whose end rank 0 has it, which both ranks of a node must agree
    on), and S (whose hash the records hold) is the same on both nodes after every step."""
    swarm.start_bootstrap()
    mode = [
        "--set",
        f"outer.overlap.enabled={str(overlap).lower()}",
        "--set",
        f"outer.overlap.steps={merge_after}",
    ]
    mode += ["--set", f"outer.overlap.take_on_arrival={str(on_arrival).lower()}"]
    for shard, name in enumerate(("a", "b")):  # pinned: two random node keys share a shard 1 time in 64
        pinned = ["--set", f"data.shard={shard}"]
        swarm.start_node(
            name, None, "--nproc", "2", *SHORT, *pinned, *mode, "--set", "swarm.wait_nodes=2", command="join"
        )
    for name in ("a", "b"):
        assert swarm.children.wait(name, 240) == 0, swarm.log(name)
    a, b = outer_records(swarm.root / "a"), outer_records(swarm.root / "b")
    assert [r["step"] for r in a] == [0, 1, 2] == [r["step"] for r in b]
    for mine, theirs in zip(a, b, strict=True):
        assert mine["members"] == theirs["members"] == 2
        assert mine["params_hash"] == theirs["params_hash"]
    assert a[0]["loss"] != b[0]["loss"]  # the nodes read different shards of the corpus
    assert "deathrattle sent" in swarm.log("a")
    if overlap:  # steps 0 and 1 taken in the next phase, at τ or (on arrival) from τ to its end
        taken = [[r["taken_after_steps"] for r in records[:2]] for records in (a, b)]
        assert all(
            steps == merge_after or (on_arrival and merge_after <= steps <= 10)
            for steps in taken[0] + taken[1]
        ), taken
        print("taken after inner steps (a, b):", taken)


@pytest.mark.procs
def test_a_nan_contribution_is_left_out_and_another_config_is_refused(swarm: LocalSwarm) -> None:
    swarm.start_bootstrap()
    # 6 outer steps: a and b must still be training when c reaches its first outer step
    run = ["--set", "train.max_steps=60", "--set", "swarm.wait_nodes=2"]
    swarm.start_node("a", None, *run, command="join")
    swarm.start_node("b", None, *run, command="join", env={"P2PTRAIN_INJECT_NAN_STEP": "1"})
    wait_until(lambda: len(outer_records(swarm.root / "a")) >= 1, 180, what="the first outer step")
    refused = swarm.start_node("c", None, "--set", "model.n_layers=2", command="join")
    assert refused is not None
    assert swarm.children.wait("c", 60) == 2
    assert (
        "p2ptrain: error: run 'p2ptrain-debug' trains with other settings: model.n_layers is 2 here, 4 in"
        in (swarm.log("c"))
    )
    for name in ("a", "b"):
        assert swarm.children.wait(name, 240) == 0, swarm.log(name)
    a, b = outer_records(swarm.root / "a"), outer_records(swarm.root / "b")
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["finite"] for r in b] == [True, False, True, True, True, True]  # b's NaN stayed in b
    assert all(math.isfinite(r["loss"]) for r in a + b)


@pytest.mark.procs
def test_a_node_that_comes_after_every_node_finished_and_left_is_told_the_run_is_over(
    swarm: LocalSwarm,
) -> None:
    """Nothing is left to catch up to: one line that says why, not only that no majority offers a
    checkpoint (or, for a node that waits for others to start a run, that too few joined)."""
    swarm.start_bootstrap()
    run = ["--set", "train.max_steps=20", "--set", "swarm.wait_nodes=2"]  # 2 outer steps
    for name in ("a", "b"):
        swarm.start_node(name, None, *run, command="join")
    for name in ("a", "b"):
        assert swarm.children.wait(name, 240) == 0, swarm.log(name)
    swarm.start_node("late", None, "--set", "train.max_steps=20", command="join")
    assert swarm.children.wait("late", 120) == 1, swarm.log("late")
    errors = [line for line in swarm.log("late").splitlines() if line.startswith("p2ptrain: error:")]
    assert len(errors) == 1, errors
    assert (
        "run 'p2ptrain-debug' is over: 2 node(s) finished it after 2 outer steps and left, and none is "
        "left to offer its checkpoint (a new run needs another run.id)" in errors[0]
    )
    assert "Traceback" not in swarm.log("late")
    # one that waits for nodes to start a run says so when its wait runs out
    waits = ["--set", "swarm.wait_nodes=2", "--set", "swarm.election_timeout=3"]
    swarm.start_node("waiting", None, "--set", "train.max_steps=20", *waits, command="join")
    assert swarm.children.wait("waiting", 120) == 2, swarm.log("waiting")
    assert (
        "p2ptrain: error: fewer than 2 nodes joined within 3 s: run 'p2ptrain-debug' is over: 2 node(s) "
        "finished it after 2 outer steps and left" in swarm.log("waiting")
    )


@pytest.mark.procs
def test_alone_then_export_to_hugging_face(tmp_path: Path) -> None:
    work = tmp_path / "node"
    remote = f'checkpoint.remote="file://{tmp_path}/bucket/run"'
    result = cli("join", "--config", "debug", "--work-dir", str(work), *SOLO, "--set", remote, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "training alone" in result.stdout
    assert "finished after 3 outer steps" in result.stdout
    assert [r["members"] for r in outer_records(work)] == [1, 1, 1]
    checkpoints = sorted((work / "checkpoints").glob("step-*"))
    assert [path.name for path in checkpoints] == ["step-00000001", "step-00000002", "step-00000003"]
    uploaded = tmp_path / "bucket" / "run" / "step-00000003"  # the fsspec copy (here file://)
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(p.name for p in checkpoints[-1].iterdir())
    assert_one_line_error(
        cli("join", "--config", "debug", "--work-dir", str(tmp_path / "empty"), "--resume", "latest"),
        "no checkpoint in",
    )
    assert_one_line_error(
        cli("join", "--config", "debug", "--work-dir", str(work), "--resume", str(tmp_path)),
        "not a checkpoint folder",
    )

    resumed = cli(
        "join",
        "--config",
        "debug",
        "--work-dir",
        str(work),
        "--resume",
        "latest",
        *SOLO[:-2],
        "--set",
        "train.max_steps=20",
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at outer step 3" in resumed.stdout and "finished after 4 outer steps" in resumed.stdout
    checkpoints = sorted((work / "checkpoints").glob("step-*"))

    out = tmp_path / "hf-model"
    exported = export_with_umask(0o022, str(work), str(out))
    assert exported.returncode == 0, exported.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["eos_token_id"] == 0  # the bytes tokenizer's EOS, put between documents
    files = {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert {path.name for path in out.iterdir()} == files
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()} == dict.fromkeys(
        files, 0o644
    )
    transformers = pytest.importorskip("transformers", reason="install 'p2ptrain[hf]' to check loading")
    from p2ptrain.config import load_config
    from p2ptrain.train.checkpoint import load_params
    from p2ptrain.train.model import Transformer

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.eos_token_id == 0 and hf_model.generation_config.eos_token_id == 0
    ours = Transformer(load_config("debug", overrides=list(LIGHT_SETTINGS)).model)
    ours.load_state_dict(load_params(checkpoints[-1])[0])
    tokens = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
    # the tokenizer makes the ids training made of a text (one per UTF-8 byte; "<0x00>" typed in a
    # text is six bytes, not EOS), and transformers' logits on them are ours
    text = "def naïve(x):\n    return '<0x00>' + x\0"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(text.encode()) and tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
        # generate: transformers' greedy tokens are our model's, and decode to text
        prompt = tokenizer("def main(", return_tensors="pt").input_ids
        generated = hf_model.generate(prompt, max_new_tokens=8, do_sample=False)[0]
        greedy = prompt[0].tolist()
        while len(greedy) < len(generated):  # it stops at EOS (id 0), if it comes
            greedy.append(int(ours(torch.tensor([greedy]))[0, -1].argmax()))
    assert generated.tolist() == greedy
    assert tokenizer.decode(generated, skip_special_tokens=True).startswith("def main(")
    # the lines the README gives a researcher (and docs/02) run as they are, beside the export
    lines = generation_lines(ROOT / "README.md")
    assert lines == generation_lines(ROOT / "docs" / "02-running-a-node.md")
    ran = subprocess.run(
        [sys.executable, "-c", lines], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and ran.stdout.startswith("def main(") and len(ran.stdout) > 12, ran

    # a run trained with a tokenizer.json: its copy, without the BOS its post-processor would add
    hf_tokenizer = tokenizer_json(tmp_path / "tokenizer.json")
    with_file = export_with_umask(
        0o027, str(work), str(tmp_path / "hf2"), "--set", f'data.tokenizer="{tmp_path / "tokenizer.json"}"'
    )
    assert with_file.returncode == 0, with_file.stderr
    assert stat.S_IMODE((tmp_path / "hf2" / "model.safetensors").stat().st_mode) == 0o640  # the umask's
    copied = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf2"))
    for text in ["the quick brown fox", "fox<|endoftext|>the dog"]:
        assert copied(text).input_ids == hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert hf_tokenizer.encode("fox").ids[0] == 0  # the post-processor that was left out
    assert copied.eos_token_id == 0
    assert json.loads((tmp_path / "hf2" / "generation_config.json").read_text())["eos_token_id"] == 0

    # a folder of node work dirs (a demo's) names them
    assert_one_line_error(
        cli("export", str(tmp_path), str(tmp_path / "x")),
        f"{tmp_path}: no checkpoint here; node folders: node/ — export one of them",
    )
    (tmp_path / "nothing").mkdir()
    assert_one_line_error(
        cli("export", str(tmp_path / "nothing"), str(tmp_path / "x")), "no checkpoint there"
    )
    assert_one_line_error(cli("export", str(work), str(tmp_path / "y"), "--dtype", "int3"), "--dtype")


ROOT = Path(__file__).resolve().parent.parent


def export_with_umask(umask: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`p2ptrain export ARGS` run under `umask` (the child inherits it)."""
    before = os.umask(umask)
    try:
        return cli("export", *args, timeout=120)
    finally:
        os.umask(before)


def generation_lines(page: Path) -> str:
    """The Python lines a page gives for generating text from an export (`python - <<'EOF'`)."""
    found = re.search(r"python - <<'EOF'\n(.*?)\nEOF\n", page.read_text(), re.S)
    assert found is not None, page
    return found.group(1)


def tokenizer_json(path: Path) -> Any:
    """A small BPE tokenizer.json whose post-processor puts <|endoftext|> (id 0) before a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<|endoftext|>", "[UNK]"])
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tokenizer.save(str(path))
    return tokenizer


@pytest.mark.procs
def test_a_dead_rank_sends_the_deathrattle_and_stops_the_node(swarm: LocalSwarm) -> None:
    swarm.start_bootstrap()
    swarm.start_node("a", None, "--nproc", "2", command="join")
    node = swarm.children.children["a"]
    wait_until(
        lambda: any(r["kind"] == "inner" for r in read_metrics(swarm.root / "a" / "metrics.jsonl")),
        120,
        what="the first inner step",
    )
    ranks = rank_pids(node.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)
    assert swarm.children.wait("a", 30) == 1
    assert "p2ptrain: error: trainer rank 1 was killed by signal 9" in swarm.log("a")
    assert "deathrattle sent" in swarm.log("a")
    assert not is_alive(ranks[0])
    # the record still exists (it expires 6 s after the last heartbeat) and says dead
    states = {n["state"] for n in swarm.status()["nodes"]}
    assert states == {"dead"}


@pytest.mark.procs
def test_sigterm_stops_a_training_node_cleanly(tmp_path: Path) -> None:
    agent = solo_node(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(
            lambda: any(r["kind"] == "inner" for r in read_metrics(tmp_path / "metrics.jsonl")),
            120,
            what="the first inner step",
        )
        ranks = rank_pids(agent.pid)
        shared = list(Path("/dev/shm").glob(f"p2ptrain-*-{agent.pid}.grad"))
        assert len(shared) == 1
        agent.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, stderr = agent.communicate(timeout=15)
        assert time.monotonic() - started < 5, "a node must stop within 5 s of SIGTERM"
        assert agent.returncode == 0 and "Traceback" not in stderr, stderr
        assert not any(is_alive(pid) for pid in ranks.values())
        assert not shared[0].exists()
    finally:
        agent.kill()
        agent.communicate()


@pytest.mark.procs
def test_a_killed_agent_takes_its_ranks_along(tmp_path: Path) -> None:
    agent = solo_node(tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(rank_pids(agent.pid)) == 2, 60, what="two ranks")
        ranks = rank_pids(agent.pid)
        agent.kill()
        agent.wait()
        wait_until(lambda: not any(is_alive(pid) for pid in ranks.values()), 20, what="the ranks to die")
    finally:
        agent.kill()
        agent.wait()
    # what the killed agent left in /dev/shm is cleared by the node's next start (done here by hand)
    identity = load_or_create_identity(tmp_path)
    config = load_config("debug", overrides=[f'node.work_dir="{tmp_path}"'])
    remove_stale_buffers(identity, tmp_path)
    flush_leftovers(checkpoint_places(config, identity.short_id, tmp_path), keep=3)
    assert not list(Path("/dev/shm").glob(f"p2ptrain-{identity.short_id}*"))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "model.n_kv_heads=3"], "n_kv_heads"),
        (["--set", 'data.paths=["/nonexistent/corpus"]'], "/nonexistent/corpus does not exist"),
        (["--set", "data.tokenizer=missing.json"], "data.tokenizer"),
        (["--nproc", "0"], "--nproc"),
        (["--set", 'checkpoint.remote="nosuch://bucket/run"'], "checkpoint.remote nosuch://bucket/run"),
    ],
)
def test_bad_training_settings_fail_with_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = cli("join", "--config", "debug", "--work-dir", str(tmp_path), *args, timeout=60)
    assert_one_line_error(result, needle)
