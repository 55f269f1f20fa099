"""A new trained detector kind is a handful of files: its detector module, its config module, its stages and
``params.yaml``. Nothing lists the kind: its class declares its ``KIND`` and the trigger the RAG loop builds around it.

The test writes such a kind, a logistic probe on the question, into a copy of the code: the three modules below and
its ``params.yaml`` entries (it trains on the early set, so it needs no build stage of its own; a kind with a set of
its own adds one). In that copy, on the tiny pipeline's project, the kind is a registered kind and a trigger kind,
``dvc.yaml`` gains its stage after the early set and before the registry, its train stage trains it, the register
stage registers it, and ``<name>@champion`` builds its trigger in the RAG loop, which scores questions with it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, copy_project

# ---- the kind's files ---------------------------------------------------------------------------------------------

DETECTOR = '''
"""The question probe: a logistic regression on the question's first-token scalars and last prompt state."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd
import torch

from detectors.config.probe import ProbeParams
from detectors.config.schema import EarlyFeatureParams
from detectors.dior.early import features_to_row, question_features
from detectors.dior.early_detector import per_question
from detectors.evaluation.choice import scored_units
from detectors.evaluation.metrics import auroc, choose_threshold
from detectors.interfaces import Detector, Registration
from detectors.llm.fingerprint import Fingerprint
from detectors.registry.artifact import DeclaredArtifact, FrameInputs
from detectors.sources.ids import ok_records

GROUPS = ["first_token", "hidden"]


class Probe(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.config = {"dim": dim}
        self.linear = torch.nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).squeeze(-1)


@dataclasses.dataclass
class QuestionProbe(DeclaredArtifact, Detector):
    KIND = "question-probe"
    DECIDES = "question"
    TRIGGER = "early"
    INPUTS = FrameInputs({"question": "string"})

    net: Probe
    mean: np.ndarray
    std: np.ndarray
    threshold: float
    features: EarlyFeatureParams
    fingerprint: Fingerprint
    llm_ref: dict
    info: dict
    groups: list = dataclasses.field(default_factory=lambda: list(GROUPS))
    llm: Any = None

    def registration(self) -> Registration:
        return Registration(",".join(self.groups), {"detector": self.KIND})

    def predict_proba(self, rows) -> np.ndarray:
        rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else rows
        x = (np.stack([per_question(r, self.groups) for r in rows]) - self.mean) / self.std
        with torch.no_grad():
            return torch.sigmoid(self.net(torch.from_numpy(x).float())).double().numpy()

    def predict_frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        llm = self.require_llm()
        rows = [features_to_row(question_features(llm, str(q), self.features)) for q in frame["question"]]
        p = self.predict_proba(rows)
        return pd.DataFrame({"probability": p, "retrieve": p >= self.threshold})


def train_probe(frame, params: ProbeParams, features, fingerprint, llm_ref) -> QuestionProbe:
    train, val = (ok_records(frame, split).to_dict("records") for split in ("train", "val"))
    x = np.stack([per_question(r, GROUPS) for r in train])
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    torch.manual_seed(params.seed)
    net = Probe(x.shape[1])
    inputs, labels = torch.from_numpy((x - mean) / std).float(), torch.tensor([float(r["label"]) for r in train])
    optimizer = torch.optim.Adam(net.parameters(), lr=params.lr)
    for _ in range(params.steps):
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(inputs), labels).backward()
        optimizer.step()
    detector = QuestionProbe(net.eval(), mean, std, 0.5, features, fingerprint, llm_ref, {})
    val_labels, scores = [r["label"] for r in val], detector.predict_proba(val)
    detector.threshold = choose_threshold(val_labels, scores, "prevalence")
    detector.info = {
        "seed": params.seed,
        "best_val_auroc": auroc(val_labels, scores),
        "validation": scored_units([r["id"] for r in val], val_labels, scores),
    }
    return detector
'''

CONFIG = '''
"""The params section of the question probe: ``train_probe``."""

from __future__ import annotations

import dataclasses

from detectors.config.core import fail, positive

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {"train_probe": "ProbeParams"}


@dataclasses.dataclass(frozen=True)
class ProbeParams:
    steps: int  # full-batch Adam steps
    lr: float
    seed: int

    def check(self, where: str) -> None:
        positive(f"{where}.steps", self.steps)
        if not self.lr > 0:
            fail(f"{where}.lr", self.lr, "a positive learning rate, e.g. 0.05")
'''

STAGE = '''
"""Stage train_probe: the question probe on the early set's train split, its threshold chosen on validation, its test
AUROC in ``paths.train_probe_metrics``."""

from __future__ import annotations

import pandas as pd

from detectors.dior.probe_detector import train_probe
from detectors.evaluation.metrics import auroc
from detectors.io import write_json
from detectors.llm.loading import prepared_reference
from detectors.sources.ids import ok_records
from pipelines._stage import run, stage_params

READS = (
    "build_early.features",
    "train_probe",
    "paths.llm",
    "paths.early",
    "paths.probe_model",
    "paths.train_probe_metrics",
)
DEPS = ("${paths.early}", "${paths.llm}/llm.json")
OUTS = ("${paths.probe_model}", ("${paths.train_probe_metrics}", {"cache": False}))


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "train_probe")
    fingerprint, llm_ref = prepared_reference(params["paths.llm"])
    frame = pd.read_parquet(params["paths.early"])
    detector = train_probe(frame, params["train_probe"], params["build_early.features"], fingerprint, llm_ref)
    detector.save(params["paths.probe_model"])
    test = ok_records(frame, "test")
    metrics = {"probe": {"auroc": auroc(test["label"], detector.predict_proba(test))}}
    write_json(params["paths.train_probe_metrics"], metrics)


if __name__ == "__main__":
    run(main)
'''

FILES = {
    "detectors/dior/probe_detector.py": DETECTOR,
    "detectors/config/probe.py": CONFIG,
    "pipelines/train_probe.py": STAGE,
}


def add_to_params(path: Path) -> None:
    """The kind's entries of ``params.yaml``: its section, its paths and its ``register.detectors`` entry."""
    params = yaml.safe_load(path.read_text())
    params["train_probe"] = {"steps": 200, "lr": 0.05, "seed": 0}
    params["paths"].update(probe_model="data/models/probe", train_probe_metrics="data/metrics/train_probe.json")
    params["register"]["detectors"]["question-probe"] = {
        "artifact": "data/models/probe",
        "metrics": "data/metrics/train_probe.json",
        "keys": ["probe"],
    }
    path.write_text(yaml.safe_dump(params, sort_keys=False))


# run in the project, with the copy of the code first on the path
IN_THE_COPY = """
import json, sys
import pandas as pd
from detectors.extensions import DETECTOR_KINDS
from detectors.inference import load_detector
from detectors.rag.families import make_trigger
from detectors.registry.kinds import KINDS
from pipelines import _provenance, register, train_probe

train_probe.main(["--params", "params.yaml"])
register.main(["--params", "params.yaml", "--item", "question-probe"])
uri = "sqlite:///data/mlflow/mlflow.db"
detector = load_detector("question-probe", tracking_uri=uri)
trigger = make_trigger("question-probe@champion", detector.llm, tracking_uri=uri)
questions = pd.read_parquet("data/prepared/qa.parquet")["question"].head(3).tolist()
rows = [m.value for m in trigger.calculators[0].questions(questions)]
print(json.dumps({
    "kinds": dict(KINDS),
    "trigger_kinds": list(DETECTOR_KINDS),
    "stages": list(_provenance.ordered_stages()),
    "register_deps": _provenance.stage_code_deps("pipelines.register"),
    "train_deps": _provenance.stage_code_deps("pipelines.train_probe"),
    "dvc_yaml": _provenance.dvc_yaml(),
    "registered": json.load(open("data/registry/question-probe.json")),
    "trigger": [type(trigger.detector).__name__, trigger.source, trigger.threshold, detector.threshold],
    "scores": [trigger.scorer.score(pd.DataFrame(rows)).tolist(), detector.predict_frame(
        pd.DataFrame({"question": questions}))["probability"].tolist()],
}))
"""


def test_a_new_trained_kind_is_its_own_files_and_runs_from_training_to_the_rag_loop(pipeline, tmp_path):
    code = tmp_path / "code"
    for package in ("detectors", "pipelines"):
        shutil.copytree(ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "params.yaml", code / "params.yaml")
    for name, text in FILES.items():
        (code / name).write_text(textwrap.dedent(text).lstrip())
    add_to_params(code / "params.yaml")
    project = copy_project(pipeline, tmp_path / "project")
    add_to_params(project / "params.yaml")

    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run([sys.executable, "-c", IN_THE_COPY], cwd=project, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

    assert out["kinds"]["question-probe"] == "detectors.dior.probe_detector:QuestionProbe"
    assert "question-probe" in out["trigger_kinds"]
    stages = out["stages"]
    assert stages.index("build_early") < stages.index("train_probe") < stages.index("register")
    assert "detectors/dior/probe_detector.py" in out["register_deps"]  # the registry loads every declared kind
    assert {"pipelines/train_probe.py", "detectors/config/probe.py"} <= set(out["train_deps"])
    assert "  train_probe:\n    cmd: python -m pipelines.train_probe\n" in out["dvc_yaml"]
    assert (out["registered"]["version"], out["registered"]["decision"]) == (1, "champion")
    assert (
        out["registered"]["test_auroc"]
        == json.loads((project / "data/metrics/train_probe.json").read_text())["probe"]["auroc"]
    )
    name, source, threshold, own = out["trigger"]
    assert (name, source) == ("QuestionProbe", "detectors.rag.families.dior")  # the early trigger, around the probe
    assert threshold == own  # its validation threshold
    in_the_loop, served = out["scores"]
    assert len(in_the_loop) == 3
    assert in_the_loop == pytest.approx(served, abs=1e-5)  # the loop's measurement scores as the detector serves
    assert 0 < min(in_the_loop) and max(in_the_loop) < 1
