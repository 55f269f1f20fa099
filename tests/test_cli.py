"""The ``dynrag`` command line (:mod:`detectors.cli`) on the tiny registry (``registered`` in tests/conftest.py: every
kind registered, its LLM the tiny Llama's checkpoint): each command run in-process through ``main``, and the installed
console script in a subprocess. What a command prints is checked against the library's own answer on the same input;
bad input is one line on stderr and exit status 1 (2 for a malformed command line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from detectors import load_detector
from detectors.cli import main
from detectors.errors import InputError

DYNRAG = Path(sys.executable).with_name("dynrag")
QUESTIONS = ["The capital of France is", "The river of Paris is"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``dynrag *argv`` in-process: its exit status, stdout and stderr."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_console_script_is_installed(registered):
    done = subprocess.run([str(DYNRAG), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    for command in ("assess", "monitor", "promote", "relocate", "screenshot"):
        assert command in done.stdout
    done = subprocess.run(
        [str(DYNRAG), "promote", "dior-early", "9", "--tracking-uri", registered],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert one_line(done.stderr).startswith(
        "dynrag promote: NotRegisteredError: model 'dior-early' has no version 9 in sqlite:///"
    )
    done = subprocess.run([str(DYNRAG), "assess", b"\xff\xfe"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "argument 2 (b'\\xff\\xfe') is not valid UTF-8 text" in one_line(done.stderr)
    done = subprocess.run([str(DYNRAG), "promote", "dior-early"], capture_output=True, text=True, timeout=60)
    assert (
        done.returncode == 2
        and "the following arguments are required: version (see dynrag promote --help)" in one_line(done.stderr)
    )


def test_assess_prints_the_detectors_decisions(registered, capsys):
    status, out, err = run(capsys, "assess", *QUESTIONS, "--tracking-uri", registered, "--json")
    assert status == 0, err
    expected = load_detector("dior-early", tracking_uri=registered).predict_frame(pd.DataFrame({"question": QUESTIONS}))
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["question"] for r in rows] == QUESTIONS
    assert [r["retrieve"] for r in rows] == expected["retrieve"].tolist()
    assert [r["probability"] for r in rows] == expected["probability"].tolist()
    assert [r["keywords"] for r in rows] == [list(k) for k in expected["keywords"]]
    status, out, _ = run(capsys, "assess", QUESTIONS[0], "--tracking-uri", registered)
    first = expected.iloc[0]
    assert status == 0 and out.startswith(
        f"retrieve: {'yes' if first['retrieve'] else 'no '}  probability: {first['probability']:.3f}"
    )
    assert out.rstrip().endswith(f"question: {QUESTIONS[0]}")
    status, out, _ = run(
        capsys, "assess", QUESTIONS[0], "--model", "utility-facts", "--tracking-uri", registered, "--json"
    )
    assert status == 0 and set(json.loads(out)) == {"question", "retrieve", "probability", "keywords"}


def test_assess_and_monitor_refuse_the_other_kind(registered, capsys):
    status, out, err = run(capsys, "assess", QUESTIONS[0], "--model", "dior-realtime", "--tracking-uri", registered)
    assert status == 1 and out == ""
    assert (
        "dior-realtime@champion is a 'dior-realtime' detector; `assess` takes one of kind dior-early, utility "
        "(use `dynrag monitor`" in one_line(err)
    )
    status, _, err = run(capsys, "monitor", QUESTIONS[0], "--model", "dior-early", "--tracking-uri", registered)
    assert status == 1 and "(use `dynrag assess` for a detector that decides from the question)" in one_line(err)
    status, _, err = run(capsys, "monitor", "Paris is", "--tracking-uri", registered)
    assert status == 1 and "pass its title with --title TITLE" in one_line(err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["assess", "x", "--device", "banana"],
            "argument --device: 'banana' is not a device: use auto, cpu, cuda or cuda:N",
        ),
        (["assess", "x", "--device", "cuda:7"], "argument --device: 'cuda:7': this machine has"),
        (["monitor", "x", "--alias", ""], "argument --alias: '' is not an alias: use letters, digits, '_' or '-'"),
        (["promote", "dior-early", "1", "--alias", ""], "argument --alias: '' is not an alias"),
        (["promote", "dior-early", "1", "--alias", "v2"], "argument --alias: 'v2' is reserved by MLflow for versions"),
        (  # bytes that are not UTF-8, as Python passes them on (surrogates): refused before any store or model is read
            ["assess", os.fsdecode(b"\xff\xfe"), "--tracking-uri", "sqlite:////nowhere/mlflow.db"],
            "dynrag: error: argument 2 (b'\\xff\\xfe') is not valid UTF-8 text: pass it encoded in UTF-8",
        ),
    ],
)
def test_a_bad_argument_is_refused_where_it_is_parsed(argv, message, capsys):
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == "" and message in one_line(err)


def test_monitor_shows_where_the_realtime_detector_triggers(registered, tiny_llm, capsys):
    status, out, err = run(
        capsys,
        "monitor",
        "Paris is the capital of",
        "--title",
        "Paris",
        "--max-new-tokens",
        "8",
        "--tracking-uri",
        registered,
        "--json",
    )
    assert status == 0, err
    shown = json.loads(out)
    expected = load_detector("dior-realtime", tracking_uri=registered, llm=tiny_llm).generate(
        "Paris", "Paris is the capital of", 8
    )
    assert shown["tokens"] == expected.tokens and shown["text"] == "".join(expected.tokens)
    assert shown["scores"] == pytest.approx(expected.probabilities, abs=1e-6)
    assert shown["trigger"] == expected.trigger and shown["keywords"] == expected.keywords
    status, out, _ = run(
        capsys,
        "monitor",
        "Paris is the capital of",
        "--title",
        "Paris",
        "--max-new-tokens",
        "8",
        "--tracking-uri",
        registered,
    )
    lines = out.splitlines()
    if expected.trigger is None:
        assert lines[0] == expected.text and lines[1].startswith(
            f"no trigger in {len(expected.tokens)} generated tokens"
        )
    else:
        before = "".join(expected.tokens[: expected.trigger])
        assert lines[0].startswith(f"{before} <<retrieve>> ") and lines[1].startswith(
            f"trigger at token {expected.trigger} "
        )


def test_monitor_shows_where_ctrla_confidence_triggers(registered, tiny_llm, capsys):
    status, out, err = run(
        capsys,
        "monitor",
        QUESTIONS[0],
        "--model",
        "ctrla-confidence",
        "--max-new-tokens",
        "6",
        "--tracking-uri",
        registered,
        "--json",
    )
    assert status == 0, err
    shown = json.loads(out)
    segment = load_detector("ctrla-confidence", tracking_uri=registered, llm=tiny_llm).generate(
        QUESTIONS[0], max_new_tokens=6
    )
    assert shown["text"] == "".join(tiny_llm.tokenizer.decode([t]) for t in segment.token_ids)
    assert shown["scores"] == pytest.approx(segment.scores, abs=1e-6) and shown["query"] == segment.query
    fires = [i for i, (new, s) in enumerate(zip(segment.new_content, segment.scores)) if new and s < 0]
    assert (
        shown["trigger"] == segment.trigger_position == (fires[0] if fires else None)
        and (shown["trigger"] is not None) == segment.retrieve
    )


def test_the_store_comes_from_the_option_the_environment_or_the_params_file(registered, tmp_path, monkeypatch, capsys):
    """--tracking-uri, else --params, else $MLFLOW_TRACKING_URI, else params.yaml here (a relative sqlite path: relative
    to it)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    status, _, err = run(capsys, "promote", "dior-early", "1")
    assert (
        status == 1
        and "no MLflow store named and no" in one_line(err)
        and "pass --tracking-uri URI, set $MLFLOW_TRACKING_URI" in err
    )
    db = Path(registered[len("sqlite:///") :])
    project = tmp_path / "project"
    project.mkdir()
    relative = os.path.relpath(db, project)
    (project / "params.yaml").write_text(
        yaml.safe_dump({"mlflow": {"tracking_uri": f"sqlite:///{relative}", "artifact_root": "data/mlflow/artifacts"}})
    )
    status, out, err = run(capsys, "promote", "dior-early", "1", "--params", str(project / "params.yaml"))
    assert status == 0 and json.loads(out)["version"] == 1, err
    monkeypatch.chdir(project)  # params.yaml of the working directory
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # mlflow.set_tracking_uri sets it
    assert run(capsys, "promote", "dior-early", "1")[0] == 0
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'empty.db'}")  # the environment beats params.yaml
    status, _, err = run(capsys, "promote", "dior-early", "1")
    assert (
        status == 1
        and f"StoreNotFoundError: no MLflow store at {tmp_path / 'empty.db'}: check the tracking URI" in one_line(err)
    )
    assert not (tmp_path / "empty.db").exists()  # a reader creates no store


def test_a_plain_path_is_refused_as_a_tracking_uri_with_the_sqlite_form_to_use(tmp_path, capsys):
    for given, store in (
        (tmp_path / "nowhere", tmp_path / "nowhere/mlflow.db"),
        (tmp_path / "x.db", tmp_path / "x.db"),
    ):
        status, _, err = run(capsys, "assess", "x", "--tracking-uri", str(given))
        assert status == 1 and (
            f"TrackingURIError: tracking URI '{given}' is a plain path, which MLflow reads as its deprecated file "
            f"store: name a sqlite store as sqlite:///{store} "
        ) in one_line(err)
    with pytest.raises(InputError, match=r"'data/mlflow' is a plain path, .*: name a sqlite store as sqlite:///"):
        load_detector("dior-early", tracking_uri="data/mlflow")
    assert not (tmp_path / "nowhere").exists()


def test_relocate_refuses_a_store_that_does_not_move(capsys):
    status, _, err = run(capsys, "relocate", "--tracking-uri", "http://127.0.0.1:9")
    assert (
        status == 1
        and "http://127.0.0.1:9 is not a sqlite store: only a sqlite store moves with its project" in one_line(err)
    )


FAKE_CHROMIUM = """#!{python}
import sys, urllib.request
url = sys.argv[-1]
out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--screenshot="))
with urllib.request.urlopen(url, timeout=30) as page:
    open(out, "w").write(url + "\\n" + page.read().decode())
"""


def test_screenshot_opens_the_comparison_view_on_a_server_of_its_own(registered, tmp_path, capsys):
    """Chromium is not installed here: a stand-in saves the page the command points it at (the address, then the HTML
    the started ``mlflow server`` answers), so what is checked is the command, the server and the view's address."""
    status, _, err = run(
        capsys, "screenshot", "--tracking-uri", registered, "--chromium", str(tmp_path / "no-chromium")
    )
    assert status == 1 and "is not an executable: install Debian's package (apt-get install -y chromium)" in one_line(
        err
    )
    chromium = tmp_path / "chromium"
    chromium.write_text(FAKE_CHROMIUM.format(python=sys.executable))
    chromium.chmod(0o755)
    status, _, err = run(
        capsys, "screenshot", "--tracking-uri", registered, "--chromium", str(chromium), "--experiment", "nope"
    )
    assert (
        status == 1 and "no experiment 'nope' in sqlite:///" in one_line(err) and "run the evaluate stage first" in err
    )
    out = tmp_path / "shot.png"
    status, printed, err = run(
        capsys,
        "screenshot",
        "--tracking-uri",
        registered,
        "--chromium",
        str(chromium),
        "--experiment",
        "registry-tests",
        "--out",
        str(out),
    )
    assert status == 0, err
    assert printed.strip() == str(out)
    url, page = out.read_text().split("\n", 1)
    assert url.startswith("http://127.0.0.1:") and "/#/experiments/" in url and "viewStateShareKey=" in url
    assert "<html" in page.lower() and "mlflow" in page.lower()
