"""The metrics of a RAG evaluation's answers: each configuration's summary
(:func:`~detectors.evaluation.answer_metrics.summarise`), its paired differences to the reference configurations and
to the one it is set ``versus``, the retrievals it saves against always retrieving, and its validation point; and the
rules that say which rows are comparable (the same context template) and when a run failed as a whole."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from detectors.config.rag import references
from detectors.evaluation.answer_metrics import FAILED, accuracy, summarise
from detectors.evaluation.bootstrap import paired_mean_delta

log = logging.getLogger("rag_eval")


def check_failures(lines: list[dict], what: str, share: float = 0.5) -> None:
    """Stop when most questions of a configuration raised (a systematic fault, not a hard question); their lines stay
    on disk and the next run retries nothing it finished. Fewer failures are counted in the metrics (``failed``)."""
    failed = [line for line in lines if str(line.get("error") or "").startswith(FAILED)]
    if lines and len(failed) > share * len(lines):
        raise RuntimeError(f"{what}: {len(failed)} of {len(lines)} questions failed, e.g. {failed[0]['error']}")


def other_template(configurations: dict, context: str, always: str | None) -> list[str]:
    """The configurations that put their passages in another template than the ``always`` reference does (``context``:
    ``rag_eval.context``, where a configuration's own is null): comparing them with it would count the template as the
    trigger's gain, so they get no comparison with always retrieving."""
    if always is None:
        return []
    template = configurations[always].context or context
    return [name for name, c in configurations.items() if c.triggers and (c.context or context) != template]


def evaluate_lines(
    lines: dict[str, dict[str, list[dict]]],
    answers: dict[str, list[str]],
    refs: dict[str, str],
    bootstrap: int,
    seed: int,
    versus: dict[str, str] | None = None,
) -> dict[str, dict[str, dict]]:
    """``{corpus: {configuration: metrics}}`` of the stored lines (one per question it answered; ``answers``: each
    question's references by id), with each configuration's paired accuracy difference to the reference
    configurations ``refs`` and to the configuration ``versus`` names for it, and, with an ``always`` reference, the
    retrievals it saves at always's accuracy or the accuracy it loses (:func:`versus_always`)."""
    out = {}
    for corpus, configs in lines.items():
        deltas = reference_deltas(configs, answers, refs, bootstrap, seed, versus)
        out[corpus] = {
            name: {**summarise(results, [answers[r["id"]] for r in results]), **deltas[name]}
            for name, results in configs.items()
        }
        if "always" in refs:
            trade = versus_always(out[corpus], refs["always"])
            out[corpus] = {name: {**values, **trade[name]} for name, values in out[corpus].items()}
    return out


def evaluation_metrics(
    lines: dict[str, dict[str, list[dict]]],
    tuning: dict[str, dict[str, dict[str, Any]]],
    rag,
    answers: dict[str, list[str]],
) -> dict[str, Any]:
    """``{corpus: {configuration: metrics}}`` of the evaluation's ``lines`` (:func:`evaluate_lines`; a configuration
    with another template than always retrieving loses its comparison with it), each with its validation accuracy and
    retrievals at its chosen point (``tuning``)."""
    refs = references(rag.configurations)
    versus = {name: c.versus for name, c in rag.configurations.items() if c.versus}
    metrics = evaluate_lines(lines, answers, refs, rag.bootstrap, rag.seed, versus)
    for name in other_template(rag.configurations, rag.context, refs.get("always")):
        log.warning(
            "%s answers with another context template than %s: it is not compared with always retrieving",
            name,
            refs["always"],
        )
        for corpus in rag.corpora:
            metrics[corpus][name] = {
                k: v
                for k, v in metrics[corpus][name].items()
                if not k.startswith("accuracy_vs_always") and k not in TRADE
            }
    for corpus, chosen in tuning.items():
        for name, t in chosen.items():
            point = t["candidates"][t["chosen"]]
            metrics[corpus][name] |= {
                "val_accuracy": point["accuracy"],
                "val_retrievals_per_question": point["retrievals_per_question"],
            }
    return metrics


# AdaRAGUE's view against always retrieving (:func:`versus_always`)
TRADE = (
    "retrievals_saved_vs_always",
    "accuracy_lost_vs_always",
)


def reference_deltas(
    results: dict[str, Sequence[dict]],
    answers: Mapping[str, Sequence[str]],
    references: dict[str, str],
    n: int = 1000,
    seed: int = 0,
    versus: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per configuration, its accuracy minus each reference configuration's (``references``: ``{"never": name,
    "always": name}``, no retrieval and retrieving once before generating) with the paired 95% bootstrap interval:
    ``accuracy_vs_<reference>``, ``..._ci_low``, ``..._ci_high``; and minus the configuration ``versus`` names for it
    (``accuracy_vs_versus`` and its interval, ``versus``: that configuration). Pairs are the questions both answered
    (``answers``: the references of each question, by the ``id`` of the results' lines; a framework may answer a sample
    of them). A reference absent from ``results`` is left out."""
    correct = {
        name: {r["id"]: accuracy(r["answer"], answers[r["id"]]) for r in lines} for name, lines in results.items()
    }

    def paired(name: str, other: str, key: str) -> dict[str, float]:
        ids = [i for i in correct[other] if i in correct[name]]
        delta, low, high = paired_mean_delta([correct[name][i] for i in ids], [correct[other][i] for i in ids], n, seed)
        return {key: delta, f"{key}_ci_low": low, f"{key}_ci_high": high}

    out: dict[str, dict[str, Any]] = {name: {} for name in results}
    for ref, ref_name in references.items():
        if ref_name in correct:
            for name in correct:
                out[name].update(paired(name, ref_name, f"accuracy_vs_{ref}"))
    for name, other in (versus or {}).items():
        if name in correct and other in correct:
            out[name].update(paired(name, other, "accuracy_vs_versus"), versus=other)
    return out


def versus_always(configs: Mapping[str, Mapping[str, Any]], always: str) -> dict[str, dict[str, float]]:
    """AdaRAGUE's comparison with always retrieving, per configuration of one corpus: where its accuracy is at least the
    ``always`` configuration's, ``retrievals_saved_vs_always`` = 1 − its retrievals per question / always's (negative:
    it retrieves more); else ``accuracy_lost_vs_always``, always's accuracy minus its own (the paired interval of that
    difference is ``accuracy_vs_always``'s)."""
    if always not in configs:
        return {name: {} for name in configs}
    ref = configs[always]
    out = {}
    for name, values in configs.items():
        lost = float(ref["accuracy"]) - float(values["accuracy"])
        if lost <= 0:
            out[name] = {
                TRADE[0]: 1.0 - float(values["retrievals_per_question"]) / float(ref["retrievals_per_question"])
            }
        else:
            out[name] = {TRADE[1]: lost}
    return out
