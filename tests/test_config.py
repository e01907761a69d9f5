from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from p2ptrain import config_reference
from p2ptrain.config import CONFIG_DIR, CommConfig, Config, config_differences, load_config
from p2ptrain.config_reference import undocumented
from p2ptrain.errors import ConfigError
from tests.support.helpers import assert_one_line_error, cli

CONFIG_FILES = sorted(CONFIG_DIR.glob("*.toml"))


def test_the_bundled_configs_exist() -> None:
    names = {path.stem for path in CONFIG_FILES}
    assert {"debug", "20m", "150m", "1b"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_every_bundled_config_loads(path: Path) -> None:
    config = load_config(path, environ={})
    assert config.model.name == path.stem
    assert config.model.dim % config.model.n_heads == 0
    assert config.model.n_heads % config.model.n_kv_heads == 0


def test_bare_name_resolves_to_bundled_file() -> None:
    assert load_config("debug", environ={}) == load_config(CONFIG_DIR / "debug.toml", environ={})


@pytest.mark.procs
def test_config_by_name_or_path_from_any_directory(tmp_path: Path) -> None:
    """The bundled configs ship inside the package: `--config debug.toml` works outside the
    checkout (it used to look for ./debug.toml, and `configs/debug.toml` only worked in it)."""
    own = tmp_path / "sub" / "mine.toml"
    own.parent.mkdir()
    own.write_text('[run]\nid = "mine"\n')
    for name, run_id in [
        ("debug.toml", "p2ptrain-debug"),
        ("20m", "p2ptrain-20m"),
        ("sub/mine.toml", "mine"),
    ]:
        shown = cli("config", "show", "--json", "--config", name, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["run"]["id"] == run_id
    assert load_config(own, environ={}).run.id == "mine"  # an absolute path
    for bad in ("debugg", "configs/debug.toml"):
        assert_one_line_error(
            cli("config", "show", "--config", bad, cwd=tmp_path),
            f"--config {bad}: config file not found",
            "bundled: 10b, 150m, 1b, 20m, 7b, debug",
        )


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[model]\ndimm = 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert str(path) in str(error.value) and "model.dimm" in str(error.value)


def test_unknown_section_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[modle]\ndim = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'modle'"):
        load_config(path, environ={})


def test_wrong_type_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert str(path) in str(error.value) and "train.lr" in str(error.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[train\nlr = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, environ={})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.toml", environ={})


def test_precedence_file_then_env_then_flags() -> None:
    env = {"P2PTRAIN_TRAIN__LR": "0.5", "P2PTRAIN_SWARM__HEARTBEAT_INTERVAL": "2"}
    config = load_config("debug", environ=env, overrides=["train.lr=0.25"])
    assert config.train.lr == 0.25  # flag beats environment
    assert config.swarm.heartbeat_interval == 2.0  # environment beats file
    assert config.model.dim == 128  # file beats defaults


def test_env_error_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="P2PTRAIN_TRAIN__LR"):
        load_config("debug", environ={"P2PTRAIN_TRAIN__LR": "abc"})


def test_flag_error_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--set model.dimm=3: unknown key 'model.dimm'"):
        load_config("debug", environ={}, overrides=["model.dimm=3"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config("debug", environ={}, overrides=["model.dim"])


def test_string_values_need_no_quotes() -> None:
    assert load_config(None, environ={}, overrides=["run.id=my-run"]).run.id == "my-run"


def test_digest_covers_the_model_but_not_local_settings() -> None:
    base = load_config("debug", environ={})
    assert base.digest() == load_config("debug", environ={}, overrides=["node.work_dir=/x"]).digest()
    assert base.digest() != load_config("debug", environ={}, overrides=["model.dim=64"]).digest()
    # the shape of the all-reduce must match too; its deadline may differ
    assert base.digest() != load_config("debug", environ={}, overrides=["comm.connections=2"]).digest()
    assert base.digest() == load_config("debug", environ={}, overrides=["comm.failure_timeout=9"]).digest()


@pytest.mark.procs
def test_config_show_prints_resolved_values() -> None:
    result = cli(
        "config", "show", "--config", "debug", "--set", "train.lr=0.125", "--set", "outer.overlap.steps=3"
    )
    assert result.returncode == 0, result.stderr
    assert "lr = 0.125" in result.stdout and "[model]" in result.stdout
    reparsed = result.stdout
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    shown = Config.model_validate(tomllib.loads(reparsed))
    assert shown == load_config("debug", overrides=["train.lr=0.125", "outer.overlap.steps=3"], environ={})


@pytest.mark.procs
def test_config_show_reports_errors_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[model]\ndimm = 3\n")
    assert_one_line_error(cli("config", "show", "--config", str(path)), str(path), "model.dimm")
    assert_one_line_error(
        cli("config", "show", env={"P2PTRAIN_SWARM__HEARTBEAT_TIMEOUT": "-1"}),
        "P2PTRAIN_SWARM__HEARTBEAT_TIMEOUT",
    )


def test_the_shared_fields_are_those_marked_and_no_others() -> None:
    """What every node of a run must share is read from the SHARED marks on the fields; a field
    gained or lost there changes who may train together, so the set is spelled out here."""
    shared = Config().shared()
    dotted = {f"{section}.{key}" for section, keys in shared.items() for key in keys}
    assert dotted == {
        *(f"run.{key}" for key in ("id", "authority")),
        *(f"model.{key}" for key in Config().model.model_dump()),
        *(f"train.{key}" for key in ("inner_steps", "max_batch_size", "lr", "weight_decay")),
        *(f"train.{key}" for key in ("warmup_steps", "max_steps", "grad_clip", "seed")),
        *(f"outer.{key}" for key in ("lr", "momentum", "nesterov", "overlap")),
        *(f"comm.{key}" for key in ("quant_block", "bits", "chunk_bytes", "connections", "zstd")),
        *(f"comm.{key}" for key in ("topology", "robust", "clip")),
        *(f"comm.{key}" for key in ("codec", "sparse_chunk", "sparse_k", "error_feedback")),
    }
    assert set(shared["outer"]["overlap"]) == set(Config().outer.overlap.model_dump())


def test_an_open_run_aggregates_robustly_by_default_and_a_closed_one_keeps_its_operators_choice() -> None:
    """comm.robust "auto" is settled when the run's config is built: the reweighted mean where anyone
    may join (the README's first join line sets nothing), the plain mean where an authority admits
    every member, and whatever is set explicitly in either."""
    authority = ["run.authority=" + "ab" * 32]
    assert load_config("debug", environ={}).comm.robust == "reweighted"
    assert load_config("debug", overrides=authority, environ={}).comm.robust == "off"
    closed = load_config("debug", overrides=[*authority, "comm.robust=reweighted"], environ={})
    assert closed.comm.robust == "reweighted"
    assert load_config("debug", overrides=["comm.robust=off"], environ={}).comm.robust == "off"
    assert CommConfig().aggregation == "off"  # no run to ask: the plain mean
    with pytest.raises(ConfigError, match=r'comm\.robust = "off"'):
        load_config("debug", overrides=["comm.clip=0"], environ={})


def test_a_setting_that_differs_is_named_by_its_dotted_key() -> None:
    mine = load_config("debug", overrides=["outer.overlap.steps=3"], environ={})
    theirs = load_config("debug", environ={})
    differences = config_differences(mine.shared(), theirs.shared())
    assert differences == ["outer.overlap.steps is 3 here, 0 in the swarm"]
    assert mine.digest() != theirs.digest()
    junk: dict[str, Any] = {"outer": {"overlap": [1, {"x": 2}]}, "comm": 5}  # a peer's, any shape
    assert len(config_differences(mine.shared(), junk)) > 10


def test_a_moved_key_says_where_it_went() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'outer.overlap_steps' \(it is outer.overlap.steps now\)"
    ):
        load_config("debug", overrides=["outer.overlap_steps=3"], environ={})
    assert load_config("debug", overrides=["outer.overlap=true"], environ={}).outer.overlap.enabled


def test_the_overlap_switch_combines_with_its_keys_in_every_layer(tmp_path: Path) -> None:
    """`outer.overlap = true` in a file and `--set outer.overlap.steps=3` over it were an error;
    `P2PTRAIN_OUTER__OVERLAP=true` over a file's `[outer.overlap] steps = 3` reset steps to 0."""
    switched = tmp_path / "switched.toml"
    switched.write_text("[outer]\noverlap = true\n")
    tabled = tmp_path / "tabled.toml"
    tabled.write_text("[outer.overlap]\nsteps = 3\n")
    one = load_config(switched, overrides=["outer.overlap.steps=3"], environ={}).outer.overlap
    other = load_config(tabled, environ={"P2PTRAIN_OUTER__OVERLAP": "true"}).outer.overlap
    assert one == other and one.enabled and one.steps == 3


def test_the_configuration_reference_is_generated_and_up_to_date() -> None:
    """docs/configuration.md is rendered from the fields' docstrings: no field without one, and
    the file as committed is what the models render now."""
    assert undocumented() == []
    assert config_reference.main(["--check"]) == 0, "run: python -m p2ptrain.config_reference"
