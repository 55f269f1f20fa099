"""Stage register: log each DioR detector to MLflow, register it, and apply the champion rule.

The early detectors of ``register_early.names`` (``dior-early``: DioR's RNN over IG(Q); ``dior-early-extended``: the
stronger feature set), each from ``paths.early_model/<name>/`` under its own registered name, their results in one JSON
keyed by detector; ``dior-realtime`` (the MLP; its test metrics are the continuation level's); and the retrieval-utility
trigger of each corpus (``utility-<corpus>``; its test metrics are train_utility's). Each version is tagged with the
digest of the validation records its AUROC was computed on (the ok records of the set's val split; for the real-time
detector those of the set it was chosen on, the QA answers with a token or the continuations, as training recorded it in
the detector's ``info``), so only comparable versions compete, and keeps its validation scores (``info["validation"]``):
a version takes the champion alias only when it beats the champion's validation AUROC on the same units by a paired 95 %
bootstrap interval above 0 (:func:`detectors.evaluation.choice.versus`); otherwise it is registered as the challenger.
The run carries the choices training made (the real-time candidate, the utility thresholds) as tags, and the spread of
the single seeds' test AUROC beside the registered detector's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from detectors.config import ParamsError
from detectors.dior.realtime_training import CONTINUATIONS
from detectors.dior.served import SERVED
from detectors.errors import InputError
from detectors.evaluation.choice import choice_tags, versus
from detectors.interfaces import Level
from detectors.io import write_json
from detectors.registry import store
from detectors.registry.artifact import read_config
from detectors.registry.kinds import load_artifact
from detectors.sources.ids import ok_records
from pipelines._stage import run, stage_params

log = logging.getLogger("register")
READS = (
    "build_realtime.hidden_layers",
    "register_early",
    "register_realtime",
    "register_utility",
    "build_utility.corpora",
    "mlflow",
    "paths.early",
    "paths.early_model",
    "paths.realtime_model",
    "paths.utility",
    "paths.utility_model",
    "paths.evaluate_early_metrics",
    "paths.evaluate_realtime_metrics",
    "paths.train_utility_metrics",
    "paths.registry_early",
    "paths.registry_realtime",
    "paths.registry_utility",
)
DEPS = (
    "${paths.early}",
    "${paths.early_model}",
    "${paths.realtime_model}",
    "${paths.evaluate_early_metrics}",
    "${paths.evaluate_realtime_metrics}",
    "${paths.utility}",
    "${paths.utility_model}",
    "${paths.train_utility_metrics}",
)
OUTS = (
    ("${paths.registry_early}", {"cache": False}),
    ("${paths.registry_realtime}", {"cache": False}),
    ("${paths.registry_utility}", {"cache": False}),
)


def early_val_ids(path: str | Path) -> list[str]:
    """Ids of the early set's records the early detectors' validation AUROC is computed on: the val records
    :func:`~detectors.dior.early_detector.train_early_detector` validates on
    (:func:`~detectors.sources.ids.ok_records`)."""
    frame = pd.read_parquet(path, columns=["id", "split", "status"])
    return ok_records(frame, "val")["id"].astype(str).tolist()


def realtime_val_digest(info: dict, artifact_dir: str | Path) -> str:
    """Digest of the records the MLP's served validation AUROC is computed on (the ok val records of the set
    ``train_realtime.choose_on`` chose on), as training recorded it in the detector's ``info``."""
    digest = info.get("val_digest")
    if digest is None:
        raise InputError(
            f"the real-time detector at {artifact_dir} records no digest of its validation records (info.val_digest): "
            f"its {info.get('chosen_on', CONTINUATIONS)} have no ok validation record, "
            "or it was trained by an older version: "
            "check the val split and run `dvc repro train_realtime`"
        )
    return digest


def register_detector(
    artifact_dir: str | Path,
    val_digest: str,
    test: dict,
    name: str,
    alias: str,
    experiment_id: str,
    extra_params: dict,
    features: str | None = None,
    val_key: str = "best_val_auroc",
) -> dict:
    """Log ``artifact_dir`` as a pyfunc, register it as ``name`` and apply the champion rule (the result, logged).

    ``val_digest``: the digest of the validation records the AUROC was computed on (:func:`store.validation_digest`);
    ``features``: the feature set a champion must share to be compared (see :func:`detectors.registry.store.decide`);
    ``val_key``: the artifact's validation AUROC the champion rule compares (the real-time detector's served one: its
    token AUROC is over entity or all tokens, whichever set it was trained on, so not comparable across versions)."""
    detector = load_artifact(artifact_dir)
    info = detector.info
    value = info.get(val_key)
    val_auroc = float("nan") if value is None else float(value)  # no validation score: never the champion
    seeds = info.get("seeds", [info.get("seed")])
    metadata = {"llm": detector.fingerprint.to_dict(), "threshold": detector.threshold, **extra_params}
    run_params = {
        "threshold": detector.threshold,
        "llm": detector.fingerprint.name,
        "seeds": len(seeds),
        **extra_params,
    }
    test_metrics = {f"test_{k}": v for k, v in test.items() if isinstance(v, (int, float))}  # not kind, delta_vs
    seed_val = {f"seed_val_auroc_{s}": v for s, v in zip(seeds, info.get("seed_val_auroc", [])) if v is not None}
    tags = {"seeds": ",".join(map(str, seeds))} | choice_tags("choice.tokens", info.get("choice"))
    for threshold, record in (info.get("choices") or {}).items():
        tags |= choice_tags(f"choice.{threshold}", record)
    result = store.log_and_register(
        detector,
        artifact_dir,
        name,
        alias,
        experiment_id,
        val_auroc,
        val_digest,
        test_metrics | seed_val,
        run_params,
        metadata,
        features,
        info.get("validation"),
        versus,
        tags,
    )
    result["test_auroc"] = test["auroc"]
    log.info("%s", result)
    return result


def early_artifact(model_dir: str | Path, detector: str) -> Path:
    """``paths.early_model/<detector>``, the trained early detector ``register_early.names`` names; missing, a clear
    error."""
    path = Path(model_dir) / detector
    if not (path / "detector.json").exists():
        trained = sorted(d.name for d in Path(model_dir).iterdir() if d.is_dir()) if Path(model_dir).is_dir() else []
        raise ParamsError(
            f"params: register_early.names = {detector!r}: no trained early detector at {path}; "
            f"trained: {trained} (train_early.detectors names them; run `dvc repro train_early`)"
        )
    return path


def early_test_metrics(path: str | Path, scorer: str) -> dict:
    """The evaluate stage's test metrics of ``scorer`` in the early metrics file at ``path``."""
    metrics = json.loads(Path(path).read_text())[Level.QUESTION.value]
    if scorer not in metrics:
        raise InputError(
            f"{path} has no test metrics of {scorer!r} (scorers: {sorted(metrics)}): run `dvc repro evaluate`"
        )
    return metrics[scorer]


def register_early(params, experiment_id: str) -> dict[str, dict]:
    """Every early detector of ``register_early.names`` under its registered name: ``{detector: result}``."""
    early, val_digest = params["register_early"], store.validation_digest(early_val_ids(params["paths.early"]))
    results = {}
    for detector, registered in early.names.items():
        artifact = early_artifact(params["paths.early_model"], detector)
        features = ",".join(read_config(artifact)["groups"])
        test = early_test_metrics(params["paths.evaluate_early_metrics"], detector)
        extra = {"detector": detector, "features": features}
        results[detector] = register_detector(
            artifact, val_digest, test, registered, early.alias, experiment_id, extra, features
        )
    return results


def register_utility(params, experiment_id: str) -> dict[str, dict]:
    """The utility trigger of each corpus as ``<register_utility.name>-<corpus>``, compared by the validation AUROC of
    its retrieval decision on that corpus's val labels: ``{corpus: result}``."""
    utility = params["register_utility"]
    labels = pd.read_parquet(params["paths.utility"], columns=["corpus", "id", "split", "status"])
    tests = json.loads(Path(params["paths.train_utility_metrics"]).read_text())
    results = {}
    for corpus in params["build_utility.corpora"]:
        val = ok_records(labels[labels["corpus"] == corpus], "val")
        artifact = Path(params["paths.utility_model"]) / corpus
        features = ",".join(read_config(artifact)["pre_groups"])
        results[corpus] = register_detector(
            artifact,
            store.validation_digest(val["id"].astype(str).tolist()),
            tests[corpus]["test"],
            f"{utility.name}-{corpus}",
            utility.alias,
            experiment_id,
            {"corpus": corpus, "features": features},
            f"{corpus}: {features}",
        )
    return results


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "register")
    mlflow_params = params["mlflow"]
    store.configure(mlflow_params.tracking_uri)
    for name in params[
        "register_early"
    ].names:  # every artifact and its test metrics exist before anything is registered
        early_artifact(params["paths.early_model"], name)
        early_test_metrics(params["paths.evaluate_early_metrics"], name)
    info = read_config(params["paths.realtime_model"])["info"]
    chosen_on, realtime_digest = (
        info.get("chosen_on", CONTINUATIONS),
        realtime_val_digest(info, params["paths.realtime_model"]),
    )
    exp = store.experiment(params["register_early"].experiment, mlflow_params.artifact_root)
    write_json(params["paths.registry_early"], register_early(params, exp))
    realtime = params["register_realtime"]
    # what is served: the max over every generated token (mlp[served]), compared by its validation AUROC
    realtime_test = json.loads(Path(params["paths.evaluate_realtime_metrics"]).read_text())[Level.CONTINUATION.value][
        SERVED
    ]
    exp = store.experiment(realtime.experiment, mlflow_params.artifact_root)
    layers = ",".join(map(str, params["build_realtime.hidden_layers"]))
    # a champion compared on another number (older versions: token AUROC, or the other set) is not compared: the new one
    # waits as challenger
    result = register_detector(
        params["paths.realtime_model"],
        realtime_digest,
        realtime_test,
        realtime.name,
        realtime.alias,
        exp,
        {"hidden_layers": layers, "chosen_on": chosen_on},
        f"hidden layers {layers}; served validation AUROC on the {chosen_on}",
        val_key="val_served_auroc",
    )
    write_json(params["paths.registry_realtime"], result)
    exp = store.experiment(params["register_utility"].experiment, mlflow_params.artifact_root)
    write_json(params["paths.registry_utility"], register_utility(params, exp))


if __name__ == "__main__":
    run(main)
