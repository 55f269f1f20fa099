"""Operating points of RAG systems, chosen on validation questions: the candidates each configuration is tried at
(:func:`tuning_candidates`, from its triggers' validation sweep curves) and the one rule that picks among them
(:func:`choose_candidates`, :func:`~detectors.evaluation.choice.choose`): never retrieving by default, always
retrieving when that is surely better, another candidate only when its paired interval over the default lies above 0.
"""

from __future__ import annotations

from typing import Any

from detectors.config.rag import trigger_names
from detectors.evaluation.answer_metrics import accuracy, summarise
from detectors.evaluation.choice import choose, mean_deltas
from detectors.evaluation.rag_sweep import candidate_names, candidate_thresholds
from detectors.extensions import thresholded


def tuning_candidates(
    configurations: dict, corpus: str, curves: dict, fixed: dict[str, float], rates: list[float]
) -> dict[str, list[dict[str, Any]]]:
    """Per configuration, the candidates it is tried at on ``corpus``'s validation questions, each ``{"label",
    "thresholds"}``: candidate j puts each of its triggers at threshold j of
    :func:`~detectors.evaluation.rag_sweep.candidate_thresholds` (never, always, the validation curve's most accurate
    point, then the points nearest each of ``rates``; the triggers of one configuration at the same target); a trigger
    ``fixed`` gives a number (or the configuration's own ``thresholds``) stays there; a set that repeats is tried once,
    under its first label. A configuration with no threshold to choose has one candidate."""
    out = {}
    for name, config in configurations.items():
        triggers = [n for t in config.triggers if thresholded(t) for n in trigger_names(t, [corpus])]
        pinned = {**fixed, **config.thresholds}
        free = [t for t in triggers if t not in pinned]
        per = {t: candidate_thresholds(curves[t], rates) for t in free}
        labels = candidate_names(rates) if free else ["fixed" if triggers else "no threshold"]
        sets: dict[tuple, str] = {}
        for j, label in enumerate(labels):
            chosen = {t: float(pinned[t]) if t in pinned else per[t][j] for t in triggers}
            sets.setdefault(tuple(chosen.items()), label)
        out[name] = [{"label": label, "thresholds": dict(items)} for items, label in sets.items()]
    return out


def choose_candidates(
    candidates: dict[str, list[dict[str, Any]]],
    lines: dict[str, list[dict]],
    answers: list[list[str]],
    bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Per configuration, its operating point among its ``candidates`` from their validation ``lines`` (run
    ``<configuration>/<j>``), by the one rule of choices (:func:`~detectors.evaluation.choice.choose` over the paired
    differences of the questions' correctness): the default is never retrieving, or always retrieving when that is
    surely better (fewer retrievals win a tie); a candidate replaces the default only when its paired 95% bootstrap
    interval over it lies above 0. Returns ``{configuration: {"chosen": j, "default": j, "thresholds": {...},
    "candidates": [{"label", "thresholds", "accuracy", "retrievals_per_question", "searches_per_question", "delta"
    (against the default: difference, interval)}, ...], "choice": the rule's record}}``."""
    out = {}
    for name, sets in candidates.items():
        runs = [lines[f"{name}/{j}"] for j in range(len(sets))]
        keys = ("accuracy", "retrievals_per_question", "searches_per_question")
        tried = [
            {"label": c["label"], "thresholds": c["thresholds"], **{k: summarise(run, answers)[k] for k in keys}}
            for c, run in zip(sets, runs)
        ]
        correct = {
            c["label"]: [accuracy(x["answer"], refs) for x, refs in zip(run, answers)] for c, run in zip(sets, runs)
        }
        labels = list(correct)
        default = labels[0]
        if {"never", "always"} <= set(labels):
            pair = {k: correct[k] for k in ("never", "always")}
            default = choose("never", mean_deltas(pair, "never", bootstrap, seed), len(answers)).chosen
        choice = choose(default, mean_deltas(correct, default, bootstrap, seed), len(answers))
        for c in tried:
            c["delta"] = list(choice.deltas.get(c["label"], (0.0, 0.0, 0.0)))
        best = labels.index(choice.chosen)
        out[name] = {
            "chosen": best,
            "default": labels.index(default),
            "thresholds": sets[best]["thresholds"],
            "candidates": tried,
            "choice": choice.as_dict(),
        }
    return out
