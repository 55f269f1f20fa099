"""The pipeline's figures: per dataset x level on the test split, ROC and precision-recall curves of all scorers,
reliability diagrams and ECDFs of the scores of hallucinated vs correct units (one panel per scorer); DioR Fig. 7's
attribution-entropy ECDF; the CtrlA directions' figures; rag_eval's accuracy vs retrieval-rate curves. The PNGs are
the ``dvc plots`` (DVC embeds images in its HTML: no renderer to download) and MLflow artifacts, each with every
scorer (or trigger) in one figure under a title of its own, also stored as the PNG's ``Title`` text chunk; the curves'
numbers are written beside them as CSVs (one per scorer). Each scorer keeps one colour in every figure
(:func:`scorer_colours`).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from detectors.evaluation.metrics import precision_recall, roc  # noqa: E402

PALETTE = [plt.get_cmap(name)(i) for name in ("tab10", "Dark2", "Set1") for i in range(plt.get_cmap(name).N)]
CURVES = {"roc": ("fpr", "tpr"), "pr": ("recall", "precision"), "reliability": ("confidence", "frequency")}
UNITS = {  # (dataset, level) -> what a figure of that level shows
    ("early", "question"): "Early detection (before answering), per question",
    ("realtime", "token"): "Real-time detection, per entity token",
    ("realtime", "entity"): "Real-time detection, per entity",
    ("realtime", "continuation"): "Real-time detection, per continuation",
}


def scorer_colours(names: Iterable[str]) -> dict[str, tuple]:
    """A colour per scorer name from the sorted registry of all names, so a scorer's colour depends on which
    scorers exist, never on the order a figure draws them in."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted(set(names)))}


def reliability(labels, probabilities, bins: int) -> pd.DataFrame:
    """Mean predicted probability (``confidence``) and observed hallucination rate (``frequency``) per non-empty
    equal-width bin, with the bin's ``count``."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64), 0, 1)
    which = np.minimum((p * bins).astype(int), bins - 1)
    frame = pd.DataFrame({"bin": which, "p": p, "y": np.asarray(labels, dtype=np.float64)})
    grouped = frame.groupby("bin").agg(confidence=("p", "mean"), frequency=("y", "mean"), count=("y", "size"))
    return grouped.reset_index(drop=True)


def ecdf(values) -> tuple[np.ndarray, np.ndarray]:
    values = np.sort(np.asarray(values, dtype=np.float64))
    return values, np.arange(1, len(values) + 1) / max(len(values), 1)


def level_title(dataset: str, level: str, n: int, positive_rate: float) -> str:
    """The title of a dataset x level's figures: what is detected on which units, and the test split's size."""
    what = UNITS.get((dataset, level), f"{dataset} set, {level} level")
    return f"{what} (test split: {int(n)} units, {positive_rate:.0%} hallucinated)"


def save_figure(fig, path: Path, title: str, dpi: int = 110) -> Path:
    """Save ``fig`` as a PNG titled ``title`` (its suptitle, wrapped to the figure's width, and its ``Title`` text
    chunk,
    which image viewers and tests read) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.suptitle("\n".join(textwrap.wrap(title, width=max(40, int(fig.get_figwidth() * 11)))), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, metadata={"Title": title})
    plt.close(fig)
    return path


def _fresh(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.csv"):
        old.unlink()
    return directory


def write_level_plots(
    scores: pd.DataFrame,
    probabilities: pd.DataFrame,
    results: dict,
    colours: dict,
    plots_dir: Path,
    key: str,
    title: str,
    bins: int,
) -> list[Path]:
    """The figures of one dataset x level (``key``, e.g. ``realtime_entity``, titled ``title``) from the test rows of
    ``scores`` and the calibrated ``probabilities`` (one column per scorer in ``results``); returns the PNGs.

    CSVs: ``<plots_dir>/{roc,pr,reliability}/<key>/<scorer>.csv``; PNGs: ``<plots_dir>/figures/<key>_*.png``.
    """
    test = scores[scores["split"] == "test"]
    names = sorted(results, key=lambda n: -results[n]["auroc"])
    dirs = {kind: _fresh(plots_dir / kind / key) for kind in CURVES}
    figures = plots_dir / "figures"
    fig, (ax_roc, ax_pr, ax_rel) = plt.subplots(1, 3, figsize=(17, 5.5))
    for name in names:
        colour, m = colours[name], results[name]
        fpr, tpr, _ = roc(test["label"], test[name])
        recall, precision = precision_recall(test["label"], test[name])
        rel = reliability(test["label"], probabilities[name], bins)
        pd.DataFrame({"fpr": fpr, "tpr": tpr}).to_csv(dirs["roc"] / f"{name}.csv", index=False)
        pd.DataFrame({"recall": recall, "precision": precision}).to_csv(dirs["pr"] / f"{name}.csv", index=False)
        rel.to_csv(dirs["reliability"] / f"{name}.csv", index=False)
        ax_roc.plot(
            fpr,
            tpr,
            color=colour,
            label=f"{name} ({m['auroc']:.3f} [{m['auroc_ci_low']:.2f}, {m['auroc_ci_high']:.2f}])",
        )
        ax_pr.step(recall, precision, where="post", color=colour, label=f"{name} ({m['auprc']:.3f})")
        ax_rel.plot(rel["confidence"], rel["frequency"], "o-", color=colour, label=f"{name} (ECE {m['ece']:.3f})")
    ax_roc.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax_pr.axhline(float(test["label"].mean()), color="k", ls=":", lw=0.8)
    ax_rel.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax_roc.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (AUROC [95% CI])")
    ax_pr.set(xlabel="recall", ylabel="precision", title="precision-recall (AUPRC)", ylim=(0, 1.02))
    ax_rel.set(xlabel="predicted P(hallucinated)", ylabel="observed share hallucinated", title="reliability (ECE)")
    ax_rel.set(xlim=(0, 1), ylim=(0, 1))
    for ax in (ax_roc, ax_pr, ax_rel):
        ax.legend(fontsize=6)
    curves = save_figure(
        fig, figures / f"{key}_curves.png", f"{title}: ROC, precision-recall and reliability of every scorer"
    )
    return [curves, ecdf_grid(test, names, colours, figures / f"{key}_ecdf.png", title)]


def ecdf_grid(test: pd.DataFrame, names: list[str], colours: dict, path: Path, title: str) -> Path:
    """One panel per scorer: the ECDF of its scores on hallucinated (solid) and correct (dashed) test units."""
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, name in zip(axes.ravel(), names):
        for label, style, what in ((1, "-", "hallucinated"), (0, "--", "correct")):
            x, y = ecdf(test.loc[test["label"] == label, name])
            ax.step(x, y, style, where="post", color=colours[name], label=what)
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in axes.ravel()[len(names) :]:
        ax.axis("off")
    return save_figure(fig, path, f"{title}: score ECDF of each scorer, hallucinated vs correct", dpi=100)


def write_entropy_ecdf(frame: pd.DataFrame, plots_dir: Path) -> Path:
    """DioR Fig. 7: the ECDF of the IG attribution entropy of hallucinated vs correct test questions
    (``<plots_dir>/early_entropy_ecdf/{correct,hallucinated}.csv`` and a PNG)."""
    out = _fresh(plots_dir / "early_entropy_ecdf")
    ok = frame[(frame["status"] == "ok") & (frame["split"] == "test")]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, answer in ((1, "hallucinated"), (0, "correct")):
        x, y = ecdf(ok.loc[ok["label"] == label, "entropy"])
        pd.DataFrame({"entropy": x, "ecdf": y}).to_csv(out / f"{answer}.csv", index=False)
        ax.step(x, y, where="post", label=answer)
    ax.set(xlabel="IG attribution entropy", ylabel="ECDF")
    ax.legend()
    title = f"Early detection: IG attribution entropy, hallucinated vs correct (DioR Fig. 7, {len(ok)} test questions)"
    return save_figure(fig, plots_dir / "figures" / "early_entropy_ecdf.png", title, dpi=120)


def write_comparison_plots(
    table: pd.DataFrame, scores: dict, probabilities: dict, early: pd.DataFrame, plots_dir: Path, bins: int
) -> dict[str, list[Path]]:
    """Every figure of the comparison (``table``: its long table; ``scores``/``probabilities``: per dataset, what
    :func:`~detectors.evaluation.compare.compare_levels` returned; ``early``: the early set, for DioR Fig. 7), keyed
    ``<dataset>_<level>`` (and ``early`` for Fig. 7), one colour per scorer throughout."""
    colours = scorer_colours(table["scorer"])
    plots = {"early": [write_entropy_ecdf(early, plots_dir)]}
    for (dataset, level), rows in table.groupby(["dataset", "level"], sort=False):
        level_scores = scores[dataset][scores[dataset]["level"] == level].reset_index(drop=True)
        results = {r["scorer"]: r for r in rows.to_dict("records")}
        first = rows.iloc[0]
        title = level_title(dataset, level, first["n"], first["positive_rate"])
        plots[f"{dataset}_{level}"] = write_level_plots(
            level_scores, probabilities[dataset][level], results, colours, plots_dir, f"{dataset}_{level}", title, bins
        )
    return plots


def write_directions_plots(metrics: dict, plots_dir: Path) -> list[Path]:
    """The CtrlA directions' CSVs and PNGs (evaluate_directions): honesty AUROC per layer, AUROC vs statements,
    TruthfulQA accuracy vs λ."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    pngs = []
    h = metrics.get("honesty", {})
    if h:
        per_layer = pd.DataFrame({"layer": np.arange(1, len(h["auroc_per_layer"]) + 1), "auroc": h["auroc_per_layer"]})
        if h["val_auroc_per_layer"]:
            per_layer["val_auroc"] = h["val_auroc_per_layer"]
        per_layer.to_csv(plots_dir / "ctrla_honesty_layers.csv", index=False)
        sizes = pd.DataFrame([{"n_statements": int(n), "auroc": a} for n, a in h["auroc_by_n_statements"].items()])
        sizes.to_csv(plots_dir / "ctrla_honesty_size.csv", index=False)
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        ax.plot(per_layer["layer"], per_layer["auroc"], "o-", label="test statements")
        if "val_auroc" in per_layer:
            ax.plot(per_layer["layer"], per_layer["val_auroc"], "s--", alpha=0.6, label="val statements")
        for (name, r), colour in zip(h["ranges"].items(), ("tab:grey", "tab:green")):
            ax.axvspan(
                r["layers"][0] - 0.5,
                r["layers"][-1] + 0.5,
                color=colour,
                alpha=0.12,
                label=f"{name} range (test {r['test_auroc']})",
            )
        ax.axhline(0.5, color="k", ls=":", lw=0.8)
        ax.legend(fontsize=7)
        ax.set(xlabel="layer", ylabel="held-out AUROC (true vs false)", title="Honesty direction per layer")
        ax2.plot(sizes["n_statements"], sizes["auroc"], "o-")
        ax2.set(
            xscale="log",
            xlabel="statements used for PCA",
            ylabel="AUROC at the paper's steering layers",
            title="Dependence on |S|",
        )
        title = (
            f"CtrlA honesty direction: held-out true-vs-false AUROC per layer and vs statements used "
            f"({h['n_heldout']} test statements)"
        )
        pngs.append(save_figure(fig, plots_dir / "ctrla_honesty.png", title, dpi=120))
    t = metrics.get("truthfulqa", {})
    if t:
        grid = pd.DataFrame([{"lambda": float(k), "accuracy": v} for k, v in t["accuracy"].items()]).sort_values(
            "lambda"
        )
        grid.to_csv(plots_dir / "ctrla_truthfulqa.csv", index=False)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(grid["lambda"], grid["accuracy"], "o-")
        ax.set(xlabel="λ (fraction of the residual norm)", ylabel="MC1 accuracy")
        title = f"CtrlA: TruthfulQA MC1 accuracy under honesty steering (CtrlA Fig. 2, {t['n']} questions)"
        pngs.append(save_figure(fig, plots_dir / "ctrla_truthfulqa.png", title, dpi=120))
    return pngs


def write_rag_curves(curves: dict, path: Path, title: str) -> Path:
    """rag_eval's accuracy vs retrieval-rate curves (``{trigger: Curve}`` of :mod:`detectors.evaluation.rag_sweep`) in
    one figure,
    each labelled with its area − random's, beside random retrieval's line (from never to always retrieving)."""
    colours = scorer_colours(curves)
    fig, ax = plt.subplots(figsize=(9, 6))
    for trigger, c in sorted(curves.items(), key=lambda item: -(item[1].area - item[1].random_area)):
        low, high = c.interval
        interval = "" if math.isnan(low) else f" [{low:+.3f}, {high:+.3f}]"
        label = f"{trigger} (area − random {c.area - c.random_area:+.3f}{interval})"
        ax.plot(c.retrieval_rate, c.accuracy, ".-", color=colours[trigger], lw=1.2, ms=3, label=label)
    if curves:
        first = next(iter(curves.values()))
        ax.plot([0, 1], [first.never_accuracy, first.always_accuracy], "k:", lw=1, label="random retrieval")
        ax.legend(fontsize=7, loc="best")
    ax.set(xlabel="retrieval rate (share of questions retrieving)", ylabel="accuracy (containment)", xlim=(0, 1))
    return save_figure(fig, path, title, dpi=110)
