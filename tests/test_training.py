"""Training the early detector on synthetic feature rows: learning, determinism, refusal, artifact, seeds and the
seed ensemble, the prevalence threshold."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from conftest import FP, synthetic_rows, train
from conftest import TRAINING as PARAMS

from detectors.config.schema import EarlyFeatureParams
from detectors.dior.early_detector import PAPER_THRESHOLD, EarlyDetector, load_early_detectors, train_early_detector
from detectors.ensemble import SeedEnsemble
from detectors.ensemble import members as members_of
from detectors.evaluation.metrics import OneClassError, auroc, choose_threshold
from detectors.registry import store
from detectors.registry.artifact import seal
from detectors.training import fit

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)


def test_gru_learns_attribution_shape_and_threshold_comes_from_validation():
    frame = synthetic_rows(240)
    det = train(frame, ["attribution"])
    test = frame[frame["split"] == "test"]
    assert auroc(test["label"], det.predict_proba(test.to_dict("records"))) > 0.85
    assert det.info["n_val"] == (frame["split"] == "val").sum()
    val = frame[frame["split"] == "val"]
    p, y = det.predict_proba(val.to_dict("records")), val["label"].to_numpy()
    youden = lambda t: ((p >= t) & (y == 1)).sum() / (y == 1).sum() - ((p >= t) & (y == 0)).sum() / (y == 0).sum()  # noqa: E731
    assert det.threshold in p and youden(det.threshold) == max(youden(t) for t in p)  # the best Youden J on validation
    # DioR's Eq. 2 rule (retrieve when the output exceeds 0.5) is recorded beside the validation threshold, with both
    # trigger rates
    assert det.info["paper_threshold"] == PAPER_THRESHOLD == 0.5
    assert det.info["val_trigger_rate"] == pytest.approx(np.mean(p >= det.threshold))
    assert det.info["val_trigger_rate_at_paper_threshold"] == pytest.approx(np.mean(p > 0.5))


def test_training_is_deterministic():
    frame = synthetic_rows(90)
    a, b = train(frame, ["attribution", "hidden"]), train(frame, ["attribution", "hidden"])
    for (name, x), (_, y) in zip(a.net.state_dict().items(), b.net.state_dict().items()):
        assert torch.equal(x, y), name


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, batch):
        raise RuntimeError("broken net")


@pytest.mark.parametrize("before", [False, True])
def test_training_leaves_the_process_torch_flags_as_they_were(before, monkeypatch):
    """Deterministic algorithms are on while training only; the process's setting is back afterwards, also after an
    error."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(before)
    try:
        frame = synthetic_rows(30)
        train(frame, ["entropy"], dataclasses.replace(PARAMS, max_epochs=2))
        assert torch.are_deterministic_algorithms_enabled() is before and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        items = [{"label": torch.tensor(i % 2)} for i in range(8)]
        collate = lambda rows: {"label": torch.stack([r["label"] for r in rows])}  # noqa: E731
        with pytest.raises(RuntimeError, match="broken net"):
            fit(Broken, items, items, collate, PARAMS)
        assert torch.are_deterministic_algorithms_enabled() is before and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    finally:
        torch.use_deterministic_algorithms(False)


def test_one_class_split_is_refused():
    frame = synthetic_rows(60)
    frame.loc[frame["split"] == "train", "label"] = 1
    with pytest.raises(OneClassError, match="the train split has only one class"):
        train(frame, ["entropy"])


def test_artifact_round_trip_gives_identical_scores(tmp_path):
    frame = synthetic_rows(60)
    det = train(
        frame,
        ["attribution", "entropy", "first_token", "hidden"],
        dataclasses.replace(PARAMS, max_epochs=3),
        "dior-early-extended",
    )
    loaded = EarlyDetector.load(det.save(tmp_path / "det"))
    rows = frame.to_dict("records")
    np.testing.assert_array_equal(det.predict_proba(rows), loaded.predict_proba(rows))
    assert (loaded.threshold, loaded.groups, loaded.fingerprint) == (det.threshold, det.groups, det.fingerprint)
    assert loaded.name == det.name == "dior-early-extended" and loaded.KIND == "dior-early"
    assert not list(tmp_path.glob("det/*.pkl")) and (tmp_path / "det" / "weights.safetensors").exists()


def test_fast_dev_run_smoke():
    det = train_early_detector(
        synthetic_rows(30), ["attribution"], PARAMS, EarlyFeatureParams(), FP, {}, fast_dev_run=True
    )
    assert det.info["n_train"] == 10


def test_the_artifact_records_the_sets_feature_dtype(tmp_path):
    det = train(synthetic_rows(30), ["entropy"], dataclasses.replace(PARAMS, max_epochs=1))
    assert det.feature_dtype == "float32" and det.llm_ref == {"source": "synthetic", "dtype": "float32"}
    det.save(tmp_path / "det")
    assert json.loads((tmp_path / "det" / "detector.json").read_text())["llm"]["dtype"] == "float32"
    assert EarlyDetector.load(tmp_path / "det").feature_dtype == "float32"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: f.drop(columns="feature_dtype"), "has no feature_dtype column: it was built before"),
        (lambda f: f.assign(feature_dtype=["float32", "bfloat16"] * 15), r"values \{'float32': 15, 'bfloat16': 15\}"),
        (
            lambda f: f.assign(feature_dtype=[None] + ["float32"] * 29),
            r"has feature_dtype values \{'float32': 29, None: 1\}",
        ),
        (lambda f: f.assign(feature_dtype="fp32"), "has feature_dtype = 'fp32', not a torch dtype"),
    ],
)
def test_a_set_without_exactly_one_feature_dtype_is_refused(change, message):
    with pytest.raises(ValueError, match=f"the early-detection set .*{message}.*rebuild"):
        train(change(synthetic_rows(30)), ["entropy"])


def test_every_trained_early_detector_loads_by_its_directory_name(tmp_path):
    frame, params = synthetic_rows(30), dataclasses.replace(PARAMS, max_epochs=1)
    with pytest.raises(FileNotFoundError, match="holds no trained early detector"):
        load_early_detectors(tmp_path / "early")
    for name, groups in {"dior-early": ["attribution", "entropy"], "gru[hidden]": ["hidden"]}.items():
        train(frame, groups, params, name).save(tmp_path / "early" / name)
    loaded = load_early_detectors(tmp_path / "early")
    assert list(loaded) == ["dior-early", "gru[hidden]"]
    assert (loaded["dior-early"].groups, loaded["gru[hidden]"].groups) == (["attribution", "entropy"], ["hidden"])
    train(frame, ["entropy"], params, "dior-early-extended").save(tmp_path / "early" / "moved")
    with pytest.raises(ValueError, match=r"early/moved holds early detector 'dior-early-extended', not 'moved'"):
        load_early_detectors(tmp_path / "early")


def test_an_artifact_written_before_names_loads_as_dior_early(tmp_path):
    """Registered versions from before the early detectors had names were all ``dior-early``."""
    directory = train(synthetic_rows(30), ["entropy"], dataclasses.replace(PARAMS, max_epochs=1), "x").save(
        tmp_path / "det"
    )
    config = json.loads((directory / "detector.json").read_text())
    del config["name"]
    (directory / "detector.json").write_text(json.dumps(config))
    seal(directory)  # its files' digests, as its writer records them
    assert EarlyDetector.load(directory).name == "dior-early"


def test_register_digests_the_validation_records_the_trainer_validates_on(tmp_path):
    """The register stage digests the validation records the detector kept (the registry compares versions by that
    digest): the records train_early_detector early-stops and chooses its threshold on, the ok val records, failed
    ones left out."""
    from pipelines.register import validation_digest

    frame = synthetic_rows(240)
    failed = frame.index[frame["split"] == "val"][:7]
    frame.loc[failed, "status"] = "failed"
    frame.loc[failed, "label"] = 1 - frame.loc[failed, "label"]  # were they used, the threshold would differ
    det = train(frame, ["attribution"])
    ids = det.info["validation"]["ids"]
    val = frame[frame["split"] == "val"]
    assert set(ids) == set(val["id"]) - set(frame.loc[failed, "id"]) and det.info["n_val"] == len(ids)
    assert validation_digest(det.info, tmp_path) == store.validation_digest(set(ids))
    chosen = frame.set_index("id").loc[ids].reset_index()
    p, y = det.predict_proba(chosen.to_dict("records")), chosen["label"].to_numpy()
    youden = lambda t: ((p >= t) & (y == 1)).sum() / (y == 1).sum() - ((p >= t) & (y == 0)).sum() / (y == 0).sum()  # noqa: E731
    assert det.threshold in p and youden(det.threshold) == max(youden(t) for t in p)


# ---- seeds ---------------------------------------------------------------------------------------------------------


class Fixed(torch.nn.Module):
    """A "net" that returns given logits, to check the ensemble's arithmetic."""

    def __init__(self, logits: list[float]):
        super().__init__()
        self.logits = torch.tensor(logits, dtype=torch.float64)
        self.config = {"n": len(logits)}

    def forward(self, batch):
        return self.logits


def test_a_seed_ensembles_probability_is_the_mean_of_its_nets_even_where_one_saturates():
    members = [Fixed([0.0, 60.0, -60.0, 2.0]), Fixed([0.0, -60.0, -70.0, -1.0]), Fixed([0.0, 1.0, -65.0, 0.5])]
    ensemble = SeedEnsemble(members)
    probs = torch.sigmoid(torch.stack([m(None) for m in members]))
    logit = ensemble(None)
    torch.testing.assert_close(torch.sigmoid(logit), probs.mean(0), rtol=1e-12, atol=1e-15)
    assert torch.isfinite(logit).all() and logit[2] < -59  # no log(0): the three probabilities are tiny but not 0
    assert ensemble.config == {"n": 4, "members": 3} and members_of(ensemble) == members
    assert members_of(members[0]) == [members[0]]


def test_seeds_train_one_net_each_and_the_detector_is_their_mean(tmp_path):
    frame = synthetic_rows(120)
    params = dataclasses.replace(PARAMS, seeds=3, seed=5, max_epochs=6)
    det = train(frame, ["attribution", "hidden"], params)
    singles = det.per_seed()
    assert isinstance(det.net, SeedEnsemble) and len(singles) == 3
    assert det.info["seeds"] == [5, 6, 7] and len(det.info["seed_val_auroc"]) == len(det.info["seed_epochs"]) == 3
    rows = frame.to_dict("records")
    mean = np.mean([d.predict_proba(rows) for d in singles], axis=0)
    np.testing.assert_allclose(det.predict_proba(rows), mean, atol=1e-6)
    assert not np.allclose(singles[0].predict_proba(rows), singles[1].predict_proba(rows))  # the seeds differ
    # each seed's net is the one a single-seed training with that seed gives
    alone = train(frame, ["attribution", "hidden"], dataclasses.replace(params, seeds=1, seed=6))
    np.testing.assert_allclose(singles[1].predict_proba(rows), alone.predict_proba(rows), atol=1e-6)
    # the validation AUROC and validation scores recorded are the ensemble's
    val = frame[frame["split"] == "val"]
    p = det.predict_proba(val.to_dict("records"))
    assert det.info["best_val_auroc"] == pytest.approx(auroc(val["label"], p))
    assert det.info["validation"] == {"ids": list(val["id"]), "labels": list(val["label"]), "scores": p.tolist()}
    loaded = EarlyDetector.load(det.save(tmp_path / "det"))  # one artifact, loaded as the same ensemble
    assert isinstance(loaded.net, SeedEnsemble) and len(loaded.per_seed()) == 3
    np.testing.assert_array_equal(loaded.predict_proba(rows), det.predict_proba(rows))
    assert alone.per_seed() == [] and not isinstance(alone.net, SeedEnsemble)


def test_the_prevalence_threshold_fires_on_the_validation_share_of_hallucinated_questions():
    frame = synthetic_rows(240)
    det = train(frame, ["attribution"], dataclasses.replace(PARAMS, threshold="prevalence"))
    val = frame[frame["split"] == "val"]
    p = det.predict_proba(val.to_dict("records"))
    assert det.threshold in p and det.info["threshold_strategy"] == "prevalence"
    share = lambda t: np.mean(p >= t)  # noqa: E731
    assert abs(share(det.threshold) - val["label"].mean()) == min(abs(share(t) - val["label"].mean()) for t in p)
    # tied scores: the share moves in steps, and the nearest step is taken (the higher threshold of equally near)
    assert choose_threshold([0, 1, 0, 1], [0.1, 0.2, 0.2, 0.2], "prevalence") == 0.2
    assert choose_threshold([0, 0, 0, 1], [0.1, 0.2, 0.2, 0.9], "prevalence") == 0.9
    with pytest.raises(ValueError, match="use youden, f1 or prevalence"):
        choose_threshold([0, 1], [0.1, 0.2], "median")
