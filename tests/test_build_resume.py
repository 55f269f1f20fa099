"""Resuming a build stage is only ever resuming the same computation: a change of any param that shapes
a record, of the LLM's dtype or of the code clears the shards; records that failed are computed again
on the next run; too many failures stop the stage, keeping what is finished."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, edit_params, write_params
from safetensors.numpy import load_file

from detectors.config import ParamsError
from detectors.config.sections import declared_sections
from detectors.dior import realtime_set
from detectors.shards import FailedRecordsError
from pipelines import build_early, build_realtime, build_utility, index_corpus, prepare, prepare_articles
from pipelines._provenance import PACKAGES, code_digest, stage_closure, stage_code_deps


@pytest.fixture()
def project(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, tiny_checkpoint)
    edit_params(tmp_path, "qa", limit=24)  # three shards of 8 questions
    prepare.main(["--params", "params.yaml"])
    return tmp_path


def early(project: Path) -> pd.DataFrame:
    build_early.main(["--params", "params.yaml"])
    return pd.read_parquet(project / "data/early/early.parquet")


def inject_errors(monkeypatch, module, name: str, failing: set[str], id_of) -> list[str]:
    """Make ``module.name`` raise a transient error for the records whose id is in ``failing`` (shrunk
    by the caller to simulate the error going away); returns what ``id_of`` gives for each call (an id,
    or the list of ids of a batch, which fails when any of them does)."""
    real, calls = getattr(module, name), []

    def flaky(*args, **kwargs):
        calls.append(id_of(args))
        if (set(calls[-1]) if isinstance(calls[-1], list) else {calls[-1]}) & failing:
            raise OSError(f"transient failure of {calls[-1]}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)
    return calls


def test_changing_the_stop_strings_or_the_dtype_recomputes_every_record(project):
    first = early(project)
    assert first["answer"].str.contains(r"\.").any() and set(first["feature_dtype"]) == {"float32"}
    edit_params(project, "build_early", stop=["."])  # changes the answers, hence the labels
    stopped = early(project)
    assert not stopped["answer"].str.contains(r"\.").any()
    edit_params(project, "llm", dtype="bfloat16")  # another dtype computes other features
    assert set(early(project)["feature_dtype"]) == {"bfloat16"}


def test_the_code_digest_covers_the_stage_closure_and_nothing_else(tmp_path):
    for name, text in {
        "pipelines/__init__.py": "",
        "pipelines/stage.py": "from detectors.used import f\n",
        "detectors/__init__.py": "",
        "detectors/used.py": "def f():\n    return 1\n",
        "detectors/unused.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert {p.as_posix() for p in stage_closure("pipelines.stage", tmp_path)} == {
        "pipelines/__init__.py",
        "pipelines/stage.py",
        "detectors/__init__.py",
        "detectors/used.py",
    }
    before = code_digest("pipelines.stage", tmp_path)
    (tmp_path / "detectors/unused.py").write_text("x = 2\n")
    assert code_digest("pipelines.stage", tmp_path) == before
    (tmp_path / "detectors/used.py").write_text("def f():\n    return 2\n")  # a fix to the labelling rule, say
    assert code_digest("pipelines.stage", tmp_path) != before


def test_a_rag_eval_key_leaves_build_earlys_shards(project, monkeypatch):
    first = early(project)
    edit_params(project, "rag_eval", batch_size=3)  # a key build_early does not read

    def recompute(*args, **kwargs):
        raise AssertionError("build_early recomputed a record after a rag_eval key changed")

    monkeypatch.setattr(build_early, "early_records", recompute)
    pd.testing.assert_frame_equal(early(project), first)


def test_another_sections_type_leaves_build_earlys_code_key_and_deps(tmp_path):
    """The section types are loaded by name from a registry kept as data (the ``SECTION_TYPES`` literals of
    ``detectors/config/``, read without importing them):
    build_early's closure (its dvc.yaml code deps and the code key of its shards) holds the modules of the sections it
    reads, not rag_eval's, and a new section changes neither."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    early_digest, rag_digest = (
        code_digest("pipelines.build_early", tmp_path),
        code_digest("pipelines.rag_eval", tmp_path),
    )
    assert "detectors/config/rag.py" not in stage_code_deps("pipelines.build_early", tmp_path)
    rag = tmp_path / "detectors/config/rag.py"
    rag.write_text(rag.read_text().replace("class RagEvalParams:\n", "class RagEvalParams:\n    new_key: int\n", 1))
    assert code_digest("pipelines.build_early", tmp_path) == early_digest
    assert code_digest("pipelines.rag_eval", tmp_path) != rag_digest
    new = tmp_path / "detectors/config/new_stage.py"  # a new section: its type's module, declaring it beside the type
    new.write_text('SECTION_TYPES = {"new_stage": "NewStageParams"}\n\n\nclass NewStageParams:\n    pass\n')
    assert declared_sections(new.parent)["new_stage"] == "detectors.config.new_stage:NewStageParams"
    (tmp_path / "detectors/config/again.py").write_text('SECTION_TYPES = {"new_stage": "Other"}\n')
    with pytest.raises(ParamsError, match=r"'new_stage' is declared twice \(detectors\.config\.again:Other and "):
        declared_sections(new.parent)
    (tmp_path / "detectors/config/again.py").unlink()
    assert code_digest("pipelines.build_early", tmp_path) == early_digest
    assert stage_code_deps("pipelines.build_early", tmp_path) == stage_code_deps("pipelines.build_early")
    sections = tmp_path / "detectors/config/early.py"  # the section build_early reads does count
    sections.write_text(sections.read_text() + "\n# a new check\n")
    assert code_digest("pipelines.build_early", tmp_path) != early_digest


def test_failed_early_records_are_retried_and_too_many_stop_the_stage(project, monkeypatch):
    clean = early(project)
    (project / "data/early/shards/manifest.json").unlink()  # start over (as after a code change)
    ids, qs = clean["id"].tolist(), clean["question"].tolist()
    failing = {ids[5]}  # 1 of 24 records hits a transient error: within max_failed_share = 0.05
    batches = inject_errors(
        monkeypatch, build_early, "early_records", failing, lambda args: [ids[qs.index(q)] for q in args[1]]
    )
    flaky = early(project)
    assert set(flaky.loc[flaky["status"].str.startswith("error: OSError"), "id"]) == failing
    assert [ids[5]] in batches and [ids[4]] in batches  # the failing batch was retried one question at a time
    failing.clear()  # the error went away: the next run computes exactly the failed record
    batches.clear()
    retried = early(project)
    assert batches == [[ids[5]]]
    pd.testing.assert_frame_equal(
        retried.drop(columns=["attribution", "hidden"]),
        clean.drop(columns=["attribution", "hidden"]),
        check_like=True,
        check_dtype=False,  # labels of a shard that held an error row are floats
    )
    (project / "data/early/shards/manifest.json").unlink()
    failing.update(ids[10:])  # a sticky error from the 11th record on: the stage stops after the second shard
    batches.clear()
    with pytest.raises(FailedRecordsError, match=r"6 of 24 records failed.*build_early.max_failed_share = 0.05"):
        early(project)
    calls = [i for batch in batches if len(batch) == 1 for i in batch]
    assert len(calls) < len(ids)  # stopped early, with the finished shard kept for the next run
    assert pd.read_parquet(project / "data/early/shards/shard-00000.parquet")["status"].eq("ok").all()


def test_a_truncated_shard_and_sidecar_are_named_and_computed_again_alone(project, monkeypatch, caplog):
    """A shard that no longer reads (truncated by a disk, a copy or a sync) and another's truncated sidecar: the next
    run logs both by name and computes those two shards and nothing else, to the same outputs."""
    first = early(project)
    hidden = load_file(project / "data/early/answer_hidden.safetensors")["hidden"]
    shards = project / "data/early/shards"
    for path in (shards / "shard-00001.parquet", shards / f"shard-00002{build_early.HIDDEN}"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    ids, qs = first["id"].tolist(), first["question"].tolist()
    batches = inject_errors(
        monkeypatch, build_early, "early_records", set(), lambda args: [ids[qs.index(q)] for q in args[1]]
    )
    caplog.set_level(logging.WARNING, "detectors.shards")
    again = early(project)
    assert sorted(i for batch in batches for i in batch) == sorted(ids[8:24])  # shards 1 and 2 (8 questions each)
    named = [r.getMessage() for r in caplog.records if "computing it again" in r.getMessage()]
    assert len(named) == 2 and "shard-00001.parquet" in named[0] and f"shard-00002{build_early.HIDDEN}" in named[1]
    pd.testing.assert_frame_equal(again, first)
    assert np.array_equal(load_file(project / "data/early/answer_hidden.safetensors")["hidden"], hidden)


def test_failed_realtime_records_are_retried_with_their_hidden_states(project, monkeypatch):
    prepare_articles.main(["--params", "params.yaml"])
    edit_params(project, "build_realtime", max_failed_share=0.5)

    def run() -> tuple[pd.DataFrame, dict]:
        build_realtime.main(["--params", "params.yaml"])
        return pd.read_parquet(project / "data/realtime/realtime.parquet"), load_file(
            project / "data/realtime/hidden.safetensors"
        )

    clean, clean_hidden = run()
    ok_ids = clean.loc[clean["status"] == "ok", "id"].tolist()
    (project / "data/realtime/shards/manifest.json").unlink()
    failing = {ok_ids[0], ok_ids[-1]}
    inject_errors(monkeypatch, realtime_set, "prepare_article", failing, lambda args: args[2])
    flaky, _ = run()
    assert set(flaky.loc[flaky["status"].str.startswith("error: "), "id"]) == failing
    failing.clear()
    retried, hidden = run()
    same = ["id", "status", "gen_ids", "label", "token_label"]  # the retried records generate in a smaller batch
    pd.testing.assert_frame_equal(retried[same], clean[same], check_dtype=False)
    for row in retried[retried["status"] == "ok"].itertuples():  # each record's hidden states, wherever they now sit
        ref = clean.set_index("id").loc[row.id]
        n = len(row.gen_ids)
        got = hidden["hidden"][row.hidden_offset : row.hidden_offset + n]
        want = clean_hidden["hidden"][ref.hidden_offset : ref.hidden_offset + n]
        np.testing.assert_allclose(got, want, atol=2e-2, err_msg=row.id)


def test_build_utility_keeps_a_corpus_shards_when_the_list_of_corpora_changes(project, monkeypatch):
    """build_utility's shards are kept per corpus: leaving one corpus out of build_utility.corpora (or adding it back)
    labels no question again, and a killed run still resumes with only its missing shard."""
    qa = {"source": "qa", "id_field": None, "title_field": None, "text_field": None}
    edit_params(project, "index_corpus", corpora={"facts": qa, "more": qa})
    edit_params(project, "build_utility", corpora=["facts", "more"], shard_size=8)  # three shards of 8 per corpus
    early(project)
    index_corpus.main(["--params", "params.yaml"])
    real, labelled = build_utility.utility_records, []

    def counted(loop, gate, questions, *args):
        labelled.extend(questions)
        return real(loop, gate, questions, *args)

    monkeypatch.setattr(build_utility, "utility_records", counted)
    build_utility.main(["--params", "params.yaml"])
    labels = project / "data/utility/labels.parquet"
    both = pd.read_parquet(labels)
    assert list(both["corpus"].unique()) == ["facts", "more"] and len(both) == len(labelled) == 48

    labelled.clear()
    edit_params(project, "build_utility", corpora=["facts"])
    build_utility.main(["--params", "params.yaml"])
    assert labelled == []  # the facts shards were kept
    pd.testing.assert_frame_equal(pd.read_parquet(labels), both[both["corpus"] == "facts"].reset_index(drop=True))

    edit_params(project, "build_utility", corpora=["more", "facts"])
    build_utility.main(["--params", "params.yaml"])
    assert labelled == []  # and so were the left-out corpus's
    shards = sorted((project / "data/utility/shards/more").glob("shard-*.parquet"))
    stamps = {p: p.stat().st_mtime_ns for p in shards[:-1]}
    shards[-1].unlink()  # as if a run had been killed during the last shard of "more"
    build_utility.main(["--params", "params.yaml"])
    assert len(labelled) == 8 and {p: p.stat().st_mtime_ns for p in shards[:-1]} == stamps
    again = pd.read_parquet(labels)
    assert list(again["corpus"].unique()) == ["more", "facts"]
    key = ["corpus", "id"]
    pd.testing.assert_frame_equal(
        again.sort_values(key).reset_index(drop=True),
        both.sort_values(key).reset_index(drop=True),
        check_exact=False,
        atol=1e-5,
    )


def test_a_realtime_batch_that_raises_loses_only_the_article_that_raises_alone(project, monkeypatch, caplog):
    """One policy for a failing batch (detectors.execution.batch_or_each): the batch's articles are continued one by
    one, and only the article that raises alone is recorded as failed; the others are continued as in a clean run."""
    prepare_articles.main(["--params", "params.yaml"])
    edit_params(project, "build_realtime", max_failed_share=0.5)
    build_realtime.main(["--params", "params.yaml"])
    clean = pd.read_parquet(project / "data/realtime/realtime.parquet")
    ok = clean[clean["status"] == "ok"]
    bad = ok.iloc[0]
    (project / "data/realtime/shards/manifest.json").unlink()
    real = realtime_set.generate_traced

    def flaky(llm, prompts, *args, **kwargs):
        if any(bad["title"] in p for p in prompts):
            raise OSError(f"cannot continue {bad['title']!r}")
        return real(llm, prompts, *args, **kwargs)

    monkeypatch.setattr(realtime_set, "generate_traced", flaky)
    with caplog.at_level(logging.WARNING, logger="detectors.execution"):
        build_realtime.main(["--params", "params.yaml"])
    assert "build_realtime: a batch of" in caplog.text  # the failing batch held other articles
    after = pd.read_parquet(project / "data/realtime/realtime.parquet").set_index("id")
    failed = set(after.index[after["status"].str.startswith("error: ")])
    assert failed == set(ok.loc[ok["title"] == bad["title"], "id"])
    kept = ok[~ok["id"].isin(failed)]
    assert len(kept) and (after.loc[kept["id"], "status"] == "ok").all()
    for row in kept.itertuples():  # continued alone: the same greedy tokens as in their batch
        assert list(after.loc[row.id, "gen_ids"]) == list(row.gen_ids), row.id
