"""A registered detector served over HTTP the MLflow way: ``mlflow models serve -m models:/dior-early@champion
--env-manager local`` (a real server process on a free loopback port, on the tiny registry: ``registered`` in
tests/conftest.py), its predictions equal to ``load_detector(...).predict_frame`` on the same input, and bad input
answered with HTTP 400 and a message naming the column or value. About 30 s, most of it the server's start."""

from __future__ import annotations

import os

import pandas as pd
import pytest
from conftest import post

from detectors import load_detector
from detectors.mlflow_ui import MLFLOW, free_port, running

QUESTIONS = ["The capital of France is", "The river of Paris is", "The language of Germany is"]


def test_a_registered_detector_is_served_over_http(registered, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        str(MLFLOW),
        "models",
        "serve",
        "-m",
        "models:/dior-early@champion",
        "--env-manager",
        "local",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # MLflow runs `exec uvicorn ...` through a shell: the environment's bin directory must be on PATH (an activated
    # venv)
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": registered,
        "MLFLOW_REGISTRY_URI": registered,  # not the one the last store.configure of this process left in os.environ
        "PATH": f"{MLFLOW.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    with running(cmd, f"{base}/ping", tmp_path / "serve.log", cwd=tmp_path, env=env, timeout=240):
        status, served = post(f"{base}/invocations", {"dataframe_records": [{"question": q} for q in QUESTIONS]})
        assert status == 200, served
        status, none = post(
            f"{base}/invocations", {"dataframe_records": [{"question": QUESTIONS[0]}, {"question": None}]}
        )
        status_missing, missing = post(f"{base}/invocations", {"dataframe_records": [{"query": QUESTIONS[0]}]})
    assert (
        status == 400
        and "detector 'dior-early': row 1 of column 'question' is missing (None/NaN): give a non-blank string"
        in none["message"]
    )
    assert status_missing == 400 and "Model is missing inputs ['question']" in missing["message"]

    expected = load_detector("dior-early", tracking_uri=registered).predict_frame(pd.DataFrame({"question": QUESTIONS}))
    rows = served["predictions"]
    assert [sorted(r) for r in rows] == [sorted(expected.columns)] * len(QUESTIONS)
    assert [r["retrieve"] for r in rows] == expected["retrieve"].tolist()
    assert [r["keywords"] for r in rows] == [list(k) for k in expected["keywords"]]
    assert [r["probability"] for r in rows] == pytest.approx(expected["probability"].tolist(), abs=1e-7)
