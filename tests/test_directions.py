"""CtrlA direction extraction on the tiny Llama: planted directions are recovered, statements and
artifacts fail clearly on bad input."""

from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CONTRAST, ROOT, STATEMENTS, build_tiny_llama

from detectors.config.schema import ContrastParams, LayerRangeParams, StatementParams
from detectors.ctrla.directions import Directions, DirectionsError, contrast_differences, extract, fit_pca
from detectors.ctrla.layer_ranges import resolve_range
from detectors.ctrla.statements import StatementError, load_statements, statements_from_qa
from detectors.ctrla.steering import steer
from detectors.evaluation.metrics import auroc
from detectors.llm.fingerprint import DtypeMismatchError, LLMMismatchError
from detectors.llm.loading import LLM
from detectors.registry.artifact import seal

STATEMENTS_FIXTURE = ROOT / "data" / "fixtures" / "statements_small.csv"
pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)


def unit(seed: int, dim: int = 64) -> torch.Tensor:
    v = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


def test_pca_recovers_a_planted_direction_and_orients_it_positive():
    gen = torch.Generator().manual_seed(0)
    u = unit(1)
    # 400 contrast vectors: a positive shift along u of varying size plus isotropic noise of similar norm
    diffs = 3 * (1 + torch.rand(400, 1, generator=gen)) * u + torch.randn(400, 64, generator=gen) * 0.3
    vectors, explained = fit_pca(torch.stack([diffs, -diffs]), seed=0)
    assert float(vectors[0] @ u) > 0.99  # positive instruction projects higher
    assert float(vectors[1] @ u) < -0.99  # the reversed contrast is oriented the other way
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(2))
    # the planted share of the variance: E[(3(1+U))^2] = 21 along u against 64 * 0.3^2 of noise (measured 0.784-0.793
    # over seeds)
    assert float(explained[0]) == pytest.approx(21 / (21 + 64 * 0.09), abs=0.03) and float(explained[1]) == float(
        explained[0]
    )


def test_extraction_on_the_tiny_llama_finds_a_direction_planted_in_the_positive_pass(tiny_llm):
    u = unit(7)
    plant = lambda: steer(tiny_llm.model, {1: 4.0 * u})  # noqa: E731  positive pass only: r+ = r- + 4u at layer 1
    stats = contrast_differences(tiny_llm, CONTRAST, STATEMENTS[:8], batch_size=3, positive_context=plant)
    assert stats.diffs.shape[:2] == (2, len(stats.owner)) and stats.diffs.shape[2] == 64
    vectors, explained = fit_pca(stats.diffs, seed=0)
    assert float(vectors[0] @ u) > 0.95  # layer 1: the planted shift dominates the instructions' own contrast
    # the directions separate the held-out contrast pairs at every layer: positive projects higher
    held = contrast_differences(tiny_llm, CONTRAST, STATEMENTS[8:], batch_size=4, positive_context=plant)
    for layer in range(2):
        proj = (held.diffs[layer].cpu() @ vectors[layer].cpu()).numpy()
        assert (proj > 0).mean() > 0.9, layer
    # at layer 1 the planted shift carries almost all the variance (measured 0.986; 0.64 unplanted)
    assert float(explained[0]) > 0.9


def test_extracted_directions_separate_positive_from_negative_representations(tiny_llm):
    """Without a plant: the real instruction contrast is what the first component captures."""
    frame = pd.DataFrame(
        {"id": [str(i) for i in range(12)], "statement": STATEMENTS, "label": 1, "split": ["train"] * 8 + ["test"] * 4}
    )
    params = ContrastParams(CONTRAST.positive, CONTRAST.negative, StatementParams(limit=None))
    directions, _ = extract(tiny_llm, "honesty", params, frame, [1, 2], 4, 0, [2, 4], {"llm": {}})
    held = contrast_differences(tiny_llm, params, STATEMENTS[8:], batch_size=4)
    for layer in range(2):
        proj = (held.diffs[layer].cpu() @ directions.vectors[layer].cpu()).numpy()
        labels = np.r_[np.ones(len(proj)), np.zeros(len(proj))]
        assert auroc(labels, np.r_[proj, -proj]) > 0.9
    assert set(directions.curve) == {2, 4} and directions.config["n_statements"] == 8
    assert directions.dtype == "float32"  # the dtype they were extracted in, recorded with the LLM's location


def test_statements_from_qa_pair_each_fact_with_a_wrong_answer_of_its_relation():
    table = pd.DataFrame(
        {
            "id": ["a", "b", "c"],
            "split": ["train", "test", "train"],
            "question": ["The capital of France is", "The capital of Spain is", "The language of Peru is"],
            "answers": [["Paris"], ["Madrid"], ["Spanish"]],
        }
    )
    frame = statements_from_qa(table)
    assert set(frame["statement"]) >= {
        "The capital of France is Paris.",
        "The capital of France is Madrid.",
        "The capital of Spain is Paris.",
    }
    assert (frame.groupby("label").size() == 3).all()
    wrong = frame[frame["id"] == "c:false"].iloc[0]["statement"]
    assert wrong != "The language of Peru is Spanish." and wrong.startswith("The language of Peru is ")


def test_a_statement_file_in_the_papers_format_loads_through_the_same_params():
    """A ``statement,label`` CSV as CtrlA's statement sets are (quoted statements with commas, a repeated row): a
    hand-made one of the repository's fixtures, read as ``extract_directions.*.statements.source`` reads a file."""
    facts = load_statements(StatementParams(source=str(STATEMENTS_FIXTURE)), "unused")
    assert len(facts) == 48 and (facts.groupby("label").size() == 24).all()  # 49 rows, one repeated
    assert "Iron, when exposed to water and oxygen, rusts." in set(facts["statement"])
    assert set(facts["split"]) == {"train", "val", "test"} and (facts["split"] == "train").mean() > 0.6
    again = load_statements(StatementParams(source=str(STATEMENTS_FIXTURE)), "unused")
    assert again.equals(facts)  # ids and splits by hash: the same every time
    unlabelled = load_statements(StatementParams(source=str(STATEMENTS_FIXTURE), label_field=None), "unused")
    assert unlabelled["label"].isna().all() and len(unlabelled) == 48


def test_bad_statement_sources_fail_with_the_value_and_what_to_do(tmp_path, tiny_llm):
    empty = tmp_path / "empty.csv"
    empty.write_text("statement,label\n")
    with pytest.raises(StatementError, match="empty"):
        load_statements(StatementParams(source=str(empty)), "unused")
    other = tmp_path / "other.csv"
    other.write_text("text\nThe sky is blue.\n")
    with pytest.raises(StatementError, match="text_field = 'statement'.*columns: \\['text'\\]"):
        load_statements(StatementParams(source=str(other)), "unused")
    with pytest.raises(StatementError, match="run prepare first"):
        load_statements(StatementParams(source="qa"), tmp_path / "missing.parquet")
    too_long = " ".join(["Paris"] * 400)
    params = ContrastParams(CONTRAST.positive, CONTRAST.negative, StatementParams(max_tokens=None))
    with pytest.raises(StatementError, match="exceeds the LLM's context of 256 tokens.*max_tokens"):
        contrast_differences(tiny_llm, params, [too_long], batch_size=1)


def test_layer_ranges_scale_to_the_llms_depth():
    steer_range, monitor_range = LayerRangeParams(5, 18, 32), LayerRangeParams(10, 25, 32)
    assert resolve_range(steer_range, 32) == list(range(5, 19))
    assert resolve_range(steer_range, 30) == list(range(5, 18))
    assert resolve_range(monitor_range, 30) == list(range(9, 24))
    assert resolve_range(steer_range, 2) == [1] and resolve_range(monitor_range, 2) == [1, 2]


def _directions(llm: LLM) -> Directions:
    fp = llm.fingerprint
    return Directions(
        "honesty",
        torch.stack([unit(1), unit(2)]),
        torch.tensor([0.5, 0.4]),
        torch.tensor([3.0, 5.0]),
        [1],
        fp,
        {"llm": {"dir": "x", "dtype": "float32"}},
    )


def test_artifact_round_trip_and_refusal_of_another_llm(tmp_path, tiny_llm, tokenizer):
    saved = _directions(tiny_llm).save(tmp_path / "honesty")
    loaded = Directions.load(saved)
    assert torch.equal(loaded.vectors, _directions(tiny_llm).vectors) and loaded.layers == [1]
    assert json.loads((saved / "detector.json").read_text())["kind"] == "ctrla-honesty"
    loaded.require_llm(tiny_llm)
    other = LLM.wrap(build_tiny_llama(tokenizer, seed=1, train_steps=0), tokenizer, "another-tiny-llama")
    with pytest.raises(LLMMismatchError, match="weights_digest"):
        loaded.require_llm(other)


def test_directions_for_a_different_layer_count_are_refused(tmp_path, tiny_llm, tokenizer):
    saved = _directions(tiny_llm).save(tmp_path / "honesty")
    meta = json.loads((saved / "detector.json").read_text())
    meta["llm"]["fingerprint"]["num_layers"] = 3  # a file claiming another depth than its vectors have
    (saved / "detector.json").write_text(json.dumps(meta))
    seal(saved)  # as its writer would have recorded it
    with pytest.raises(DirectionsError, match=r"shape \(2, 64\).*3 layers"):
        Directions.load(saved)
    deeper = build_tiny_llama(tokenizer, train_steps=0)
    deeper.model.layers.append(type(deeper.model.layers[0])(deeper.config, 2))
    deeper.config.num_hidden_layers = 3
    with pytest.raises(LLMMismatchError, match="2 layers but the LLM .* has 3"):
        _directions(tiny_llm).require_llm(LLM.wrap(deeper, tokenizer, "deeper"))


def test_directions_refuse_an_llm_in_another_dtype_unless_allowed(tmp_path, tiny_llm):
    from detectors.ctrla.registered import HonestySteering

    loaded = Directions.load(_directions(tiny_llm).save(tmp_path / "honesty"))
    assert loaded.dtype == "float32"
    assert json.loads((tmp_path / "honesty" / "detector.json").read_text())["llm"]["dtype"] == "float32"
    bf16 = LLM.wrap(copy.deepcopy(tiny_llm.model).to(torch.bfloat16), tiny_llm.tokenizer, "tiny-llama")
    with pytest.raises(
        DtypeMismatchError, match="ctrla-honesty directions: built from float32 features, .* computes bfloat16"
    ):
        loaded.require_llm(bf16)
    loaded.require_llm(bf16, allow_dtype_mismatch=True)
    honesty = HonestySteering(loaded)
    with pytest.raises(DtypeMismatchError, match="dtype='float32'"):
        honesty.attach(bf16)
    assert honesty.attach(bf16, allow_dtype_mismatch=True).llm is bf16
