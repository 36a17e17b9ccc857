"""CLI: help text, override plumbing, dist_env first, the --nproc-per-node launch, in-process
under an external torchrun, lazily imported commands."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
import warnings

import pytest

from hybridtrain import cli
from hybridtrain.config import dist_env as dist_env_mod

_real_setup_logging = cli.setup_logging

RECIPE = """\
model:
  _target_: torch.nn.Linear
  in_features: 4
  out_features: 2
training:
  max_steps: 10
dist_env:
  hybridtrain_test_flag: true
"""


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


@pytest.fixture(autouse=True)
def _isolate(monkeypatch):
    monkeypatch.setattr(cli, "setup_logging", lambda *a, **k: None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HYBRIDTRAIN_TEST_FLAG"):
        monkeypatch.setenv(var, "")  # recorded, so the original state comes back afterwards
        monkeypatch.delenv(var)
    dist_env_mod._REPORTED.clear()


@pytest.fixture
def fake_finetune(monkeypatch):
    calls = []
    mod = types.ModuleType("hybridtrain.recipes.finetune")

    def run(cfg):
        calls.append((cfg, os.environ.get("HYBRIDTRAIN_TEST_FLAG")))

    mod.run = run
    monkeypatch.setitem(sys.modules, "hybridtrain.recipes.finetune", mod)
    return calls


# -------------------------------------------------------------------------------- help
def test_top_level_help_lists_commands_and_override_syntax(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("finetune", "benchmark", "convert", "merge", "--section.key=VALUE",
                 "--+section.new_key", "${env:VAR,default}", "training", "dist_env"):
        assert word in out


@pytest.mark.parametrize("command", ["finetune", "benchmark"])
def test_command_help_lists_common_options(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("-c RECIPE.yaml", "--config", "--nproc-per-node", "--print-config",
                 "--section.key=VALUE", "--+section.new_key", "HYBRIDTRAIN_FILTER_WARNINGS"):
        assert word in out


def _parsers_of(command: str, monkeypatch) -> list:
    """Every argparse parser ``hybridtrain COMMAND --help`` builds (generate and merge build
    their own)."""
    import argparse

    seen = []
    real = argparse.ArgumentParser.parse_known_args

    def record(self, *a, **kw):
        seen.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", record)
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return seen


@pytest.mark.parametrize("command", ["finetune", "benchmark", "dpo", "grpo", "evaluate", "plan",
                                     "convert", "generate", "merge"])
def test_every_option_of_every_command_has_help(command, monkeypatch, capsys):
    import argparse

    parsers = _parsers_of(command, monkeypatch)
    sub = [a for p in parsers for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    parsers += [sp for a in sub for name, sp in a.choices.items() if name == command]
    options = [(p.prog, a) for p in parsers for a in p._actions
               if not isinstance(a, argparse._SubParsersAction)]
    assert len(options) > 3
    bare = [(prog, a.option_strings or a.dest) for prog, a in options if not a.help]
    assert not bare, f"options without a help string: {bare}"
    out = capsys.readouterr().out
    assert "``" not in out  # no reStructuredText markup in the help


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "hybridtrain", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "finetune" in out and "convert" in out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_convert_needs_two_paths(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "only_one"])
    assert e.value.code == 2


# -------------------------------------------------------------------------------- finetune
def test_finetune_runs_in_process_with_overrides_and_dist_env(recipe, fake_finetune):
    assert cli.main(["finetune", "-c", str(recipe), "--training.max_steps", "3",
                     "--+model.bias=false", "--training.seed=5"]) == 0
    (cfg, flag), = fake_finetune
    assert cfg.training.max_steps == 3 and cfg.training.seed == 5 and cfg.model.bias is False
    assert flag == "1"  # dist_env applied before the recipe ran


def test_overrides_may_come_before_config(recipe, fake_finetune):
    assert cli.main(["finetune", "--training.max_steps=4", "--config", str(recipe)]) == 0
    assert fake_finetune[0][0].training.max_steps == 4


def test_config_error_is_a_clean_message(recipe, fake_finetune, capsys):
    assert cli.main(["finetune", "-c", str(recipe), "--training.max_stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "hybridtrain: error: unknown key 'training.max_stpes'" in err
    assert "did you mean 'max_steps'" in err and "Traceback" not in err
    assert fake_finetune == []


def test_print_config(recipe, fake_finetune, capsys):
    assert cli.main(["finetune", "-c", str(recipe), "--print-config",
                     "--training.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out and "global_batch_size:" in out
    assert fake_finetune == []


@pytest.mark.parametrize("override, key", [("--optimizer.lr=-0.1", "optimizer.lr"),
                                           ("--training.micro_batch_size=0", "training.micro_batch_size"),
                                           ("--optimizer.eps=-1e-8", "optimizer.eps")])
@pytest.mark.parametrize("print_config", [False, True])
def test_bad_values_are_refused_at_start_up(recipe, fake_finetune, capsys, override, key,
                                            print_config):
    """Out-of-range values name their key before anything is built (also with --print-config)."""
    argv = ["finetune", "-c", str(recipe), override] + (["--print-config"] if print_config else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"'{key}' must be >= " in err and "Traceback" not in err
    assert fake_finetune == []


def test_missing_command_module_is_a_clear_error(recipe, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hybridtrain.recipes.finetune", None)
    assert cli.main(["finetune", "-c", str(recipe)]) == 2
    assert "'hybridtrain finetune' is not available" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "hybridtrain.recipes.merge", None)
    assert cli.main(["merge", "a", "b"]) == 2
    assert "'hybridtrain merge' is not available" in capsys.readouterr().err


def test_merge_and_convert_dispatch(monkeypatch, tmp_path):
    seen = {}
    merge = types.ModuleType("hybridtrain.recipes.merge")
    merge.run = lambda argv: seen.setdefault("merge", argv) and 0
    ckpt = types.ModuleType("hybridtrain.training.checkpoint_reader")
    ckpt.convert = lambda src, dst: seen.setdefault("convert", (src, dst))
    monkeypatch.setitem(sys.modules, "hybridtrain.recipes.merge", merge)
    monkeypatch.setitem(sys.modules, "hybridtrain.training.checkpoint_reader", ckpt)
    assert cli.main(["merge", "--adapter", "x", "--help"]) == 0
    assert seen["merge"] == ["--adapter", "x", "--help"]
    assert cli.main(["convert", "runs/a/step_4", "out_hf"]) == 0
    assert seen["convert"] == ("runs/a/step_4", "out_hf")


# -------------------------------------------------------------------------------- launcher
def test_worker_argv_and_strip_nproc_flag():
    from hybridtrain.launch import worker_argv

    args = cli.strip_nproc_flag(["-c", "r.yaml", "--nproc-per-node", "4", "--training.max_steps=5",
                                 "--optimizer.lr", "1e-4"])
    assert worker_argv("finetune", args, python="/usr/bin/python3") == [
        "/usr/bin/python3", "-m", "hybridtrain", "finetune", "-c", "r.yaml",
        "--training.max_steps=5", "--optimizer.lr", "1e-4"]
    assert cli.strip_nproc_flag(["--nproc_per_node=2", "-c", "x", "--nproc-per-node", "8"]) \
        == ["-c", "x"]


def test_an_error_is_reported_once_per_launch(tmp_path):
    from hybridtrain.launch import first_to_report

    env = {"HYBRIDTRAIN_ERROR_DIR": str(tmp_path)}
    assert first_to_report("hybridtrain: error: x", env)  # the first worker prints it
    assert not first_to_report("hybridtrain: error: x", env)  # the others do not
    assert first_to_report("hybridtrain: error: y", env)  # another message is printed
    assert first_to_report("hybridtrain: error: x", {})  # not launched by hybridtrain: always


def test_nproc_starts_workers_and_returns_their_status(recipe, fake_finetune, monkeypatch):
    launches = []

    def fake_launch(command, args, nproc):
        launches.append((command, args, nproc))
        return 75

    monkeypatch.setattr(cli, "launch", fake_launch)
    assert cli.main(["finetune", "-c", str(recipe), "--nproc-per-node", "2",
                     "--training.max_steps=3"]) == 75
    assert launches == [("finetune", ["-c", str(recipe), "--training.max_steps=3"], 2)]
    assert os.environ["HYBRIDTRAIN_TEST_FLAG"] == "1"  # children inherit dist_env
    assert fake_finetune == []


def test_external_torchrun_runs_in_process(recipe, fake_finetune, monkeypatch):
    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail("must not re-launch"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cli.under_torchrun()
    assert cli.main(["finetune", "-c", str(recipe), "--nproc-per-node", "2"]) == 0
    assert len(fake_finetune) == 1


def test_nproc_one_runs_in_process(recipe, fake_finetune, monkeypatch):
    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail("must not re-launch"))
    assert cli.main(["finetune", "-c", str(recipe), "--nproc-per-node=1"]) == 0
    assert len(fake_finetune) == 1


def test_bad_nproc(recipe):
    with pytest.raises(SystemExit) as e:
        cli.main(["finetune", "-c", str(recipe), "--nproc-per-node", "0"])
    assert e.value.code == 2


# -------------------------------------------------------------------------------- logging
def test_setup_logging_rank_format_and_warning_filter():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        with warnings.catch_warnings():
            _real_setup_logging(environ={"RANK": "3"})
            assert root.level == logging.WARNING  # non-zero ranks: warnings and errors
            assert "[rank3]" in root.handlers[-1].formatter._fmt
            _real_setup_logging(environ={"RANK": "0", "HYBRIDTRAIN_LOG_LEVEL": "debug"})
            assert root.level == logging.DEBUG
            n = len(warnings.filters)
            _real_setup_logging(environ={})
            assert len(warnings.filters) == n  # not filtered by default
            _real_setup_logging(environ={"HYBRIDTRAIN_FILTER_WARNINGS": "1"})
            assert warnings.filters[0][0] == "ignore"
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_logging_follows_stderr_after_a_redirect_ends():
    """``main`` run with stderr redirected to a stream that is closed afterwards (a notebook's
    capture, a test's): later records go to the stderr of their time, with no "Logging error"."""
    import contextlib
    import io

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(first):
            _real_setup_logging(environ={})
            logging.getLogger("hybridtrain.test").warning("during")
        first.close()
        with contextlib.redirect_stderr(second):
            logging.getLogger("hybridtrain.test").warning("after")
        assert "after" in second.getvalue() and "Logging error" not in second.getvalue()
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_a_commands_module_is_imported_without_collections_and_then_frozen(tmp_path, monkeypatch):
    """The import of a command's module (torch and the rest) runs with the collector off, and
    leaves what it made in the permanent generation, where later collections never walk it."""
    import gc

    (tmp_path / "heavy_command.py").write_text(
        "import gc\nCOLLECTING = gc.isenabled()\nTABLES = [[i] for i in range(1000)]\n"
        "def run(cfg):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    frozen = gc.get_freeze_count()
    try:
        run = cli._load_entry("heavy_command", "run", "heavy")
        module = sys.modules["heavy_command"]
        assert module.COLLECTING is False and gc.isenabled()
        assert gc.get_freeze_count() >= frozen + 1000
        assert cli._load_entry("heavy_command", "run", "heavy") is run  # imported once
    finally:
        sys.modules.pop("heavy_command", None)
