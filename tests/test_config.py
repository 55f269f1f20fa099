"""params.yaml validation (detectors.config) and LLM source resolution (detectors.llm.loading.resolve_source)."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest
import yaml

from detectors.config import ParamsError, StageParams, from_dict, load_all, load_section
from detectors.config.common import LLMParams
from detectors.config.early import BuildEarlyParams, QAParams, TrainEarlyParams
from detectors.config.rag import on_corpus, trigger_names

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED = REPO_ROOT / "params.yaml"


@pytest.fixture(scope="module")
def shipped() -> dict:
    return yaml.safe_load(SHIPPED.read_text())


def write_params(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def edited(shipped: dict, tmp_path: Path, dotted: str, value) -> Path:
    """A copy of the shipped params with ``dotted`` (a.b.c) set to ``value``, written to tmp_path."""
    data = copy.deepcopy(shipped)
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    return write_params(tmp_path, data)


def params_error(path: Path) -> str:
    with pytest.raises(ParamsError) as err:
        load_all(path)
    return str(err.value)


def test_shipped_params_validate():
    sections = load_all(SHIPPED)
    assert {
        "llm",
        "qa",
        "build_early",
        "train_early",
        "evaluate",
        "mlflow",
        "register",
        "articles",
        "build_realtime",
        "train_realtime",
    } <= set(sections)
    assert sections["register"].detectors["dior-realtime"].artifact == "data/models/realtime"
    qa = sections["qa"]
    assert isinstance(qa, QAParams)
    assert abs(sum(qa.splits.values()) - 1.0) < 1e-9
    assert isinstance(sections["build_early"], BuildEarlyParams)
    assert "{question}" in sections["build_early"].features.prompt.template
    assert isinstance(sections["train_early"], TrainEarlyParams)
    assert sections["mlflow"].tracking_uri.startswith("sqlite:///")


def test_params_rewritten_by_dvc_exp_run_set_still_validate(tmp_path):
    """``dvc exp run -S key=value`` (docs/pipeline.md) rewrites the whole file with DVC's YAML 1.2 writer, which leaves
    the yes/no words unquoted: they must still read as the words, not as booleans."""
    from dvc.utils.hydra import apply_overrides

    path = tmp_path / "params.yaml"
    shutil.copyfile(SHIPPED, path)
    apply_overrides(str(path), ["qa.limit=2000"])
    assert "- yes\n" in path.read_text() or "[yes]" in path.read_text()  # the word is unquoted now
    sections = load_all(path)
    assert sections["qa"].limit == 2000
    shipped = load_all(SHIPPED)["rag_eval"].settings["sit"]["yes_words"]
    assert sections["rag_eval"].settings["sit"]["yes_words"] == shipped == ["yes"]


def test_shipped_params_values_are_typed(shipped):
    sections = load_all(SHIPPED)
    feats = sections["build_early"].features
    assert feats.n_steps == shipped["build_early"]["features"]["n_steps"]
    assert feats.hidden_layers == shipped["build_early"]["features"]["hidden_layers"]
    assert isinstance(sections["train_early"].training.lr, float)
    assert sections["train_early"].ablation == shipped["train_early"]["ablation"]
    assert sections["train_early"].detectors == shipped["train_early"]["detectors"]


def test_a_missing_key_or_section_is_an_error_naming_it(shipped, tmp_path):
    """params.yaml is the single source of truth: stage sections have no defaults, at any depth."""
    data = copy.deepcopy(shipped)
    del data["build_early"]["features"]["prompt"]["system"]
    with pytest.raises(ParamsError, match=r"build_early\.features\.prompt\.system = None: required key is missing"):
        load_section("build_early", write_params(tmp_path, data))
    data = copy.deepcopy(shipped)
    del data["register"]
    with pytest.raises(ParamsError, match="register = None: required section is missing"):
        load_section("register", write_params(tmp_path, data))
    with pytest.raises(ParamsError, match="no params section named 'nope'"):
        load_section("nope", SHIPPED)


def test_artifact_schema_types_keep_their_defaults_outside_params():
    from detectors.config.schema import EarlyFeatureParams

    # an artifact written before a key existed
    feats = from_dict(EarlyFeatureParams, {"n_steps": 4}, "detector.features")
    assert feats.n_steps == 4 and feats.prompt.template == "{question}"
    with pytest.raises(ParamsError, match="build_early.features.prompt = None: required key is missing"):
        from_dict(EarlyFeatureParams, {"n_steps": 4}, "build_early.features", strict=True)


def test_stage_params_hand_out_only_declared_keys(shipped):
    from detectors.config import StageParams

    p = StageParams(shipped, ("build_early.features", "paths.qa"), "build_early")
    assert p["build_early.features.n_steps"] == shipped["build_early"]["features"]["n_steps"]
    assert p["paths.qa"] == shipped["paths"]["qa"]
    for undeclared in ("build_early", "build_early.stop", "paths.early", "qa"):
        with pytest.raises(
            ParamsError, match=f"build_early reads params key '{re.escape(undeclared)}' but does not declare it"
        ):
            p[undeclared]


def test_a_declared_key_that_params_does_not_have_is_refused(shipped):
    from detectors.config import StageParams

    with pytest.raises(
        ParamsError, match=r"paths\.qaa = None: build_early declares this params key but params.yaml has no such key"
    ):
        StageParams(shipped, ("paths.qaa",), "build_early")


def test_a_stage_reads_the_section_of_every_framework_its_params_name_and_no_other(shipped):
    """``rag_eval`` declares ``"${rag_eval.frameworks}"``: the sections that list names are its params (and its
    ``dvc.yaml`` params), so a framework's name is written in ``params.yaml`` alone."""
    from pipelines import rag_eval

    assert "retrorag" not in rag_eval.READS
    assert StageParams(shipped, rag_eval.READS, "rag_eval")["retrorag"].k == shipped["retrorag"]["k"]
    data = copy.deepcopy(shipped)
    data["rag_eval"]["frameworks"] = []
    p = StageParams(data, rag_eval.READS, "rag_eval")
    assert "retrorag" not in p.reads and "rag_eval" in p.reads
    with pytest.raises(ParamsError, match="rag_eval reads params key 'retrorag' but does not declare it"):
        p["retrorag"]
    data["rag_eval"]["frameworks"] = "retrorag"
    with pytest.raises(ParamsError, match=r"rag_eval\.frameworks = 'retrorag': a list of params section names"):
        StageParams(data, rag_eval.READS, "rag_eval")


def test_declared_sections_are_validated_before_any_work(shipped):
    from detectors.config import StageParams

    data = copy.deepcopy(shipped)
    data["train_early"]["training"]["lr"] = -1.0
    with pytest.raises(ParamsError, match=r"train_early\.training\.lr = -1\.0"):
        StageParams(data, ("train_early.training.threshold",), "evaluate")


def test_paths_is_an_open_section_of_named_paths(shipped, tmp_path):
    """A new path is data (no type lists the keys, so no stage's code changes); a blank path or a bad name is
    refused."""
    data = copy.deepcopy(shipped)
    data["paths"]["new_report"] = "data/metrics/new.json"
    assert StageParams(data, ("paths.new_report", "paths.qa"), "a stage")["paths.new_report"] == "data/metrics/new.json"
    assert "new_report" in load_all(write_params(tmp_path, data))["paths"]
    for key, value, why in (
        ("qa", " ", "must name a path"),
        ("Bad-Name", "x", "lower-case identifier"),
        ("qa", None, "must name a path"),
    ):
        bad = copy.deepcopy(shipped)
        bad["paths"][key] = value
        with pytest.raises(ParamsError, match=rf"paths\.{key} = .*{why}"):
            load_all(write_params(tmp_path, bad))


def test_missing_params_file_is_a_params_error(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_all(tmp_path / "absent.yaml")


def test_negative_n_steps_names_key_and_value(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "build_early.features.n_steps", -3))
    assert "build_early.features.n_steps" in msg
    assert "-3" in msg
    assert "positive" in msg


def test_unknown_key_in_a_section_names_key_and_value(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "train_early.training.learning_rate", 0.01))
    assert "train_early.training.learning_rate" in msg
    assert "0.01" in msg
    assert "unknown key" in msg
    assert "'lr'" in msg  # lists the known keys


def test_unknown_nested_key_names_its_full_path(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "build_early.features.prompt.sytem", "be brief"))
    assert "build_early.features.prompt.sytem" in msg
    assert "'be brief'" in msg


def test_splits_not_summing_to_one(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "qa.splits", {"train": 0.6, "val": 0.2, "test": 0.3}))
    assert "qa.splits" in msg
    assert "'test': 0.3" in msg
    assert "sum to 1.1" in msg


def test_split_key_missing(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "qa.splits", {"train": 0.8, "val": 0.2}))
    assert "qa.splits" in msg
    assert "{'train': 0.8, 'val': 0.2}" in msg
    assert "train, val and test" in msg


def test_split_ratio_out_of_range(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "qa.splits", {"train": 1.2, "val": -0.1, "test": -0.1}))
    assert "qa.splits.train" in msg and "1.2" in msg


def test_unknown_feature_group(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "train_early.detectors.dior-early", ["attribution", "logits"]))
    assert "train_early.detectors.dior-early" in msg
    assert "'logits'" in msg
    assert "unknown feature group" in msg


def test_shipped_dior_early_is_the_papers_rnn_over_ig_features():
    """DioR Eq. 2: the detector reads IG(Q) only (the attribution sequence and its entropy); the stronger set has its
    own name."""
    sections = load_all(SHIPPED)
    assert sections["train_early"].detectors["dior-early"] == ["attribution", "entropy"]
    assert set(sections["train_early"].detectors["dior-early-extended"]) == {
        "attribution",
        "entropy",
        "first_token",
        "hidden",
    }
    assert {"dior-early", "dior-early-extended"} <= set(sections["register"].detectors)


@pytest.mark.parametrize(
    "key, value, where, why",
    [
        ("train_early.detectors", {}, "train_early.detectors", "at least one detector"),
        ("train_early.detectors", {"gru/all": ["entropy"]}, "train_early.detectors", "letters, digits"),
        (
            "train_early.detectors",
            {"a": ["entropy", "hidden"], "b": ["hidden", "entropy"]},
            "train_early.detectors.b",
            "same feature groups as train_early.detectors.a",
        ),
        (
            "train_early.ablation",
            [["entropy", "attribution"]],
            "train_early.ablation[0]",
            "same feature groups as train_early.detectors.dior-early",
        ),
        ("register.detectors", {}, "register.detectors", "at least one trained detector"),
        (
            "register.detectors",
            {"models:/x": {"artifact": "a", "metrics": "m.json", "keys": ["question", "x"]}},
            "register.detectors",
            "letters, digits",
        ),
        (
            "register.detectors",
            {"x": {"artifact": "a", "metrics": "m.json", "keys": []}},
            "register.detectors.x.keys",
            "keys down to the detector's test metrics",
        ),
    ],
)
def test_early_detector_names_and_feature_sets_are_checked(shipped, tmp_path, key, value, where, why):
    msg = params_error(edited(shipped, tmp_path, key, value))
    assert f"params: {where} = " in msg and why in msg


def test_unknown_feature_group_in_an_ablation_names_its_index(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "train_early.ablation", [["attribution"], ["hiddden"]]))
    assert "train_early.ablation[1]" in msg
    assert "'hiddden'" in msg


def test_feature_group_listed_twice(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "train_early.detectors.dior-early", ["entropy", "entropy"]))
    assert "train_early.detectors.dior-early" in msg and "twice" in msg


def test_string_for_an_int(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "build_early.shard_size", "32"))
    assert "build_early.shard_size" in msg
    assert "'32'" in msg
    assert "expected an integer" in msg


def test_float_for_an_int(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "train_early.training.batch_size", 32.5))
    assert "train_early.training.batch_size" in msg and "32.5" in msg


@pytest.mark.parametrize(
    "dotted",
    ["build_early.features.n_steps", "train_early.training.max_epochs", "qa.limit", "evaluate.ece_bins"],
)
def test_bools_are_not_accepted_as_ints(shipped, tmp_path, dotted):
    msg = params_error(edited(shipped, tmp_path, dotted, True))
    assert dotted in msg
    assert "True" in msg


def test_bool_is_not_accepted_as_a_float(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "train_early.training.dropout", False))
    assert "train_early.training.dropout" in msg and "False" in msg


def test_int_is_accepted_for_a_float(shipped, tmp_path):
    path = edited(shipped, tmp_path, "train_early.training.lr", 1)
    lr = load_section("train_early", path).training.lr
    assert lr == 1.0 and isinstance(lr, float)


def test_literal_value_outside_its_choices(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "train_early.training.threshold", "median"))
    assert "train_early.training.threshold" in msg
    assert "'median'" in msg
    assert "youden" in msg
    msg = params_error(edited(shipped, tmp_path, "rag_eval.engine", "tgi"))  # what generates the RAG loop's segments
    assert "rag_eval.engine" in msg and "'tgi'" in msg and "'vllm'" in msg


@pytest.mark.parametrize("template", ["Q: {query}\nA:", "{question} and again {question}"])
def test_prompt_template_must_hold_question_once(shipped, tmp_path, template):
    msg = params_error(edited(shipped, tmp_path, "build_early.features.prompt.template", template))
    assert "build_early.features.prompt.template" in msg
    assert repr(template) in msg
    assert "{question}" in msg


@pytest.mark.parametrize("uri", ["./mlruns", "mlruns", "file:///x", "file:./mlruns"])
def test_file_store_tracking_uri_is_refused(shipped, tmp_path, uri):
    msg = params_error(edited(shipped, tmp_path, "mlflow.tracking_uri", uri))
    assert "mlflow.tracking_uri" in msg
    assert repr(uri) in msg


@pytest.mark.parametrize(
    "uri, root",
    [
        ("sqlite:///data/mlflow/mlflow.db", "data/mlflow/artifacts"),
        ("postgresql://u@db/mlflow", "s3://bucket/mlflow"),
        ("http://127.0.0.1:5000", None),
        ("https://mlflow.example.org", "s3://bucket/mlflow"),
    ],
)
def test_database_or_server_tracking_uri_is_accepted(shipped, tmp_path, uri, root):
    data = copy.deepcopy(shipped)
    data["mlflow"] = {"tracking_uri": uri, "artifact_root": root}
    assert load_section("mlflow", write_params(tmp_path, data)).tracking_uri == uri


@pytest.mark.parametrize(
    "uri, root, why",
    [
        ("sqlite:///data/mlflow/mlflow.db", None, "only a tracking server"),
        ("http://127.0.0.1:5000", "data/mlflow/artifacts", "each client's"),
    ],
)
def test_an_artifact_root_that_clients_would_not_share_is_refused(shipped, tmp_path, uri, root, why):
    data = copy.deepcopy(shipped)
    data["mlflow"] = {"tracking_uri": uri, "artifact_root": root}
    msg = params_error(write_params(tmp_path, data))
    assert "mlflow.artifact_root" in msg and why in msg


def test_unknown_top_level_section(shipped, tmp_path):
    data = copy.deepcopy(shipped)
    data["train_late"] = {"rnn_hidden": 8}
    msg = params_error(write_params(tmp_path, data))
    assert "train_late" in msg
    assert "unknown params section" in msg
    assert "'train_early'" in msg  # lists the known sections


def test_section_that_is_not_a_mapping(shipped, tmp_path):
    msg = params_error(edited(shipped, tmp_path, "evaluate", ["ece_bins", 10]))
    assert re.search(r"params: evaluate = \['ece_bins', 10\]", msg)


def test_params_file_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("- llm\n- qa\n")
    with pytest.raises(ParamsError, match="mapping"):
        load_all(path)


def test_from_dict_checks_llm_device(shipped):
    assert from_dict(LLMParams, {**shipped["llm"], "device": "cuda:1"}, "llm").device == "cuda:1"
    with pytest.raises(ParamsError, match=r"llm\.device = 'gpu'"):
        from_dict(LLMParams, {**shipped["llm"], "device": "gpu"}, "llm")


# --- llm.source resolution (no model is loaded) ---------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from detectors.llm import loading as module

    return module


def test_unknown_source_names_the_value(llm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(llm.LLMSourceError, match="no_such_model_xyz"):
        llm.resolve_source("no_such_model_xyz")


def test_checkpoint_directory(llm, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    src = llm.resolve_source(str(ckpt))
    assert src.kind == "checkpoint"
    assert Path(src.location) == ckpt


def test_prepared_directory(llm, tmp_path):
    (tmp_path / llm.MANIFEST).write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    assert llm.resolve_source(str(tmp_path)).kind == "prepared"


def test_directory_with_one_gguf(llm, tmp_path):
    (tmp_path / "model-q8_0.gguf").write_bytes(b"GGUF")
    (tmp_path / "README.md").write_text("a model")
    src = llm.resolve_source(str(tmp_path))
    assert src.kind == "gguf"
    assert Path(src.location) == tmp_path
    assert src.gguf_file == "model-q8_0.gguf"


def test_gguf_file_path(llm, tmp_path):
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF")
    src = llm.resolve_source(str(f))
    assert (src.kind, Path(src.location), src.gguf_file) == ("gguf", tmp_path, "tiny.gguf")


def test_file_that_is_not_gguf(llm, tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0")
    with pytest.raises(llm.LLMSourceError, match="not a .gguf"):
        llm.resolve_source(str(f))


def test_directory_with_two_ggufs_needs_gguf_file(llm, tmp_path):
    for name in ("a-q4.gguf", "a-q8.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(llm.LLMSourceError, match="2 GGUF files") as err:
        llm.resolve_source(str(tmp_path))
    assert "gguf_file" in str(err.value)
    src = llm.resolve_source(str(tmp_path), gguf_file="a-q8.gguf")
    assert (src.kind, src.gguf_file) == ("gguf", "a-q8.gguf")
    with pytest.raises(llm.LLMSourceError, match="'a-q2.gguf'"):
        llm.resolve_source(str(tmp_path), gguf_file="a-q2.gguf")


def test_empty_directory_is_refused(llm, tmp_path):
    with pytest.raises(llm.LLMSourceError, match="0 GGUF files"):
        llm.resolve_source(str(tmp_path))


def test_hub_id(llm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "org/name" is not a path here
    src = llm.resolve_source("some-org/some_model.v2")
    assert (src.kind, src.location, src.gguf_file) == ("hub", "some-org/some_model.v2", None)


def test_existing_relative_path_wins_over_hub_id(llm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "config.json").write_text("{}")
    assert llm.resolve_source("org/name").kind == "checkpoint"


@pytest.mark.parametrize("dotted", ["train_early.training.lr", "train_early.training.weight_decay"])
def test_nan_is_not_an_acceptable_number(shipped, tmp_path, dotted):
    msg = params_error(edited(shipped, tmp_path, dotted, float("nan")))
    assert dotted in msg and "nan" in msg


def test_empty_stop_string_is_refused(shipped):
    with pytest.raises(ParamsError, match=r"build_early\.stop\[1\] = ''"):
        from_dict(BuildEarlyParams, {**shipped["build_early"], "stop": ["\n", ""]}, "build_early")
    assert from_dict(BuildEarlyParams, {**shipped["build_early"], "stop": []}, "build_early").stop == []


def test_a_configured_trigger_names_the_corpus_it_runs_on():
    assert on_corpus("utility-{corpus}@champion", "wiki") == "utility-wiki@champion"
    assert on_corpus("flare", "wiki") == "flare"
    assert trigger_names("utility-{corpus}@champion", ["wiki", "facts"]) == ["utility-wiki", "utility-facts"]
    assert trigger_names("dior-early@champion", ["wiki", "facts"]) == ["dior-early"]
