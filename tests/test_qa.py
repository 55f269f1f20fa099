"""QA sources: normalisation, DioR's containment label, stable ids, splits, record loading and sampling."""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from conftest import HOTPOTQA, hotpotqa_dir

from detectors.errors import SourceError
from detectors.sources.ids import sample, split_of, stable_id
from detectors.sources.qa import load_raw, normalize_records, parse_hf_source
from detectors.sources.text import contains_reference, normalize_text, split_sentences

# --- normalize_text ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b",
    [
        ("PARIS", "paris"),  # case
        ("Washington, D.C.!", "washington d c"),  # punctuation becomes a word break
        ("The Beatles", "beatles"),  # articles
        ("a cat and an owl", "cat and owl"),
        ("Zürich", "Zurich"),  # accents
        ("Zu\u0308rich", "Zurich"),  # decomposed accent
        ("São Paulo", "Sao Paulo"),
        ("Ｔｏｋｙｏ　２０２０", "Tokyo 2020"),  # NFKC full-width letters, digits and space
        ("ﬁnland", "finland"),  # NFKC ligature
        ("  New \t York\n City ", "new york city"),  # whitespace collapsed
        ("“Quoted” — text…", "quoted text"),  # unicode punctuation
    ],
)
def test_normalize_text_equates(a, b):
    assert normalize_text(a) == normalize_text(b)


def test_normalize_text_exact_output():
    assert normalize_text("  The Eiffel-Tower, in PARIS (France).  ") == "eiffel tower in paris france"
    assert normalize_text("Ｚüｒｉｃｈ") == "zurich"


def test_normalize_text_keeps_articles_inside_words():
    # "a", "an", "the" are dropped only as whole words
    assert normalize_text("Theodore and Anna at the theatre") == "theodore and anna at theatre"


def test_normalize_text_of_punctuation_only_is_empty():
    assert normalize_text(" ... !? — ") == ""
    assert normalize_text("The") == ""


# --- split_sentences ---------------------------------------------------------------------------------


def test_sentences_end_at_punctuation_before_what_can_open_a_sentence():
    text = ' Toulouse is in France. It has 500,000 people! Why? 1990 was a year. "Quoted." (Aside.) e.g. the end '
    assert split_sentences(text) == [
        "Toulouse is in France.",
        "It has 500,000 people!",
        "Why?",
        "1990 was a year.",
        '"Quoted."',
        "(Aside.) e.g. the end",
    ]
    assert split_sentences("approx. two km, i.e. short.") == ["approx. two km, i.e. short."]
    assert split_sentences("  ") == []


# --- contains_reference (DioR: R ⊆ A) ---------------------------------------------------------------


def test_reference_contained_in_a_longer_answer():
    assert contains_reference("Washington D.C.", ["Washington"])
    assert contains_reference("It is the city of Washington, D.C., I think.", ["washington d.c."])


def test_answer_contained_in_reference_is_not_enough():
    # R ⊆ A, not A ⊆ R
    assert not contains_reference("Washington", ["Washington D.C."])


def test_reference_must_match_whole_words():
    assert not contains_reference("thus it is", ["US"])
    assert not contains_reference("Parisian food", ["Paris"])
    assert contains_reference("made in the US.", ["US"])


def test_multiword_reference_must_be_contiguous():
    assert contains_reference("born in New York City", ["New York"])
    assert not contains_reference("New cars in York", ["New York"])


def test_any_alias_counts():
    aliases = ["United States of America", "USA", "U.S."]
    assert contains_reference("He moved to the USA in 1990.", aliases)
    assert contains_reference("He moved to the U.S. in 1990.", aliases)
    assert not contains_reference("He moved to Canada in 1990.", aliases)


def test_normalisation_applies_to_both_sides():
    assert contains_reference("He lived in ZURICH", ["Zürich"])
    assert contains_reference("Ｔｏｋｙｏ", ["tokyo"])
    assert contains_reference("The Beatles.", ["Beatles"])


@pytest.mark.parametrize("ref", ["", "   ", "...", "?!", "the"])
def test_empty_or_punctuation_only_reference_never_matches(ref):
    assert not contains_reference("anything at all ... the end?!", [ref])


def test_no_references_and_empty_answer():
    assert not contains_reference("Paris", [])
    assert not contains_reference("", ["Paris"])


# --- stable ids and splits -----------------------------------------------------------------------------

RATIOS = {"train": 0.6, "val": 0.2, "test": 0.2}


def test_stable_id_is_stable_and_distinguishes_source_and_question():
    a = stable_id("Who wrote Hamlet?", "popqa.jsonl")
    assert a == stable_id("Who wrote Hamlet?", "popqa.jsonl")
    assert a == stable_id("  Who wrote Hamlet?\n", "popqa.jsonl")  # surrounding whitespace ignored
    assert a != stable_id("Who wrote Macbeth?", "popqa.jsonl")
    assert a != stable_id("Who wrote Hamlet?", "other.jsonl")
    assert len(a) == 16 and int(a, 16) >= 0


def test_ids_of_a_file_do_not_depend_on_where_the_project_sits(tmp_path):
    """The same file under two checkouts gives the same ids, so the same splits (CI's checkout sits elsewhere)."""
    record = [{"question": "Who wrote Hamlet?", "answers": ["Shakespeare"]}]
    here, there = (
        normalize_records(record, "/work/main/data/qa.jsonl")[0],
        normalize_records(record, str(tmp_path / "qa.jsonl"))[0],
    )
    assert here["id"].tolist() == there["id"].tolist() == [stable_id("Who wrote Hamlet?", "qa.jsonl")]
    assert stable_id("Who wrote Hamlet?", "bigbench:qa_wikidata") != stable_id("Who wrote Hamlet?", "bigbench:other")


def test_split_of_is_deterministic_and_roughly_matches_ratios():
    ids = [stable_id(f"question number {i}", "synthetic") for i in range(5000)]
    first = [split_of(i, RATIOS) for i in ids]
    assert first == [split_of(i, RATIOS) for i in ids]  # same on every call
    counts = Counter(first)
    assert set(counts) == {"train", "val", "test"}
    for name, ratio in RATIOS.items():
        assert abs(counts[name] / len(ids) - ratio) < 0.03, counts


def test_split_of_follows_other_ratios():
    ids = [f"q{i}" for i in range(5000)]
    counts = Counter(split_of(i, {"train": 0.8, "val": 0.1, "test": 0.1}) for i in ids)
    assert abs(counts["train"] / 5000 - 0.8) < 0.03
    assert abs(counts["val"] / 5000 - 0.1) < 0.03


# --- normalize_records -----------------------------------------------------------------------------


def reasons(rejected: pd.DataFrame) -> dict[int, str]:
    return dict(zip(rejected["index"], rejected["reason"]))


def test_accepts_plain_records():
    raw = [{"question": "What is the capital of France?", "answers": ["Paris"]}]
    ok, rejected = normalize_records(raw, "src")
    assert list(ok.columns) == ["id", "question", "answers"]
    assert ok.loc[0, "question"] == "What is the capital of France?"
    assert ok.loc[0, "answers"] == ["Paris"]
    assert ok.loc[0, "id"] == stable_id("What is the capital of France?", "src")
    assert rejected.empty


def test_empty_question_is_rejected_with_a_reason():
    raw = [
        {"question": "", "answers": ["x"]},
        {"question": "   ", "answers": ["x"]},
        {"question": None, "answers": ["x"]},
        {"answers": ["x"]},
        {"question": "Kept?", "answers": ["yes"]},
    ]
    ok, rejected = normalize_records(raw, "src")
    assert ok["question"].tolist() == ["Kept?"]
    r = reasons(rejected)
    assert sorted(r) == [0, 1, 2, 3]
    assert all("empty question" in reason for reason in r.values())
    assert "question" in r[0]  # names the field


@pytest.mark.parametrize("answers", [None, "", "   ", [], [""], ["...", "  "], {"aliases": []}, "[]", ["The", "a"]])
def test_missing_or_empty_answers_are_rejected(answers):
    ok, rejected = normalize_records([{"question": "Who?", "answers": answers}], "src")
    assert ok.empty
    assert rejected.loc[0, "index"] == 0
    assert "no usable reference answer" in rejected.loc[0, "reason"]


def test_record_without_answers_field_is_rejected():
    ok, rejected = normalize_records([{"question": "Who?"}], "src")
    assert ok.empty
    assert "no usable reference answer" in rejected.loc[0, "reason"]


def test_non_dict_record_is_rejected():
    ok, rejected = normalize_records(["just a string", {"question": "Q?", "answers": "Answer"}], "src")
    assert len(ok) == 1
    assert reasons(rejected) == {0: "not a record: str"}


def test_same_question_twice_merges_answers_and_reports_it():
    raw = [
        {"question": "Where is Zürich?", "answers": ["Switzerland"]},
        {"question": "Who wrote Hamlet?", "answers": ["Shakespeare"]},
        {"question": "Where is Zu\u0308rich? ", "answers": ["Switzerland", "CH"]},  # same after NFC + strip
    ]
    ok, rejected = normalize_records(raw, "src")
    assert len(ok) == 2
    row = ok[ok["question"] == "Where is Zürich?"].iloc[0]
    assert row["answers"] == ["Switzerland", "CH"]
    assert reasons(rejected) == {2: "duplicate question: answers merged into the first"}
    assert rejected.loc[0, "id"] == row["id"]


def test_different_questions_with_same_explicit_id_keep_the_first():
    raw = [
        {"id": 7, "question": "Who wrote Hamlet?", "answers": ["Shakespeare"]},
        {"id": "7", "question": "Who painted the Mona Lisa?", "answers": ["Leonardo da Vinci"]},
    ]
    ok, rejected = normalize_records(raw, "src")
    assert ok["question"].tolist() == ["Who wrote Hamlet?"]
    assert ok["id"].tolist() == ["7"]
    reason = reasons(rejected)[1]
    assert reason.startswith("duplicate id")
    assert "Who wrote Hamlet?" in reason
    assert rejected.loc[0, "id"] == "7"


def test_explicit_id_field():
    raw = [{"qid": "Q1", "uid": "u-1", "question": "Q?", "answers": "Answer"}]
    assert normalize_records(raw, "src")[0]["id"].tolist() == ["Q1"]  # qid is a known id field
    assert normalize_records(raw, "src", id_field="uid")[0]["id"].tolist() == ["u-1"]


def test_empty_explicit_id_falls_back_to_the_question_hash():
    ok, _ = normalize_records([{"id": "", "question": "Q?", "answers": "Answer"}], "src")
    assert ok["id"].tolist() == [stable_id("Q?", "src")]


def test_non_ascii_questions_are_kept_intact():
    questions = ["東京はどこの国の首都ですか？", "Где находится Эйфелева башня?", "¿Quién escribió «Don Quijote»?"]
    raw = [{"question": q, "answers": ["x"]} for q in questions]
    ok, rejected = normalize_records(raw, "src")
    assert ok["question"].tolist() == questions
    assert rejected.empty
    assert ok["id"].nunique() == 3


def test_decomposed_question_is_stored_in_nfc():
    ok, _ = normalize_records([{"question": "Wo liegt Zu\u0308rich?", "answers": "Schweiz"}], "src")
    assert ok.loc[0, "question"] == "Wo liegt Zürich?"
    assert unicodedata.is_normalized("NFC", ok.loc[0, "question"])


@pytest.mark.parametrize(
    "answers, expected",
    [
        ("Paris", ["Paris"]),
        ("  Paris ", ["Paris"]),
        (["Paris", "City of Light", "Paris"], ["Paris", "City of Light"]),
        ('["Paris", "City of Light"]', ["Paris", "City of Light"]),  # a JSON list in a CSV cell
        ("[citation needed]", ["[citation needed]"]),  # bracketed but not JSON: kept as text
        ({"aliases": ["Paris", "Lutetia"]}, ["Paris", "Lutetia"]),
        ({"text": ["Paris"], "answer_start": [0]}, ["Paris"]),
        (["Paris", "", "..."], ["Paris"]),  # empty aliases dropped
        ([["Paris"], "Lutetia"], ["Paris", "Lutetia"]),
        (1889, ["1889"]),
    ],
)
def test_answer_shapes(answers, expected):
    ok, rejected = normalize_records([{"question": "Q?", "answers": answers}], "src")
    assert rejected.empty
    assert ok.loc[0, "answers"] == expected


def test_explicit_fields_override_the_defaults():
    raw = [{"question": "ignored", "answers": ["ignored"], "q": "Real question?", "gold": ["Real answer"]}]
    ok, _ = normalize_records(raw, "src", question_field="q", answers_field="gold")
    assert ok.loc[0, "question"] == "Real question?"
    assert ok.loc[0, "answers"] == ["Real answer"]


def test_explicit_field_absent_from_a_record_rejects_it():
    ok, rejected = normalize_records([{"question": "Q?", "answers": "Answer"}], "src", question_field="q")
    assert ok.empty
    assert "empty question" in rejected.loc[0, "reason"]


# --- files through load_raw -----------------------------------------------------------------------

POPQA = [
    {
        "id": 4222362,
        "question": "What is George Rankin's occupation?",
        "possible_answers": '["politician", "political leader"]',
    },
    {
        "id": 453047,
        "question": "In what country is Zürich?",
        "possible_answers": '["Switzerland", "Swiss Confederation"]',
    },
    {
        "id": 1339195,
        "question": "Who was the director of Lolita?",
        "possible_answers": '["Stanley Kubrick", "Kubrick"]',
    },
]
BIGBENCH = [
    {"input": "The capital of France is", "target": ["Paris"]},
    {
        "input": "Douglas Adams is the author of",
        "target": ["The Hitchhiker's Guide to the Galaxy", "Hitchhiker's Guide"],
    },
]


def load(path: Path, raw_dir: Path, **fields):
    return normalize_records(load_raw(str(path), raw_dir), str(path), **fields)


def check_popqa(ok: pd.DataFrame, rejected: pd.DataFrame):
    assert rejected.empty
    assert ok["id"].tolist() == ["4222362", "453047", "1339195"]
    assert ok["question"].tolist() == [r["question"] for r in POPQA]
    assert ok["answers"].tolist() == [
        ["politician", "political leader"],
        ["Switzerland", "Swiss Confederation"],
        ["Stanley Kubrick", "Kubrick"],
    ]


def check_bigbench(ok: pd.DataFrame, rejected: pd.DataFrame, source: str):
    assert rejected.empty
    assert ok["question"].tolist() == ["The capital of France is", "Douglas Adams is the author of"]
    assert ok["answers"].tolist() == [["Paris"], ["The Hitchhiker's Guide to the Galaxy", "Hitchhiker's Guide"]]
    assert ok["id"].tolist() == [stable_id(q, source) for q in ok["question"]]


def test_jsonl_popqa_like(tmp_path):
    path = tmp_path / "popqa.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in POPQA) + "\n\n", encoding="utf-8")
    check_popqa(*load(path, tmp_path / "raw", question_field="question", answers_field="possible_answers"))
    check_popqa(*load(path, tmp_path / "raw"))  # default field names find them too


def test_json_bigbench_like(tmp_path):
    path = tmp_path / "task.json"
    path.write_text(json.dumps({"name": "qa", "examples": BIGBENCH}), encoding="utf-8")
    check_bigbench(*load(path, tmp_path / "raw", question_field="input", answers_field="target"), str(path))
    check_bigbench(*load(path, tmp_path / "raw"), str(path))


def test_json_plain_list_and_data_key(tmp_path):
    a = tmp_path / "list.json"
    a.write_text(json.dumps(BIGBENCH))
    assert len(load_raw(str(a), tmp_path)) == 2
    b = tmp_path / "data.json"
    b.write_text(json.dumps({"data": BIGBENCH}))
    assert load_raw(str(b), tmp_path) == BIGBENCH


def test_json_without_a_list_is_a_source_error(tmp_path):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"questions": BIGBENCH}))
    with pytest.raises(SourceError, match="expected a list of records"):
        load_raw(str(path), tmp_path)


def test_csv_popqa_like(tmp_path):
    path = tmp_path / "popqa.csv"
    pd.DataFrame(POPQA).to_csv(path, index=False)
    check_popqa(*load(path, tmp_path / "raw", question_field="question", answers_field="possible_answers"))


def test_csv_hand_written_with_quoted_json_cell_and_plain_answer(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text(
        "input,target\n"
        '"Where is Zürich, exactly?","[""Switzerland"", ""CH""]"\n'
        "Who wrote Hamlet?,William Shakespeare\n"
        "Empty answer?,\n",
        encoding="utf-8",
    )
    ok, rejected = load(path, tmp_path, question_field="input", answers_field="target")
    assert ok["question"].tolist() == ["Where is Zürich, exactly?", "Who wrote Hamlet?"]
    assert ok["answers"].tolist() == [["Switzerland", "CH"], ["William Shakespeare"]]
    assert reasons(rejected) == {2: "no usable reference answer (field target)"}


def test_parquet_with_list_and_struct_answers(tmp_path):
    popqa = tmp_path / "popqa.parquet"
    pd.DataFrame(
        {
            "id": [4222362, 453047, 1339195],
            "question": [r["question"] for r in POPQA],
            "possible_answers": [json.loads(r["possible_answers"]) for r in POPQA],  # a list column
        }
    ).to_parquet(popqa)
    check_popqa(*load(popqa, tmp_path, question_field="question", answers_field="possible_answers"))

    trivia = tmp_path / "trivia.parquet"
    pd.DataFrame(
        {"query": ["Capital of Japan?"], "answer": [{"aliases": ["Tokyo", "Tōkyō"], "value": "Tokyo"}]}
    ).to_parquet(trivia)
    ok, rejected = load(trivia, tmp_path)
    assert rejected.empty
    assert ok.loc[0, "question"] == "Capital of Japan?"
    assert ok.loc[0, "answers"] == ["Tokyo", "Tōkyō"]


def test_parquet_bigbench_like(tmp_path):
    path = tmp_path / "bb.parquet"
    pd.DataFrame(BIGBENCH).to_parquet(path)
    check_bigbench(*load(path, tmp_path, question_field="input", answers_field="target"), str(path))


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(
        json.dumps(POPQA[0]) + "\n" + '{"question": "Who?", "answers": ["x"]\n' + json.dumps(POPQA[1]) + "\n"
    )
    with pytest.raises(SourceError) as err:
        load_raw(str(path), tmp_path)
    assert f"{path}:2:" in str(err.value)
    assert "not valid JSON" in str(err.value)


def test_unsupported_suffix_is_a_source_error(tmp_path):
    path = tmp_path / "questions.txt"
    path.write_text("What is the capital of France?\tParis\n")
    with pytest.raises(SourceError, match=r"unsupported file type '\.txt'"):
        load_raw(str(path), tmp_path)


def test_missing_file_is_a_source_error(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(SourceError, match="file not found") as err:
        load_raw(str(path), tmp_path)
    assert str(path) in str(err.value)


def test_upper_case_suffix_is_read(tmp_path):
    path = tmp_path / "QA.JSONL"
    path.write_text(json.dumps(POPQA[0]) + "\n")
    assert load_raw(str(path), tmp_path) == [POPQA[0]]


# --- hf: sources (datasets.load_dataset), on local directories laid out as the hub's copies -----------------

# 2WikiMultihopQA's dev.json: a JSON list whose records are identified by _id
TWOWIKI = [
    {
        "_id": "8813f87c0bdd11eba7f7acde48001122",
        "type": "compositional",
        "question": "Who is the mother of the director of film Polish-Russian War (Film)?",
        "answer": "Małgorzata Braunek",
    },
    {
        "_id": "28941e2c0bdc11eba7f7acde48001122",
        "type": "comparison",
        "question": "Which film came out first, Blind Shaft or The Mask Of Fu Manchu?",
        "answer": "The Mask Of Fu Manchu",
    },
    {
        "_id": "28941e2c0bdc11eba7f7acde48001122",
        "type": "comparison",
        "question": "Which film came out first, Blind Shaft or The Mask Of Fu Manchu?",
        "answer": "The Mask of Fu Manchu",
    },
]


def twowiki_dir(root: Path) -> Path:
    """A local directory holding 2WikiMultihopQA's ``dev.json`` (the datasets library reads ``dev`` as validation)."""
    root.mkdir(parents=True)
    (root / "dev.json").write_text(json.dumps(TWOWIKI, ensure_ascii=False), encoding="utf-8")
    return root


@pytest.mark.parametrize(
    "source, parsed",
    [
        ("hf:hotpotqa/hotpot_qa:distractor:validation", ("hotpotqa/hotpot_qa", "distractor", "validation")),
        ("hf:a/b:train", ("a/b", None, "train")),  # two parts: id and split, as before configs
        ("hf:a/b", ("a/b", None, "validation")),  # the id alone: its validation split
        ("hf:/data/hotpot_qa:fullwiki:validation", ("/data/hotpot_qa", "fullwiki", "validation")),  # a local directory
    ],
)
def test_hf_source_names_dataset_config_and_split(source, parsed):
    assert parse_hf_source(source) == parsed


@pytest.mark.parametrize(
    "source", ["hf:", "hf::validation", "hf:a/b:", "hf:a/b::validation", "hf:a/b:distractor:validation:x"]
)
def test_malformed_hf_source_is_a_source_error_that_shows_the_syntax(source, tmp_path):
    with pytest.raises(SourceError) as err:
        load_raw(source, tmp_path)  # refused before the datasets library is asked
    assert repr(source) in str(err.value)
    assert "hf:<dataset id>[:<config>]:<split>" in str(err.value)


def test_hotpotqa_config_and_split_are_read_from_a_local_directory(tmp_path, offline_hf):
    root = hotpotqa_dir(tmp_path / "hotpot_qa")
    source = f"hf:{root}:distractor:validation"
    raw = load_raw(source, tmp_path / "raw")
    assert [r["id"] for r in raw] == [r["id"] for r in HOTPOTQA["distractor"]]
    assert raw[0]["type"] == "comparison" and raw[0]["level"] == "hard"  # the other fields come along
    ok, rejected = normalize_records(raw, source)
    assert ok["id"].tolist() == ["5a8b57f25542995d1e6f1371", "5a8c7595554299585d9e36b6"]  # HotpotQA's own ids
    assert ok["answers"].tolist() == [["yes"], ["Chief of Protocol"]]
    assert rejected["id"].tolist() == ["5a85ea095542994775f606a8"]
    assert rejected["reason"].tolist() == ["no usable reference answer (field answer)"]
    other = load_raw(f"hf:{root}:fullwiki:validation", tmp_path / "raw")
    assert [r["question"] for r in other] == [HOTPOTQA["fullwiki"][0]["question"]]  # the config chooses the files
    assert offline_hf.is_dir()


def test_twowiki_ids_come_from_its_id_field_and_a_repeated_record_merges(tmp_path, offline_hf):
    source = f"hf:{twowiki_dir(tmp_path / '2wikimultihopqa')}:validation"
    ok, rejected = normalize_records(load_raw(source, tmp_path / "raw"), source)
    assert ok["id"].tolist() == [TWOWIKI[0]["_id"], TWOWIKI[1]["_id"]]
    assert ok["answers"].tolist() == [["Małgorzata Braunek"], ["The Mask Of Fu Manchu", "The Mask of Fu Manchu"]]
    assert rejected["reason"].tolist() == ["duplicate question: answers merged into the first"]


@pytest.mark.parametrize(
    "config, split, said", [("nope", "validation", "'nope' not found"), ("distractor", "test", 'Unknown split "test"')]
)
def test_an_unknown_config_or_split_is_a_source_error_naming_the_source(tmp_path, offline_hf, config, split, said):
    source = f"hf:{hotpotqa_dir(tmp_path / 'hotpot_qa')}:{config}:{split}"
    with pytest.raises(SourceError) as err:
        load_raw(source, tmp_path / "raw")
    assert repr(source) in str(err.value) and said in str(err.value)


# --- sample -----------------------------------------------------------------------------------------


@pytest.fixture
def records() -> pd.DataFrame:
    raw = [{"question": f"Question {i}: what is {i} squared?", "answers": [str(i * i)]} for i in range(60)]
    ok, _ = normalize_records(raw, "synthetic")
    return ok


def test_sample_is_deterministic(records):
    a = sample(records, 15)
    b = sample(records.copy(), 15)
    assert len(a) == 15
    assert a["id"].tolist() == b["id"].tolist()
    assert a["id"].is_unique
    assert set(a["id"]) <= set(records["id"])
    assert list(a.index) == list(range(15))


def test_sample_is_independent_of_row_order(records):
    shuffled = records.sample(frac=1.0, random_state=3).reset_index(drop=True)
    assert shuffled["id"].tolist() != records["id"].tolist()
    assert set(sample(shuffled, 15)["id"]) == set(sample(records, 15)["id"])
    reversed_rows = records.iloc[::-1].reset_index(drop=True)
    assert set(sample(reversed_rows, 15)["id"]) == set(sample(records, 15)["id"])


def test_sample_keeps_row_contents_together(records):
    by_id = records.set_index("id")
    for _, row in sample(records, 10).iterrows():
        assert by_id.loc[row["id"], "question"] == row["question"]
        assert by_id.loc[row["id"], "answers"] == row["answers"]


def test_sample_is_nested_as_the_limit_grows(records):
    assert set(sample(records, 5)["id"]) < set(sample(records, 20)["id"])


@pytest.mark.parametrize("limit", [None, 60, 61, 1000])
def test_sample_returns_all_rows_when_limit_is_large(records, limit):
    out = sample(records, limit)
    assert len(out) == len(records)
    assert out["id"].tolist() == records["id"].tolist()


def test_prepare_refuses_a_source_without_usable_records(tmp_path):
    from detectors.config.early import QAParams
    from pipelines.prepare import prepare_qa

    def qa_params(source: str) -> QAParams:
        return QAParams(source, None, None, None, None, {"train": 0.6, "val": 0.2, "test": 0.2})

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SourceError, match="no usable record among 0"):
        prepare_qa(qa_params(str(empty)), str(tmp_path), str(tmp_path / "qa.parquet"), str(tmp_path / "report.json"))
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text('{"question": "", "answers": ["x"]}\n{"question": "Q?", "answers": []}\n')
    with pytest.raises(SourceError, match="no usable record among 2"):
        prepare_qa(qa_params(str(only_bad)), str(tmp_path), str(tmp_path / "qa.parquet"), str(tmp_path / "report.json"))
    assert not (tmp_path / "qa.parquet").exists()
