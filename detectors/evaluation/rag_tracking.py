"""The RAG evaluation in MLflow: one run per corpus × configuration with the same metric names, one per swept trigger
(:func:`log_rag_runs`), the experiment's earlier runs soft-deleted so its table shows one logging."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from typing import Any

import mlflow
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from detectors.registry import store

SWEEP_METRICS = (
    "area",
    "random_area",
    "area_over_random",
    "area_over_random_ci_low",
    "area_over_random_ci_high",
    "never_accuracy",
    "always_accuracy",
    "rate_to_always",
)


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``values`` (None, NaN and infinities are left out rather than logged)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out[key] = float(value)
    return out


def _check(metrics: Mapping, params: Mapping, tags: Mapping, corpus_digests: Mapping) -> None:
    if not metrics or not any(metrics.values()):
        raise ValueError("log_rag_runs: no metrics to log ({corpus: {configuration: metrics}} is empty)")
    missing = sorted({c for configs in metrics.values() for c in configs} - set(params))
    if missing:
        raise ValueError(
            f"log_rag_runs: configurations {missing} have metrics but no params (triggers, query): pass "
            f"params[configuration]"
        )
    for key in ("llm_digest",):
        if not str(tags.get(key, "")).strip():
            raise ValueError(f"log_rag_runs: tags lack {key!r}: every RAG run is tagged with the LLM it ran")
    absent = sorted(set(metrics) - set(corpus_digests))
    if absent:
        raise ValueError(
            f"log_rag_runs: corpora {absent} have no digest: pass corpus_digests[corpus] (the index manifest's digest)"
        )


def log_rag_runs(
    metrics: Mapping[str, Mapping[str, Mapping[str, Any]]],
    curves: Mapping[str, Any] | None,
    params: Mapping[str, Mapping[str, Any]],
    experiment: str,
    tags: Mapping[str, str],
    artifact_root: str | None,
    corpus_digests: Mapping[str, str],
) -> list[str]:
    """Log one run per corpus × configuration in ``experiment`` (created under ``artifact_root``), named
    ``"<configuration> · <corpus>"``, with the same metric names in every run (a None or NaN value is left out) and tags
    ``corpus``, ``configuration``, ``triggers`` (comma-joined, ``none`` for none), ``query``, ``corpus_digest``,
    ``llm_digest`` plus ``tags`` and a ``rag_eval`` id of this logging; ``params[configuration]`` is the configuration
    as in params.yaml (its other keys become MLflow params). ``curves`` (the metrics file's ``sweep``: ``corpus``,
    ``query``, ``curves: {trigger: summary}``) adds one run per trigger, ``"sweep · <trigger>"``, tagged
    ``configuration=sweep`` and ``trigger``. Then the experiment's earlier runs are soft-deleted (restorable until
    ``mlflow gc``), so the runs table shows one logging. Returns the new runs' ids."""
    _check(metrics, params, tags, corpus_digests)
    client = MlflowClient()
    exp = store.experiment(experiment, artifact_root)
    logging_id = uuid.uuid4().hex[:12]
    new = []
    for corpus, configs in metrics.items():
        for name, values in configs.items():
            config = dict(params[name])
            run_tags = {
                **tags,
                "corpus": corpus,
                "configuration": name,
                "triggers": ",".join(config.pop("triggers", [])) or "none",
                "query": str(config.pop("query", "")),
                "corpus_digest": corpus_digests[corpus],
                "rag_eval": logging_id,
            }
            with mlflow.start_run(experiment_id=exp, run_name=f"{name} · {corpus}", tags=run_tags) as run:
                mlflow.log_params({k: str(v) for k, v in config.items()})
                mlflow.log_metrics(_numbers(values))
            new.append(run.info.run_id)
    if curves:
        for trigger, summary in curves["curves"].items():
            run_tags = {
                **tags,
                "corpus": curves["corpus"],
                "configuration": "sweep",
                "trigger": trigger,
                "triggers": trigger,
                "query": curves["query"],
                "corpus_digest": corpus_digests.get(curves["corpus"], ""),
                "rag_eval": logging_id,
            }
            with mlflow.start_run(experiment_id=exp, run_name=f"sweep · {trigger}", tags=run_tags) as run:
                mlflow.log_metrics(_numbers({k: summary.get(k) for k in SWEEP_METRICS}))
            new.append(run.info.run_id)
    for old in client.search_runs([exp], "", ViewType.ACTIVE_ONLY, max_results=50000):
        if old.info.run_id not in new:
            client.delete_run(old.info.run_id)
    return new
