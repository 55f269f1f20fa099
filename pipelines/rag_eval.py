"""Stage rag_eval: registered detectors and training-free triggers inside a dynamic RAG loop, measured end to end.

On a deterministic sample of the QA test split (by id hash), every configuration of ``rag_eval.configurations``
answers every question over every corpus of ``rag_eval.corpora`` (the bm25s indexes of ``index_corpus``), each
trigger at its operating threshold for that corpus: the number ``rag_eval.thresholds`` gives it, else the most
accurate point of its accuracy vs retrieval-rate curve on the corpus's QA *validation* questions (the run
``sweep-val``; test questions never choose anything); every framework of ``rag_eval.frameworks`` (RetroRAG) answers
them with its own loop. Each run (``paths.rag_runs/<corpus>/<configuration>/``) is a resumable shard store like the
build stages' (:class:`~detectors.shards.ShardStore`, ``rag_eval.shard_size`` questions a shard): a killed run
resumes where it stopped, a question whose loop raised is computed again by the next run, and a run written under
other params, code, LLM, corpus, questions, thresholds or registered detectors is started again (its manifest says
what changed). On the sweep corpus, every trigger's curve is measured on the test questions too (the run ``sweep``:
the no-retrieval answer, each trigger's score records and the answer after one retrieval at each position where a
trigger can first fire), its area compared with random's and with the best training-free trigger's (paired bootstrap
intervals).

Writes ``paths.rag_metrics`` (``{corpus: {configuration: metrics}}``, ``sweep`` (the curves' summaries),
``thresholds`` (``{corpus: {trigger: threshold}}``) and ``digests`` (LLM and corpora)), its headline
``paths.rag_headline`` (``dvc metrics``: one file per corpus), the Markdown table ``paths.rag_table``, the curves CSV
``paths.rag_curves`` and their figure ``paths.rag_curves_plot`` (``dvc plots``), every prompt of the first
``prompts_sample`` questions per configuration (``paths.rag_prompts``) and one MLflow run per corpus × configuration
(plus one per swept trigger).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from detectors.config.rag import on_corpus, references, trigger_names
from detectors.errors import InputError
from detectors.evaluation.answer_metrics import FAILED, accuracy, summarise
from detectors.evaluation.choice import choose, mean_deltas
from detectors.evaluation.plots import write_rag_curves
from detectors.evaluation.rag_report import (
    TRADE,
    curves_table,
    headline,
    log_rag_runs,
    markdown_table,
    reference_deltas,
    tuning_table,
    versus_always,
)
from detectors.evaluation.rag_sweep import candidate_names, candidate_thresholds
from detectors.evaluation.rag_sweep import curves as sweep_curves
from detectors.evaluation.report import write_headline
from detectors.execution import map_units
from detectors.io import file_digest, write_json
from detectors.registry import store
from detectors.sources.ids import sample
from pipelines._rag_runtime import SWEEP, TUNE, VAL_SWEEP, RunWorker
from pipelines._stage import run, stage_params

log = logging.getLogger("rag_eval")
MIN_VALIDATION = 300  # validation questions a choice should rest on (fewer: a warning)
READS = (
    "llm",
    "build_early.features.prompt",
    "build_early.stop",
    "build_realtime.spacy_model",
    "rag_eval",
    "retrorag",
    "execution",
    "mlflow",
    "paths.llm",
    "paths.qa",
    "paths.registry_early",
    "paths.registry_realtime",
    "paths.registry_ctrla",
    "paths.registry_utility",
    "paths.rag_index",
    "paths.rag_runs",
    "paths.rag_metrics",
    "paths.rag_headline",
    "paths.rag_table",
    "paths.rag_curves",
    "paths.rag_curves_plot",
    "paths.rag_prompts",
)
DEPS = (
    "${paths.llm}",
    "${paths.qa}",
    "${paths.registry_early}",
    "${paths.registry_realtime}",
    "${paths.registry_ctrla}",
    "${paths.registry_utility}",
    "${paths.rag_index}",
    "${paths.index_report}",
)
OUTS = (
    ("${paths.rag_runs}", {"persist": True, "cache": False}, "finished questions: kept when a killed run restarts"),
    (
        "${paths.rag_metrics}",
        {"cache": False},
        "the detailed report: {corpus: {configuration: metrics}}, sweep, thresholds, digests",
    ),
    ("${paths.rag_table}", {"cache": False}),
    ("${paths.rag_curves}", {"cache": False}, "the sweep's curves: trigger, threshold, retrieval_rate, accuracy"),
    ("${paths.rag_prompts}", {"cache": False}),
)
METRICS = (
    (
        "${paths.rag_headline}",
        {"cache": False},
        "at a glance, one JSON per corpus: accuracy of DioR, the best other configuration, always, never",
    ),
)
PLOTS = (("${paths.rag_curves_plot}", {"cache": False}, "every trigger's accuracy vs retrieval-rate curve in one PNG"),)


def split_questions(qa: pd.DataFrame, split: str, limit: int | None = None) -> pd.DataFrame:
    """The first ``limit`` questions of ``split`` by id hash (all of them for None), in the QA table's order."""
    missing = [c for c in ("id", "question", "answers", "split") if c not in qa.columns]
    if missing:
        raise InputError(f"the QA table lacks columns {missing}: rerun the prepare stage")
    rows = qa[qa["split"] == split].reset_index(drop=True)
    if rows.empty:
        raise InputError(f"the QA table has no {split} question: check qa.splits in params.yaml")
    return sample(rows, limit)


# ---- thresholds and outputs --------------------------------------------------------------------------


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
        triggers = [n for t in config.triggers if t != "always" for n in trigger_names(t, [corpus])]
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


def write_curves(path: str | Path, curves: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["trigger", "threshold", "retrieval_rate", "accuracy"])
        writer.writeheader()
        for c in curves.values():
            writer.writerows(c.rows())


def write_prompts(path: str | Path, lines: dict[str, dict[str, list[dict]]], sample_size: int) -> None:
    """Every prompt of the first ``sample_size`` questions of each corpus × configuration, one JSON line each."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for corpus, configs in lines.items():
            for name, results in configs.items():
                for line in results[:sample_size]:
                    f.write(
                        json.dumps(
                            {
                                "corpus": corpus,
                                "configuration": name,
                                "id": line["id"],
                                "prompts": line.get("prompts", []),
                            }
                        )
                        + "\n"
                    )


def check_failures(lines: list[dict], what: str, share: float = 0.5) -> None:
    """Stop when most questions of a configuration raised (a systematic fault, not a hard question); their lines stay
    on disk and the next run retries nothing it finished. Fewer failures are counted in the metrics (``failed``)."""
    failed = [line for line in lines if str(line.get("error") or "").startswith(FAILED)]
    if lines and len(failed) > share * len(lines):
        raise RuntimeError(f"{what}: {len(failed)} of {len(lines)} questions failed, e.g. {failed[0]['error']}")


def dior_configurations(configurations: dict) -> list[str]:
    """DioR's configurations (the headline's ``dior``): those whose every trigger is one of its registered detectors
    (``dior-early``, ``dior-realtime``: the names ``register`` gives them)."""
    return [name for name, c in configurations.items() if c.triggers and all(t.startswith("dior-") for t in c.triggers)]


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


def champion_versions(params) -> dict[str, str]:
    """The version (and its run id) each registered ``<name>@<alias>`` of the configurations points to now (triggers on
    every corpus and honesty steering): part of the key of every run that reads it, so that moving an alias
    (``promote``) outside the pipeline makes those runs compute again instead of resuming what another version
    answered."""
    rag = params["rag_eval"]
    specs = {on_corpus(t, c) for config in rag.configurations.values() for t in config.triggers for c in rag.corpora}
    specs |= {config.steering for config in rag.configurations.values() if config.steering}
    store.configure(params["mlflow"].tracking_uri)
    client, out = MlflowClient(), {}
    for spec in sorted(s for s in specs if "@" in s):
        name, alias = spec.split("@", 1)
        try:
            version = store.alias_version(client, name, alias)
        except MlflowException as err:  # no such registered model
            raise InputError(
                f"rag_eval uses {spec}, but {name} is not registered in {params['mlflow'].tracking_uri}: "
                "run the register stages "
                f"first ({err.error_code})"
            ) from err
        if version is None:
            raise InputError(
                f"rag_eval uses {spec}, but {name} has no alias {alias!r} in {params['mlflow'].tracking_uri}: "
                "run the register stages first"
            )
        out[spec] = f"{version.version}:{version.run_id}"  # the run id tells a version 1 of another store apart
    return out


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "rag_eval")
    rag = params["rag_eval"]
    qa = pd.read_parquet(params["paths.qa"])
    rows = {"test": split_questions(qa, "test", rag.questions), "val": split_questions(qa, "val")}
    rows["frameworks"] = sample(rows["test"], rag.framework_questions)
    answers = {i: list(a) for i, a in zip(rows["test"]["id"], rows["test"]["answers"])}
    # what shapes every run's answers; each run adds its own code, params, thresholds and champions
    # (pipelines._rag_runtime)
    base_key = {
        "qa": file_digest(params["paths.qa"]),
        "prompt": dataclasses.asdict(params["build_early.features.prompt"]),
        "stop": list(params["build_early.stop"]),
        "spacy_model": params["build_realtime.spacy_model"],
        "champions": champion_versions(params),
    }
    # first every corpus's validation sweep: it proposes the candidate thresholds
    sweeps = [(corpus, VAL_SWEEP) for corpus in rag.corpora]
    swept = {
        sweeps[i]: {**result, "lines": result["lines"][VAL_SWEEP]}
        for i, result in map_units(sweeps, functools.partial(RunWorker, params, rows, base_key), params["execution"])
    }
    # then every configuration at its candidate thresholds on the validation questions: its own procedure picks its
    # point
    val_curves = {
        c: sweep_curves(swept[(c, VAL_SWEEP)]["lines"], list(swept[(c, VAL_SWEEP)]["triggers"])) for c in rag.corpora
    }
    candidates = {
        c: tuning_candidates(rag.configurations, c, val_curves[c], rag.thresholds, rag.candidate_rates)
        for c in rag.corpora
    }
    # a configuration with nothing to choose (no threshold, or fixed ones) is not run on validation
    tried = {c: {name: sets for name, sets in candidates[c].items() if len(sets) > 1} for c in rag.corpora}
    to_tune = [c for c in rag.corpora if tried[c]]
    tuned = {
        to_tune[i]: result
        for i, result in map_units(
            [(c, TUNE) for c in to_tune],
            functools.partial(RunWorker, params, rows, base_key, None, tried),
            params["execution"],
        )
    }
    val_answers = [list(a) for a in rows["val"]["answers"]]
    if len(val_answers) < MIN_VALIDATION:
        log.warning(
            "the operating points rest on %d validation questions, fewer than %d: raise qa.splits' val share or "
            "qa.limit",
            len(val_answers),
            MIN_VALIDATION,
        )
    tuning = {
        c: choose_candidates(tried[c], tuned[c]["lines"], val_answers, rag.bootstrap, rag.seed) if c in tuned else {}
        for c in rag.corpora
    }
    thresholds = {
        c: {
            name: tuning[c][name]["thresholds"] if name in tuning[c] else sets[0]["thresholds"]
            for name, sets in candidates[c].items()
        }
        for c in rag.corpora
    }
    for corpus, chosen in thresholds.items():
        log.info("%s: thresholds chosen on %d validation questions: %s", corpus, len(rows["val"]), chosen)
    # a corpus's configurations in one unit (answered question-major, so that they share their decoding), the test
    # sweep with those of its corpus; a configuration that never retrieves answers the same on every corpus: run once;
    # each framework its own unit, on its sample of the test questions
    first = rag.corpora[0]
    groups = {
        corpus: ((SWEEP,) if corpus == rag.sweep.corpus else ())
        + tuple(name for name, config in rag.configurations.items() if config.triggers or corpus == first)
        for corpus in rag.corpora
    }
    units = [(corpus, names) for corpus, names in groups.items() if names] + [
        (corpus, name) for corpus in rag.corpora for name in rag.frameworks
    ]
    worker = functools.partial(RunWorker, params, rows, base_key, thresholds)
    results = {units[i]: result for i, result in map_units(units, worker, params["execution"])}
    answered = {(corpus, name): run for (corpus, _), result in results.items() for name, run in result["lines"].items()}
    lines = {
        corpus: {
            **{
                name: answered[(corpus, name) if config.triggers else (first, name)]
                for name, config in rag.configurations.items()
            },
            **{name: answered[(corpus, name)] for name in rag.frameworks},
        }
        for corpus in rag.corpora
    }
    for corpus, name in answered:
        if name != SWEEP:
            check_failures(lines[corpus][name], f"{corpus} · {name}")
    refs = references(rag.configurations)
    versus = {name: c.versus for name, c in rag.configurations.items() if c.versus}
    metrics: dict[str, Any] = evaluate_lines(lines, answers, refs, rag.bootstrap, rag.seed, versus)
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
    for corpus, chosen in tuning.items():  # each configuration's validation accuracy and retrievals at its chosen point
        for name, t in chosen.items():
            point = t["candidates"][t["chosen"]]
            metrics[corpus][name] |= {
                "val_accuracy": point["accuracy"],
                "val_retrievals_per_question": point["retrievals_per_question"],
            }
    test_sweep = next(result for (corpus, _), result in results.items() if SWEEP in result["lines"])
    curves = sweep_curves(
        test_sweep["lines"][SWEEP], list(test_sweep["triggers"]), rag.bootstrap, rag.seed, test_sweep["triggers"]
    )
    metrics[SWEEP] = {
        "corpus": rag.sweep.corpus,
        "query": rag.sweep.query,
        "curves": {t: c.summary() for t, c in curves.items()},
    }
    metrics["thresholds"] = thresholds
    metrics["tuning"] = tuning
    llm_name, llm_digest = test_sweep["llm"]
    digests = {corpus: result["corpus_digest"] for (corpus, _), result in {**swept, **results}.items()}
    metrics["digests"] = {"llm": llm_digest, "corpora": {c: digests[c] for c in rag.corpora}}
    write_json(params["paths.rag_metrics"], metrics)
    table = {c: metrics[c] for c in rag.corpora}
    write_headline(params["paths.rag_headline"], headline(table, refs, dior_configurations(rag.configurations)))
    markdown = (
        markdown_table(table) + "\n" + tuning_table(tuning, len(rows["val"])) + "\n" + curves_table(metrics[SWEEP])
    )
    Path(params["paths.rag_table"]).parent.mkdir(parents=True, exist_ok=True)
    Path(params["paths.rag_table"]).write_text(markdown, encoding="utf-8")
    log.info("RAG evaluation:\n%s", markdown)
    write_curves(params["paths.rag_curves"], curves)
    swept_on = f"sweep of corpus {rag.sweep.corpus}, query {rag.sweep.query}, {len(answers)} test questions"
    write_rag_curves(
        curves, Path(params["paths.rag_curves_plot"]), f"RAG: accuracy vs retrieval rate of every trigger ({swept_on})"
    )
    write_prompts(params["paths.rag_prompts"], lines, rag.prompts_sample)
    configs = {name: dataclasses.asdict(c) for name, c in rag.configurations.items()}
    configs |= {
        name: {"triggers": [name], "query": name, **dataclasses.asdict(params[name])} for name in rag.frameworks
    }
    tags = {"llm": llm_name, "llm_digest": llm_digest}
    log_rag_runs(
        table,
        metrics[SWEEP],
        configs,
        rag.experiment,
        tags,
        params["mlflow"].artifact_root,
        metrics["digests"]["corpora"],
    )


if __name__ == "__main__":
    run(main)
