"""The headline ``dvc metrics`` (a row of a few numbers per dataset x level and per corpus, one file each, beside the
detailed reports) on hand-made detailed reports, and dvc.yaml's declarations: only the headlines as metrics, every
other report a plain out, only images as plots."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import yaml
from conftest import ROOT

from detectors.evaluation.compare import COLUMNS
from detectors.evaluation.rag_report import headline as rag_headline
from detectors.evaluation.report import directions_headline, headline, nested_metrics, write_headline

# one class in the test split: no AUROC
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
    ),
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


COLUMNS_SHOWN = {"dior", "dior_name", "baseline", "baseline_name", "always", "never"}  # every headline row's keys


def test_evaluate_headline_gives_the_best_detectors_and_the_best_baselines_test_auroc_per_dataset_and_level():
    table = long_table()
    out = headline(table)
    assert out == {
        "early_question": {
            "dior": 0.7339,
            "dior_name": "dior-early",  # gru[hidden] has no AUROC (NaN): not the best
            "baseline": 0.7013,
            "baseline_name": "first_token_prob",
        },
        "realtime_token": {"dior": 0.8, "dior_name": "mlp", "baseline": 0.75, "baseline_name": "flare"},
        "realtime_continuation": {
            "dior": 0.6444,
            "dior_name": "mlp[served]",
            "baseline": 0.69,
            "baseline_name": "token_entropy",
        },
    }
    # levels in order, not the table's
    assert list(out) == [
        "early_question",
        "realtime_token",
        "realtime_continuation",
    ]
    # the same numbers as the detailed report of each dataset
    detailed = nested_metrics(table, "realtime")
    assert out["realtime_continuation"]["baseline"] == round(detailed["continuation"]["token_entropy"]["auroc"], 4)
    assert all(set(row) <= COLUMNS_SHOWN for row in out.values())  # the columns every headline row shares


def test_a_level_without_a_scored_detector_has_only_its_baseline_and_a_level_with_nothing_no_row():
    table = long_table()
    table.loc[table["scorer"] == "dior-early", "auroc"] = math.nan
    rows = headline(table[table["level"] != "token"])
    assert rows["early_question"] == {"baseline": 0.7013, "baseline_name": "first_token_prob"}
    assert headline(table[table["kind"] == "baseline"]) == {}  # no detector, no paired difference: nothing to show


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


def test_rag_headline_gives_per_corpus_the_best_dior_and_other_configurations_accuracy_and_the_references():
    configs = {
        **RAG["wiki"],
        "dior": {"accuracy": 0.31},
        "dior-early": {"accuracy": 0.35},
        "retrorag": {"accuracy": 0.33333333},  # ties with flare: the first in the report's order wins
    }
    refs = {"never": "no-retrieval", "always": "single-round"}
    out = rag_headline({"wiki": configs, "facts": RAG["facts"]}, refs, ["dior", "dior-early", "dior-realtime"])
    assert out == {
        "wiki": {
            "dior": 0.35,
            "dior_name": "dior-early",
            "baseline": 0.3333,
            "baseline_name": "flare",
            "always": 0.3,
            "never": 0.2,
        },
        "facts": {"baseline": 0.9, "baseline_name": "flare"},  # no DioR row, no references: left out
    }
    assert all(set(row) <= COLUMNS_SHOWN for row in out.values())  # the columns evaluate's rows have too
    nan = {"wiki": {"flare": {"accuracy": float("nan")}, "single-round": {"accuracy": 0.3}}}
    assert rag_headline(nan, refs, ["dior"]) == {"wiki": {"always": 0.3}}  # a missing accuracy: left out, not NaN


def test_headline_rows_are_written_one_file_each_and_a_row_gone_from_the_results_is_removed(tmp_path):
    write_headline(tmp_path / "rag", {"wiki": {"dior": 0.5}, "facts": {"dior": 0.9}})
    (tmp_path / "rag" / "notes.txt").write_text("kept")
    write_headline(tmp_path / "rag", {"wiki": {"dior": 0.6}})
    assert sorted(p.name for p in (tmp_path / "rag").iterdir()) == ["notes.txt", "wiki.json"]
    assert json.loads((tmp_path / "rag" / "wiki.json").read_text()) == {"dior": 0.6}
    write_headline(tmp_path / "empty", {})
    assert (tmp_path / "empty").is_dir()  # the declared output exists even with no row


# ---- dvc.yaml -------------------------------------------------------------------------------------------------------


def declared(kind: str) -> dict[str, list[str]]:
    """Per stage, the paths of its ``kind`` entries (outs, metrics, plots) with ``${paths.*}`` resolved from
    params.yaml."""
    paths = yaml.safe_load((ROOT / "params.yaml").read_text())["paths"]
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]

    def resolve(entry) -> str:
        return re.sub(
            r"\$\{paths\.(\w+)\}", lambda m: paths[m.group(1)], next(iter(entry)) if isinstance(entry, dict) else entry
        )

    return {name: [resolve(e) for e in stage.get(kind, [])] for name, stage in stages.items()}


def test_only_the_headlines_are_metrics_and_every_other_report_a_plain_out_kept_in_the_workspace():
    """``dvc metrics show`` joins every metrics file's keys into one table: only the two headline directories are
    metrics, so it is one screen (a line per dataset x level and per corpus); every other report is an out."""
    paths = yaml.safe_load((ROOT / "params.yaml").read_text())["paths"]
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    metrics, outs = declared("metrics"), declared("outs")
    assert {stage: entries for stage, entries in metrics.items() if entries} == {
        "evaluate": [paths["evaluate_headline"]],
        "rag_eval": [paths["rag_headline"]],
    }
    reports = [
        "qa_report",
        "early_report",
        "train_early_metrics",
        "articles_report",
        "realtime_report",
        "train_realtime_metrics",
        "score_baselines_metrics",
        "evaluate_early_metrics",
        "evaluate_realtime_metrics",
        "served_metrics",
        "utility_report",
        "train_utility_metrics",
        "extract_directions_metrics",
        "evaluate_directions_metrics",
        "evaluate_directions_headline",
        "index_report",
        "rag_metrics",
    ]
    for key in reports:
        stage = next(name for name, entries in outs.items() if paths[key] in entries)
        entry = next(e for e in stages[stage]["outs"] if isinstance(e, dict) and "${paths." + key + "}" in e)
        # stays in the workspace, as the metric did
        assert entry["${paths." + key + "}"] == {"cache": False}, (
            stage,
            key,
        )


def test_every_plot_is_an_image_so_dvc_plots_show_needs_no_javascript_renderer():
    plots = {stage: entries for stage, entries in declared("plots").items() if entries}
    assert set(plots) == {"evaluate", "evaluate_directions", "rag_eval"}
    for stage, entries in plots.items():
        for path in entries:
            assert path.endswith(".png") or path.endswith("/figures"), (
                f"{stage} declares {path} as a plot: only PNGs (a directory of them) render offline"
            )
    assert not any(p.endswith(".csv") for entries in declared("metrics").values() for p in entries)
