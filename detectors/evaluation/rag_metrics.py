"""The metrics of a RAG evaluation's answers: each configuration's summary
(:func:`~detectors.evaluation.answer_metrics.summarise`), its paired differences to the reference configurations and
to the one it is set ``versus``, the retrievals it saves against always retrieving, and its validation point; and the
rules that say which rows are comparable (the same context template) and when a run failed as a whole."""

from __future__ import annotations

import logging
from typing import Any

from detectors.config.rag import references
from detectors.evaluation.answer_metrics import FAILED, summarise
from detectors.evaluation.rag_report import TRADE, reference_deltas, versus_always

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
