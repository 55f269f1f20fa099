"""The headline ``dvc metrics`` (a few flat keys each stage writes beside its detailed report) on hand-made detailed reports,
and dvc.yaml's declarations: headlines as metrics, detailed reports as plain outs, only images as plots."""

from __future__ import annotations

import math
import re

import pandas as pd
import yaml
from conftest import ROOT

from detectors.evaluation.compare import COLUMNS
from detectors.evaluation.rag_report import headline as rag_headline
from detectors.evaluation.report import directions_headline, headline, nested_metrics

ROWS = [  # scorer, kind, dataset, level, auroc, delta_vs
    ("first_token_prob", "baseline", "early", "question", 0.70126, None),
    ("dior-early", "detector", "early", "question", 0.73391, "first_token_prob"),
    ("attribution_entropy", "baseline", "early", "question", 0.58, None),
    (
        "gru[hidden]",
        "detector",
        "early",
        "question",
        math.nan,
        "first_token_prob",
    ),  # one class in the test split: no AUROC
    ("sit_min", "baseline", "realtime", "continuation", 0.66, None),
    ("mlp", "detector", "realtime", "continuation", 0.61, "token_entropy"),
    ("mlp[served]", "detector", "realtime", "continuation", 0.64444, "token_entropy"),
    ("token_entropy", "baseline", "realtime", "continuation", 0.69, None),
    ("mlp", "detector", "realtime", "token", 0.8, "flare"),
    ("flare", "baseline", "realtime", "token", 0.75, None),
]


def long_table() -> pd.DataFrame:
    """A comparison's long table (:data:`~detectors.evaluation.compare.COLUMNS`), rows in no particular level order."""
    rows = [
        {
            "scorer": s,
            "kind": k,
            "dataset": d,
            "level": lv,
            "features": "",
            "auroc": a,
            "auroc_ci_low": a - 0.05,
            "auroc_ci_high": a + 0.05,
            "auprc": 0.5,
            "accuracy": 0.6,
            "f1": 0.5,
            "ece": 0.1,
            "threshold": 0.5,
            "trigger_rate": 0.4,
            "n": 100,
            "positive_rate": 0.4,
            "delta_auroc": None if vs is None else a - 0.7,
            "delta_ci_low": None,
            "delta_ci_high": None,
            "delta_vs": vs,
        }
        for s, k, d, lv, a, vs in ROWS
    ]
    return pd.DataFrame(rows).reindex(columns=list(COLUMNS))


def test_evaluate_headline_gives_each_detectors_and_the_best_baselines_test_auroc_per_dataset_and_level():
    table = long_table()
    out = headline(table)
    assert out == {
        "early_question.test_auroc.dior-early": 0.7339,
        "early_question.test_auroc.best_baseline": 0.7013,
        "early_question.best_baseline": "first_token_prob",
        "realtime_token.test_auroc.mlp": 0.8,
        "realtime_token.test_auroc.best_baseline": 0.75,
        "realtime_token.best_baseline": "flare",
        "realtime_continuation.test_auroc.mlp": 0.61,
        "realtime_continuation.test_auroc.mlp[served]": 0.6444,
        "realtime_continuation.test_auroc.best_baseline": 0.69,
        "realtime_continuation.best_baseline": "token_entropy",
    }
    assert list(out)[:3] == [
        "early_question.test_auroc.dior-early",
        "early_question.test_auroc.best_baseline",
        "early_question.best_baseline",
    ]
    assert list(out)[3].startswith("realtime_token.")  # levels in their order, not the table's
    # the same numbers as the detailed report of each dataset
    detailed = nested_metrics(table, "realtime")
    assert out["realtime_continuation.test_auroc.best_baseline"] == round(
        detailed["continuation"]["token_entropy"]["auroc"], 4
    )
    assert all(isinstance(v, (float, str)) for v in out.values())  # flat scalars: one dvc column each


DIRECTIONS = {  # the shape of evaluate_directions' detailed report, cut down
    "honesty": {
        "n_heldout": 32,
        "auroc_per_layer": [0.6, 0.62, 0.9],
        "ranges": {
            "paper": {"layers": [1, 2], "val_auroc": 0.5, "test_auroc": 0.61234},
            "validation": {"layers": [3], "val_auroc": 0.8, "test_auroc": 0.9},
        },
    },
    "confidence_early": {
        "n": 48,
        "ranges": {
            "paper": {"layers": [1, 2], "test_auroc": 0.55, "test_trigger_rate": 0.8},
            "validation": {"layers": [1], "test_auroc": 0.58, "test_trigger_rate": 0.7},
        },
    },
    "confidence_realtime": {"n": 21, "ranges": {"paper": {"layers": [1, 2], "test_token_trigger_rate": 0.7}}},
    "truthfulqa": {"n": 100, "accuracy": {"0.0": 0.25, "0.02": 0.31, "0.01": 0.31, "0.05": 0.2}, "relative": True},
    "seconds": {"honesty": 1.0},
}


def test_directions_headline_gives_the_test_aurocs_of_each_range_and_truthfulqa_without_and_with_the_best_steering():
    assert directions_headline(DIRECTIONS) == {
        "honesty.test_auroc.paper": 0.6123,
        "honesty.test_auroc.validation": 0.9,
        "confidence.test_auroc.paper": 0.55,
        "confidence.test_auroc.validation": 0.58,
        "truthfulqa.accuracy.lambda_0": 0.25,
        "truthfulqa.accuracy.best_lambda": 0.31,
        "truthfulqa.best_lambda": 0.01,  # the smaller of a tie
    }
    unsteered = {**DIRECTIONS, "truthfulqa": {"n": 100, "accuracy": {"0.05": 0.2, "0.02": 0.22}}}
    out = directions_headline(unsteered)
    assert "truthfulqa.accuracy.lambda_0" not in out and (
        out["truthfulqa.best_lambda"],
        out["truthfulqa.accuracy.best_lambda"],
    ) == (0.02, 0.22)
    assert directions_headline({"seconds": {}}) == {}  # a report without those sections: nothing to show


RAG = {  # the shape of rag_eval's detailed report, cut down
    "wiki": {
        "no-retrieval": {
            "em": 0.1,
            "accuracy": 0.2,
            "retrievals_per_question": 0.0,
            "n": 10,
            "accuracy_vs_never": 0.0,
            "accuracy_vs_always": -0.1,
        },
        "single-round": {
            "em": 0.2,
            "accuracy": 0.3,
            "retrievals_per_question": 1.0,
            "n": 10,
            "accuracy_vs_always": 0.0,
        },
        "flare": {
            "em": 0.2,
            "accuracy": 0.33333333,
            "retrievals_per_question": 0.66667,
            "n": 10,
            "accuracy_vs_always": 0.03333,
            "accuracy_vs_always_ci_low": -0.1,
            "answer_recall_at_k": None,
        },
    },
    "facts": {"flare": {"accuracy": 0.9, "retrievals_per_question": 0.5, "accuracy_vs_always": float("nan")}},
    "sweep": {
        "corpus": "facts",
        "query": "question",
        "curves": {
            "flare": {"area": 0.8, "random_area": 0.7, "area_over_random": 0.1000001},
            "dior-early": {"area": 0.7, "random_area": 0.7, "area_over_random": -0.02},
        },
    },
    "thresholds": {"wiki": {"flare": 0.4}},
    "digests": {"llm": "abc", "corpora": {"wiki": "d1"}},
}


def test_rag_headline_gives_accuracy_retrievals_and_the_difference_to_always_per_corpus_and_configuration_and_each_curves_area():
    out = rag_headline({c: RAG[c] for c in ("wiki", "facts")}, RAG["sweep"])
    assert out == {
        "wiki.no-retrieval.accuracy": 0.2,
        "wiki.no-retrieval.retrievals_per_question": 0.0,
        "wiki.no-retrieval.accuracy_vs_always": -0.1,
        "wiki.single-round.accuracy": 0.3,
        "wiki.single-round.retrievals_per_question": 1.0,
        "wiki.single-round.accuracy_vs_always": 0.0,
        "wiki.flare.accuracy": 0.3333,
        "wiki.flare.retrievals_per_question": 0.6667,
        "wiki.flare.accuracy_vs_always": 0.0333,
        "facts.flare.accuracy": 0.9,
        "facts.flare.retrievals_per_question": 0.5,  # no difference to always: left out, not NaN
        "sweep.flare.area_over_random": 0.1,
        "sweep.dior-early.area_over_random": -0.02,
    }
    assert rag_headline({"wiki": RAG["wiki"]}, None) == {k: v for k, v in out.items() if k.startswith("wiki.")}


# ---- dvc.yaml -------------------------------------------------------------------------------------------------------


def declared(kind: str) -> dict[str, list[str]]:
    """Per stage, the paths of its ``kind`` entries (outs, metrics, plots) with ``${paths.*}`` resolved from params.yaml."""
    paths = yaml.safe_load((ROOT / "params.yaml").read_text())["paths"]
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]

    def resolve(entry) -> str:
        return re.sub(
            r"\$\{paths\.(\w+)\}", lambda m: paths[m.group(1)], next(iter(entry)) if isinstance(entry, dict) else entry
        )

    return {name: [resolve(e) for e in stage.get(kind, [])] for name, stage in stages.items()}


def test_headlines_are_the_metrics_and_the_detailed_reports_plain_outs():
    paths = yaml.safe_load((ROOT / "params.yaml").read_text())["paths"]
    metrics, outs = declared("metrics"), declared("outs")
    for stage, headline_key, detailed in [
        ("evaluate", "evaluate_headline", ["evaluate_early_metrics", "evaluate_realtime_metrics"]),
        ("evaluate_directions", "evaluate_directions_headline", ["evaluate_directions_metrics"]),
        ("rag_eval", "rag_headline", ["rag_metrics"]),
    ]:
        assert paths[headline_key] in metrics[stage]
        for key in detailed:
            assert paths[key] in outs[stage] and paths[key] not in metrics[stage], (stage, key)


def test_every_plot_is_an_image_so_dvc_plots_show_needs_no_javascript_renderer():
    plots = {stage: entries for stage, entries in declared("plots").items() if entries}
    assert set(plots) == {"evaluate", "evaluate_directions", "rag_eval"}
    for stage, entries in plots.items():
        for path in entries:
            assert path.endswith(".png") or path.endswith("/figures"), (
                f"{stage} declares {path} as a plot: only PNGs (a directory of them) render offline"
            )
    assert not any(p.endswith(".csv") for entries in declared("metrics").values() for p in entries)
