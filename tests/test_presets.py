"""presets/paper.yaml, the seed papers' setting (docs/paper-setting.md): applied to params.yaml it validates as the
stages validate it, and its QA source and passage corpus load through the stages' own code from small files in the
formats it names (HotpotQA as the hub serves it, DPR's psgs_w100 converted as the docs convert it)."""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import re

import pandas as pd
import pytest
import yaml
from conftest import HOTPOTQA, ROOT, hotpotqa_dir

from detectors.config import ParamsError, StageParams, load_all, read_params
from detectors.config.presets import NEW, apply, changes, leaves, main, read_preset
from detectors.sources.qa import parse_hf_source

PAPER = ROOT / "presets" / "paper.yaml"
PARAMS = ROOT / "params.yaml"
# DPR's psgs_w100.tsv: a header, then id, text (quoted, its quotes doubled) and title, tab-separated
DPR_TSV = (
    "id\ttext\ttitle\n"
    '1\t"Aaron Aaron ( or ; ""Ahärôn"") is a prophet, high priest, and the brother of Moses."\tAaron\n'
    '2\t"Kiss and Tell is a 1945 American comedy film starring then 17-year-old Shirley Temple as Corliss Archer."'
    "\tKiss and Tell (1945 film)\n"
    '3\t"Shirley Temple Black was an American actress who later served as Chief of Protocol of the United States."'
    "\tShirley Temple\n"
    '4\t""\tAn empty row\n'  # DioR's instructions warn that psgs_w100 has some: skipped and counted
)


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    """params.yaml with the paper preset applied, as ``--write`` writes it."""
    out = tmp_path_factory.mktemp("paper") / "params.yaml"
    apply(PAPER, PARAMS, out)
    return out


def test_every_value_of_the_preset_differs_from_params_yaml():
    """The preset holds only what the paper setting changes (llm.dtype and llm.device stay params.yaml's auto)."""
    found = changes(read_preset(PAPER), read_params(PARAMS))
    assert found
    assert [key for key, old, new in found if old == new] == []
    assert {key for key, old, _ in found if old is NEW} == {
        f"index_corpus.corpora.psgs_w100.{k}" for k in ("source", "id_field", "title_field", "text_field")
    }


def test_applied_preset_is_params_yaml_with_the_preset_values_and_its_comments(applied):
    written, shipped, preset = (
        yaml.safe_load(applied.read_text(encoding="utf-8")),
        read_params(PARAMS),
        read_preset(PAPER),
    )
    for key, value in leaves(preset):
        node = written
        for part in key.split("."):
            node = node[part]
        assert node == value, key  # a !replace table (register.detectors) as the preset gives it, whole
    set_keys = {key for key, _ in leaves(preset)}
    untouched = {
        key: value
        for key, value in leaves_of(shipped).items()
        if not any(key == k or key.startswith(k + ".") for k in set_keys)
    }
    assert {key: leaves_of(written)[key] for key in untouched} == untouched  # "yes" and "no" words stay strings
    text = applied.read_text(encoding="utf-8")
    assert text.startswith(PARAMS.read_text(encoding="utf-8").splitlines()[0])
    assert "  limit: 3600             # questions sampled deterministically by id hash (null = all)\n" in text


def leaves_of(tree: dict) -> dict:
    return dict(leaves(tree))


def test_applied_preset_validates_as_every_stage_reads_it(applied):
    sections = load_all(applied)
    assert sections["llm"].source == "meta-llama/Llama-2-7b-chat-hf"
    assert (sections["llm"].dtype, sections["llm"].device) == ("auto", "auto")  # bfloat16 on the GPU
    assert parse_hf_source(sections["qa"].source) == ("hotpotqa/hotpot_qa", "distractor", "validation")
    corpus = sections["index_corpus"].corpora["psgs_w100"]
    assert (corpus.id_field, corpus.title_field, corpus.text_field) == ("id", "title", "text")
    rag = sections["rag_eval"]
    assert set(rag.corpora) | set(sections["build_utility"].corpora) <= set(sections["index_corpus"].corpora)
    assert rag.max_new_tokens == sections["build_early"].max_new_tokens == sections["retrorag"].answer_tokens
    assert sections["build_early"].answer_hidden_layers == sections["build_realtime"].hidden_layers
    data = read_params(applied)
    for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        # what each stage validates first
        StageParams(data, importlib.import_module(stage.get("do", stage)["cmd"].split()[2]).READS, name)
    # the table the preset replaces (!replace): one utility trigger, the corpus's it trains
    assert set(sections["register"].detectors) == {
        "dior-early",
        "dior-early-extended",
        "dior-realtime",
        "utility-psgs_w100",
    }


def test_preset_question_source_reads_hotpotqa_as_the_hub_lays_it_out(applied, tmp_path, offline_hf):
    """The preset's dataset, config and split on a local copy laid out as the hub's, through the prepare stage."""
    from pipelines.prepare import prepare_qa

    qa = load_all(applied)["qa"]
    name, config, split = parse_hf_source(qa.source)
    local = hotpotqa_dir(tmp_path / name.rsplit("/", 1)[-1])
    report = prepare_qa(
        dataclasses.replace(qa, source=f"hf:{local}:{config}:{split}"),
        str(tmp_path / "raw"),
        str(tmp_path / "qa.parquet"),
        str(tmp_path / "qa_report.json"),
    )
    table = pd.read_parquet(tmp_path / "qa.parquet")
    usable = [r for r in HOTPOTQA[config] if r["answer"]]
    assert (report["raw_records"], report["accepted"], report["rejected"]) == (len(HOTPOTQA[config]), len(usable), 1)
    assert table["id"].tolist() == [r["id"] for r in usable]
    assert [list(a) for a in table["answers"]] == [[r["answer"]] for r in usable]
    assert set(table["split"]) <= {"train", "val", "test"}


def test_preset_corpus_reads_psgs_w100_converted_as_the_docs_convert_it(applied, tmp_path, monkeypatch):
    """DPR's TSV through the conversion block of docs/paper-setting.md, then the preset's corpus entry through
    index_corpus's reading and a BM25 index."""
    from detectors.rag.retriever import BM25Retriever
    from pipelines.index_corpus import corpus_source, recall_at_k

    sections = load_all(applied)
    corpus = sections["index_corpus"].corpora["psgs_w100"]
    page = (ROOT / "docs" / "paper-setting.md").read_text(encoding="utf-8")
    conversion = next(b for b in re.findall(r"```python no-run\n(.*?)```", page, re.DOTALL) if "psgs_w100.tsv.gz" in b)
    assert corpus.source in conversion  # the docs write the file the preset reads
    monkeypatch.chdir(tmp_path)
    with gzip.open(tmp_path / "psgs_w100.tsv.gz", "wt", encoding="utf-8") as f:
        f.write(DPR_TSV)
    exec(compile(conversion, "docs/paper-setting.md", "exec"), {})  # noqa: S102 - the documentation's own code
    source = corpus_source("psgs_w100", corpus, pd.DataFrame(columns=["id", "question", "answers"]))
    retriever = BM25Retriever.build(source, sections["index_corpus"].bm25)
    passages = retriever.passages
    assert [(p.id, p.title) for p in passages] == [
        ("1", "Aaron"),
        ("2", "Kiss and Tell (1945 film)"),
        ("3", "Shirley Temple"),
    ]
    assert passages[0].text == 'Aaron Aaron ( or ; "Ahärôn") is a prophet, high priest, and the brother of Moses.'
    assert retriever.manifest["build"]["skipped"] == {"empty text": 1}
    # ... the woman who portrayed Corliss Archer in the film Kiss and Tell?
    question = HOTPOTQA["distractor"][1]["question"]
    assert retriever.search(question, 1)[0].passage.id == "2"
    assert recall_at_k(retriever, [question], [["Shirley Temple"]], [1]) == {"answer_recall@1": 1.0}


def test_the_command_line_checks_lists_and_writes(tmp_path, capsys):
    out = tmp_path / "params.yaml"
    main([str(PAPER), "--params", str(PARAMS)])
    said = capsys.readouterr().out
    assert "validates" in said
    assert "qa.source: 'bigbench:qa_wikidata' -> 'hf:hotpotqa/hotpot_qa:distractor:validation'" in said
    assert "index_corpus.corpora.psgs_w100.source: (new) -> 'data/raw/psgs_w100.jsonl'" in said
    assert not out.exists()
    main([str(PAPER), "--params", str(PARAMS), "--write", str(out)])
    assert load_all(out)["rag_eval"].corpora == ["psgs_w100"]


@pytest.mark.parametrize(
    "preset, said",
    [
        ("qa:\n  limt: 3200\n", "preset {preset} applied to {params}: params: qa.limt = 3200: unknown key"),
        ("rag_eval:\n  corpora: [psgs_w100]\n", "rag_eval.sweep.corpus = 'facts': must be one of rag_eval.corpora"),
        ("qa:\n  limit:\n    n: 3\n", "preset key qa.limit.n: qa.limit is not a mapping in {params} (1100)"),
        ("- qa\n", "must hold a mapping of params sections"),
        ("qa:\n  source.x: 1\n", "keys are non-empty strings without dots"),
    ],
)
def test_a_preset_the_sections_refuse_is_an_error_naming_it(tmp_path, capsys, preset, said):
    path = tmp_path / "bad.yaml"
    path.write_text(preset, encoding="utf-8")
    with pytest.raises(ParamsError, match=re.escape(said.format(preset=path, params=PARAMS))):
        apply(path, PARAMS)
    with pytest.raises(SystemExit):
        main([str(path), "--params", str(PARAMS), "--write", str(tmp_path / "params.yaml")])
    assert "ParamsError: " in capsys.readouterr().err and not (tmp_path / "params.yaml").exists()


def test_a_missing_preset_is_an_error_naming_it(tmp_path):
    with pytest.raises(
        ParamsError, match="preset .*absent.yaml' not found: give a preset file, e.g. presets/paper.yaml"
    ):
        read_preset(tmp_path / "absent.yaml")
