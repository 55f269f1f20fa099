"""How a stage stops: bad params or input as one line on stderr (traceback on request), other errors with theirs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from detectors.cli import main as dynrag
from detectors.errors import TRACEBACK_ENV, InputError, SourceError, one_line, traceback_wanted
from pipelines._stage import run


def run_prepare(tmp_path, **env) -> subprocess.CompletedProcess:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["qa"]["limit"] = -5
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(params))
    environ = {k: v for k, v in os.environ.items() if k != TRACEBACK_ENV} | {"PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "pipelines.prepare", "--params", "bad.yaml"]
    return subprocess.run(cmd, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)


def test_a_stage_stops_on_bad_params_with_one_line_naming_the_key_and_value(tmp_path):
    done = run_prepare(tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"ParamsError: params: qa.limit = -5: must be positive (set {TRACEBACK_ENV}=1 for the traceback)"
    ]
    assert not (tmp_path / "data").exists()  # it stopped before any work


def test_the_traceback_of_bad_params_is_shown_on_request(tmp_path):
    done = run_prepare(tmp_path, **{TRACEBACK_ENV: "1"})
    assert done.returncode == 1
    assert (
        "Traceback (most recent call last)" in done.stderr
        and "ParamsError: params: qa.limit = -5: must be positive" in done.stderr
    )


def test_a_multi_line_input_error_is_one_line_and_other_errors_keep_their_traceback(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)

    def bad_source():
        raise SourceError("could not download x:\n  ERROR: no such version\n")

    with pytest.raises(SystemExit) as stopped:
        run(bad_source)
    assert stopped.value.code == 1
    assert (
        capsys.readouterr().err
        == f"SourceError: could not download x: ERROR: no such version (set {TRACEBACK_ENV}=1 for the traceback)\n"
    )

    def bug():
        raise KeyError("not an input error")

    with pytest.raises(KeyError, match="not an input error"):
        run(bug)


def test_the_stages_and_the_command_line_report_an_input_error_alike(capsys, monkeypatch):
    """One report of an input error (detectors.errors): the same line from a stage and from ``dynrag`` (which names the
    command first), and one switch for the traceback."""
    err = InputError("no such file:\n  x.yaml\n")
    assert one_line(err) == f"InputError: no such file: x.yaml (set {TRACEBACK_ENV}=1 for the traceback)"
    for value, wanted in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(TRACEBACK_ENV, value)
        assert traceback_wanted() is wanted
    monkeypatch.delenv(TRACEBACK_ENV)
    assert not traceback_wanted()

    def bad_input():
        raise err

    with pytest.raises(SystemExit):
        run(bad_input)
    assert capsys.readouterr().err == one_line(err) + "\n"
    missing = "no-such-params.yaml"
    assert dynrag(["promote", "x", "1", "--params", missing]) == 1
    stderr = capsys.readouterr().err
    assert stderr.startswith("dynrag promote: InputError: no MLflow store named and no ") and stderr.endswith(
        f" (set {TRACEBACK_ENV}=1 for the traceback)\n"
    )
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(InputError, match="no MLflow store named"):
        dynrag(["promote", "x", "1", "--params", missing])
    with pytest.raises(InputError, match="no such file"):
        run(bad_input)
