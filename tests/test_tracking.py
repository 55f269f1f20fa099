"""The comparison in MLflow (:mod:`detectors.evaluation.tracking`) and its figures (:mod:`detectors.evaluation.plots`)
on a hand-made long table, and the experiment kind that makes the UI open experiments on their runs table
(:func:`detectors.registry.store.experiment`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from mlflow.entities import ViewType  # noqa: E402
from PIL import Image  # noqa: E402

from detectors.evaluation.plots import write_comparison_plots  # noqa: E402
from detectors.evaluation.tracking import log_comparison  # noqa: E402
from detectors.registry import store  # noqa: E402

ROWS = [  # scorer, kind, dataset, level, auroc, delta_auroc, delta_vs
    ("dior-early", "detector", "early", "question", 0.71, 0.05, "first_token_prob"),
    ("first_token_prob", "baseline", "early", "question", 0.66, math.nan, None),
    ("mlp", "detector", "realtime", "token", 0.62, 0.02, "flare"),
    ("flare", "baseline", "realtime", "token", 0.60, math.nan, None),
    ("mlp", "detector", "realtime", "continuation", 0.68, -0.01, "sit_norm"),
    ("sit_norm", "baseline", "realtime", "continuation", 0.69, math.nan, None),
]


def comparison_table() -> pd.DataFrame:
    rows = []
    for scorer, kind, dataset, level, auc, delta, vs in ROWS:
        rows.append(
            {
                "scorer": scorer,
                "kind": kind,
                "dataset": dataset,
                "level": level,
                "features": f"{scorer} features",
                "auroc": auc,
                "auroc_ci_low": auc - 0.05,
                "auroc_ci_high": auc + 0.05,
                "auprc": 0.5,
                "accuracy": 0.6,
                "f1": 0.55,
                "ece": 0.1,
                "threshold": 0.4,
                "trigger_rate": 0.3,
                "n": 120,
                "positive_rate": 0.45,
                "delta_auroc": delta,
                "delta_ci_low": delta - 0.04,
                "delta_ci_high": delta + 0.04,
                "delta_vs": vs,
            }
        )
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    """One sqlite store for the module (creating one costs seconds); each test logs under its own prefix."""
    root = tmp_path_factory.mktemp("tracking")
    store.configure("sqlite:///mlflow/mlflow.db", root)
    return root


@pytest.fixture()
def tracking(store_root, request) -> str:
    """The store pointed to again (other modules reconfigure MLflow), and a prefix of this test's own."""
    store.configure("sqlite:///mlflow/mlflow.db", store_root)
    return f"cmp{abs(hash(request.node.name)) % 10**8}"


@pytest.fixture()
def artifacts(store_root) -> str:
    return str(store_root / "mlflow/artifacts")


@pytest.fixture()
def plots(tmp_path) -> dict:
    paths = {}
    for key in ("early", "early_question", "realtime_token", "realtime_continuation"):
        fig, ax = plt.subplots(figsize=(2, 2))
        ax.plot([0, 1], [0, 1])
        paths[key] = [tmp_path / f"{key}.png"]
        fig.savefig(paths[key][0])
        plt.close(fig)
    return paths


def active_runs(name: str) -> pd.DataFrame:
    return mlflow.search_runs(experiment_names=[name], run_view_type=ViewType.ACTIVE_ONLY)


def test_experiments_are_created_and_marked_as_custom_model_development(tracking, artifacts):
    exp = store.experiment(f"{tracking}-fresh", artifacts)
    assert mlflow.get_experiment(exp).tags[store.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # an experiment an older version created without a kind gets the mark; one a person marked otherwise keeps it
    old = mlflow.create_experiment(f"{tracking}-older", artifact_location=Path(artifacts).as_uri())
    assert store.EXPERIMENT_KIND_TAG not in mlflow.get_experiment(old).tags
    assert store.experiment(f"{tracking}-older", artifacts) == old
    assert mlflow.get_experiment(old).tags[store.EXPERIMENT_KIND_TAG] == "custom_model_development"
    kind = {store.EXPERIMENT_KIND_TAG: "genai_development"}
    mine = mlflow.create_experiment(f"{tracking}-mine", artifact_location=Path(artifacts).as_uri(), tags=kind)
    store.experiment(f"{tracking}-mine", artifacts)
    assert mlflow.get_experiment(mine).tags[store.EXPERIMENT_KIND_TAG] == "genai_development"


def test_one_flat_run_per_row_in_one_experiment_per_dataset(tracking, artifacts, plots):
    table = comparison_table()
    log_comparison(table, plots, {"llm": "tiny-llama", "llm_digest": "abc"}, tracking, artifacts)
    client = mlflow.MlflowClient()
    for dataset in ("early", "realtime"):
        experiment = mlflow.get_experiment_by_name(f"{tracking}-{dataset}")
        assert experiment.tags[store.EXPERIMENT_KIND_TAG] == "custom_model_development"
        assert "test_auroc" in experiment.tags["mlflow.note.content"]
        # the comparison view the UI opens by key
        view = json.loads(experiment.tags["mlflow.sharedViewState.comparison"])
        assert view["orderByKey"] == "metrics.`test_auroc`" and view["orderByAsc"] is False
        assert {"metrics.`test_auroc`", "metrics.`delta_auroc`", "tags.`level`"} <= set(view["selectedColumns"])
        runs = active_runs(f"{tracking}-{dataset}")
        expected = table[table["dataset"] == dataset]
        assert sorted(runs["tags.mlflow.runName"]) == sorted(
            f"{s} · {lv}" for s, lv in zip(expected["scorer"], expected["level"])
        )
        assert "tags.mlflow.parentRunId" not in runs or runs["tags.mlflow.parentRunId"].isna().all()  # flat
        assert runs["tags.comparison"].nunique() == 1
        for row in expected.itertuples():
            run = runs[(runs["tags.detector"] == row.scorer) & (runs["tags.level"] == row.level)].iloc[0]
            assert (run["tags.kind"], run["tags.dataset"], run["tags.llm"], run["tags.llm_digest"]) == (
                row.kind,
                dataset,
                "tiny-llama",
                "abc",
            )
            assert (run["params.scorer"], run["params.features"]) == (row.scorer, row.features)
            assert run["metrics.test_auroc"] == pytest.approx(row.auroc)
            assert run["metrics.test_auroc_ci_low"] == pytest.approx(row.auroc_ci_low)
            assert run["metrics.trigger_rate"] == pytest.approx(0.3) and run["metrics.test_n"] == 120
            if row.kind == "detector":
                assert (
                    run["metrics.delta_auroc"] == pytest.approx(row.delta_auroc)
                    and run["tags.delta_vs"] == row.delta_vs
                )
            else:  # a baseline has no difference to itself: the metric is absent, not NaN
                assert math.isnan(run["metrics.delta_auroc"]) and pd.isna(run.get("tags.delta_vs"))
                assert "delta_auroc" not in client.get_run(run["run_id"]).data.metrics
            logged = {f.path for f in client.list_artifacts(run["run_id"], "plots")}
            wanted = plots.get(dataset, []) + plots.get(f"{dataset}_{row.level}", [])
            assert logged == {f"plots/{p.name}" for p in wanted}
    # the same metric names in every run
    names = [
        set(r.data.metrics) - {"delta_auroc", "delta_ci_low", "delta_ci_high"}
        for r in client.search_runs(
            [mlflow.get_experiment_by_name(f"{tracking}-{d}").experiment_id for d in ("early", "realtime")]
        )
    ]
    assert (
        all(n == names[0] for n in names)
        and {"test_auroc", "test_auprc", "test_ece", "threshold", "trigger_rate"} <= names[0]
    )


def test_logging_again_replaces_the_previous_runs(tracking, artifacts, plots):
    table = comparison_table()
    log_comparison(table, plots, {"llm": "tiny-llama"}, tracking, artifacts)
    first = set(active_runs(f"{tracking}-realtime")["run_id"])
    table.loc[table["scorer"] == "flare", "auroc"] = 0.64
    log_comparison(table[table["dataset"] == "realtime"], {}, {"llm": "tiny-llama"}, tracking, artifacts)
    runs = active_runs(f"{tracking}-realtime")
    assert len(runs) == 4 and not set(runs["run_id"]) & first  # one run per row, all new
    assert runs.loc[runs["tags.detector"] == "flare", "metrics.test_auroc"].item() == pytest.approx(0.64)
    deleted = mlflow.search_runs(experiment_names=[f"{tracking}-realtime"], run_view_type=ViewType.DELETED_ONLY)
    assert set(deleted["run_id"]) == first  # soft-deleted: restorable until `mlflow gc`
    assert len(active_runs(f"{tracking}-early")) == 2  # another dataset's runs are left alone


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t, p, b: (t.drop(columns=["level"]), p, b), r"lacks columns \['level'\]"),
        (lambda t, p, b: (t.assign(level="paragraph"), p, b), r"'level' has values \['paragraph'\]"),
        (lambda t, p, b: (t.assign(dataset="later"), p, b), r"'dataset' has values \['later'\]"),
        (lambda t, p, b: (pd.concat([t, t.iloc[:1]]), p, b), r"several rows .*dior-early"),
        (lambda t, p, b: (t, p, {}), r"base_tags lacks 'llm'"),
        (lambda t, p, b: (t, {**p, "early_token": p["early"]}, b), r"plots keys \['early_token'\]"),
        (lambda t, p, b: (t.iloc[:0], p, b), r"no rows"),
    ],
)
def test_bad_input_is_refused_before_anything_is_logged(tracking, artifacts, plots, change, match):
    table, plots, base = change(comparison_table(), plots, {"llm": "tiny-llama"})
    with pytest.raises(ValueError, match=match):
        log_comparison(table, plots, base, tracking, artifacts)
    assert mlflow.get_experiment_by_name(f"{tracking}-early") is None


def test_a_missing_plot_file_is_named(tracking, artifacts, plots, tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.png"):
        log_comparison(comparison_table(), {"early": [tmp_path / "gone.png"]}, {"llm": "x"}, tracking, artifacts)


# ---- the figures (dvc plots) ----------------------------------------------------------------------------------------


def comparison_scores(table: pd.DataFrame, n: int = 40) -> tuple[dict, dict]:
    """Per dataset, every unit's scores (``id, group, split, label, level`` and a column per scorer of its level, as
    :func:`~detectors.evaluation.compare.compare_levels` returns them) and each level's test probabilities."""
    rng = np.random.default_rng(0)
    scores, probabilities = {}, {}
    for dataset, rows in table.groupby("dataset"):
        parts, probabilities[dataset] = [], {}
        for level, level_rows in rows.groupby("level"):
            label = np.arange(n) % 2
            part = pd.DataFrame(
                {
                    "id": [f"{level}{i}" for i in range(n)],
                    "group": [f"g{i // 2}" for i in range(n)],
                    "label": label,
                    "split": np.where(np.arange(n) < n // 2, "val", "test"),
                    "level": level,
                }
            )
            for scorer in level_rows["scorer"]:
                part[scorer] = label * 0.3 + rng.random(n)
            test = part[part["split"] == "test"]
            probabilities[dataset][level] = pd.DataFrame(
                {s: test[s].clip(0, 1).to_numpy() for s in level_rows["scorer"]}
            )
            parts.append(part)
        scores[dataset] = pd.concat(parts, ignore_index=True)
    return scores, probabilities


def test_the_comparison_figures_are_one_titled_png_per_dataset_level_and_kind_with_every_scorer(tmp_path):
    table = comparison_table()
    scores, probabilities = comparison_scores(table)
    early = pd.DataFrame({"status": "ok", "split": "test", "label": [0, 1] * 10, "entropy": np.linspace(0.5, 3.0, 20)})
    plots = write_comparison_plots(table, scores, probabilities, early, tmp_path, bins=5)
    keys = ["early_question", "realtime_token", "realtime_continuation"]
    assert plots == {
        "early": [tmp_path / "figures/early_entropy_ecdf.png"],
        **{k: [tmp_path / f"figures/{k}_curves.png", tmp_path / f"figures/{k}_ecdf.png"] for k in keys},
    }
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == sorted(
        p.name for paths in plots.values() for p in paths
    )
    titles = {}
    for path in (p for paths in plots.values() for p in paths):
        assert path.stat().st_size > 10_000, path  # a drawn figure, not an empty canvas
        with Image.open(path) as image:
            titles[path.name] = image.text["Title"]
    assert len(set(titles.values())) == len(titles)  # every figure titled apart
    assert titles["realtime_token_curves.png"].startswith(
        "Real-time detection, per entity token (test split: 120 units, 45% hallucinated)"
    )
    assert "DioR Fig. 7" in titles["early_entropy_ecdf.png"]
    # the curves' numbers beside them: one CSV per scorer of each level
    assert {p.stem for p in (tmp_path / "roc/realtime_continuation").glob("*.csv")} == {"mlp", "sit_norm"}
