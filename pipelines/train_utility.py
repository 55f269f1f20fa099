"""Stage train_utility: the retrieval-utility trigger of each corpus (Lightning, GPU when present).

For each corpus of ``build_utility.corpora``, :func:`~detectors.utility.training.train_utility_detector` trains the
retrieval decision (P(helps)) and the post-retrieval gate on the train split of the labels, with every operating
point chosen on validation, and writes ``paths.utility_model/<corpus>/``. ``paths.train_utility_metrics`` holds per
corpus the thresholds, the training summaries and what the test split says: the AUROC of P(helps) for ``helps`` and
its paired difference with the first-token probability's (the signal left after the LLM's confidence) and the
spread of the single seeds' AUROC (each net of the seed ensemble alone), the gate's
AUROC for ``helps`` against ``hurts``, the same AUROC and difference for the trained early detectors (they learnt
"the unaided answer is wrong", not "retrieval fixes it"), and the test accuracy and retrieval rate at each operating
point.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from detectors.dior.early_detector import load_early_detectors
from detectors.evaluation.bootstrap import bootstrap_auroc, paired_bootstrap_delta
from detectors.evaluation.metrics import auroc
from detectors.io import write_json
from detectors.llm.loading import prepared_reference
from detectors.training import reported
from detectors.utility.detector import UtilityDetector
from detectors.utility.labels import HELPS, as_post
from detectors.utility.training import joined, train_utility_detector
from pipelines._stage import run, stage_params
from pipelines._swap import swapped_in

log = logging.getLogger("train_utility")
READS = (
    "build_early.features",
    "build_utility.corpora",
    "train_utility",
    "rag_eval.k",
    "evaluate.bootstrap",
    "evaluate.seed",
    "paths.llm",
    "paths.early",
    "paths.early_model",
    "paths.utility",
    "paths.utility_model",
    "paths.train_utility_metrics",
)
DEPS = (
    "${paths.early}",
    "${paths.early_model}",
    "${paths.utility}",
    "${paths.llm}/llm.json",
)
OUTS = (
    "${paths.utility_model}",
    ("${paths.train_utility_metrics}", {"cache": False}),
)


def helps_auroc(scores: np.ndarray, helps: np.ndarray, confidence: np.ndarray, n: int, seed: int) -> dict:
    """AUROC of ``scores`` for ``helps`` and its paired difference with the first-token probability's."""
    delta, low, high = paired_bootstrap_delta(helps, scores, confidence, n=n, seed=seed)
    return {
        "auroc": auroc(helps, scores),
        "auroc_ci": list(bootstrap_auroc(helps, scores, n=n, seed=seed)),
        "auroc_minus_first_token": delta,
        "auroc_minus_first_token_ci": [low, high],
    }


def test_report(detector: UtilityDetector, early: dict, test: pd.DataFrame, n: int, seed: int) -> dict:
    """What the test split says of a trained utility trigger, and of the trained early detectors ``early`` (by name)
    as detectors of ``helps`` (nothing here chooses anything)."""
    rows = test.to_dict("records")
    helps = (test["utility"] == HELPS).to_numpy().astype(int)
    pre = detector.predict_proba(rows)
    gate = detector.gate_proba(rows, [as_post(r) for r in rows])
    confidence = -test["first_token_prob"].to_numpy()  # low first-token probability: retrieve
    without, with_ = test["correct_without"].to_numpy(bool), test["correct_with"].to_numpy(bool)
    changed = without != with_

    def at(retrieve: np.ndarray, keep: np.ndarray | None = None) -> dict:
        used = retrieve if keep is None else retrieve & keep
        return {"accuracy": float(np.where(used, with_, without).mean()), "retrieval_rate": float(retrieve.mean())}

    singles = [auroc(helps, d.predict_proba(rows)) for d in detector.per_seed()]  # each seed's net alone
    return {
        "n": len(test),
        "helps_rate": float(helps.mean()),
        **helps_auroc(pre, helps, confidence, n, seed),
        "seed_auroc": singles,
        "seed_auroc_min": min(singles, default=None),
        "seed_auroc_max": max(singles, default=None),
        "seed_auroc_sd": float(np.std(singles, ddof=1)) if len(singles) > 1 else None,
        "first_token_auroc": auroc(helps, confidence),
        "early_detectors": {
            name: helps_auroc(d.predict_proba(rows), helps, confidence, n, seed) for name, d in early.items()
        },
        "gate_auroc": auroc(helps[changed], gate[changed])
        if len(set(helps[changed])) == 2
        else float("nan"),  # helps vs hurts
        "never": at(np.zeros(len(test), bool)),
        "always": at(np.ones(len(test), bool)),
        "at_threshold": at(pre >= detector.threshold),
        "at_budget": at(pre >= detector.budget_threshold),
        "at_threshold_gated": at(pre >= detector.threshold, gate >= detector.gate_threshold),
        "always_gated": at(np.ones(len(test), bool), gate >= detector.gate_threshold),
        "oracle": at(helps.astype(bool)),
    }


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "train_utility")
    train, features = params["train_utility"], params["build_early.features"]
    fingerprint, llm_ref = prepared_reference(params["paths.llm"])
    labels, early = pd.read_parquet(params["paths.utility"]), pd.read_parquet(params["paths.early"])
    early_detectors = {
        name: d for name, d in load_early_detectors(params["paths.early_model"]).items() if not name.startswith("gru[")
    }
    metrics = {}
    with swapped_in(params["paths.utility_model"]) as partial:
        for corpus in params["build_utility.corpora"]:
            rows = joined(labels[labels["corpus"] == corpus].drop(columns=["corpus"]), early)  # its labelled rows only
            detector = train_utility_detector(
                rows,
                corpus,
                train.pre_features,
                train.training,
                train.budget,
                params["rag_eval.k"],
                features,
                fingerprint,
                llm_ref,
                name=f"utility-{corpus}",
            )
            detector.save(partial / corpus)
            test = test_report(
                detector,
                early_detectors,
                rows[rows["split"] == "test"],
                params["evaluate.bootstrap"],
                params["evaluate.seed"],
            )
            metrics[corpus] = {
                "threshold": detector.threshold,
                "budget_threshold": detector.budget_threshold,
                "gate_threshold": detector.gate_threshold,
                **reported(detector.info),
                "test": test,
            }
            log.info("%s: %s", corpus, metrics[corpus])
    write_json(params["paths.train_utility_metrics"], metrics)


if __name__ == "__main__":
    run(main)
