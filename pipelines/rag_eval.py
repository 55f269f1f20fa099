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
``thresholds`` (``{corpus: {trigger: threshold}}``) and ``digests`` (LLM and corpora)), the Markdown table
``paths.rag_table``, the curves CSV ``paths.rag_curves`` (dvc plots), every prompt of the first ``prompts_sample``
questions per configuration (``paths.rag_prompts``) and one MLflow run per corpus × configuration (plus one per
swept trigger).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable

import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from detectors.config.rag import on_corpus, trigger_names
from detectors.errors import InputError
from detectors.execution import map_units
from detectors.io import file_digest, write_json
from detectors.progress import progress
from detectors.rag.answer_metrics import FAILED, summarise
from detectors.rag.report import curves_table, log_rag_runs, markdown_table, reference_deltas, thresholds_table, versus_always
from detectors.rag.sweep import curves as sweep_curves
from detectors.rag.sweep import operating_point
from detectors.rag.triggers import check_specs
from detectors.registry import store
from detectors.shards import ERROR, OK, ShardStore
from detectors.sources.ids import sample
from pipelines._provenance import code_digest
from pipelines._stage import run, stage_params

log = logging.getLogger("rag_eval")
READS = (
    "llm", "build_early.features.prompt", "build_early.stop", "build_realtime.spacy_model", "rag_eval", "retrorag", "mlflow", "execution",
    "paths.llm", "paths.qa", "paths.registry_early", "paths.registry_realtime", "paths.registry_ctrla", "paths.registry_utility",
    "paths.rag_index", "paths.rag_runs", "paths.rag_metrics", "paths.rag_table", "paths.rag_curves", "paths.rag_prompts",
)  # fmt: skip
SWEEP = "sweep"  # the test sweep's run, and the metrics file's key for the curves
VAL_SWEEP = "sweep-val"  # each corpus's sweep of the validation questions, where every operating threshold is chosen
# rag_eval params that do not shape a run's answers (each configuration, corpus and the sweep are keyed on their own; the
# questions by their ids, the shards by their size; batch_size only groups questions; the rest is reporting)
NOT_KEYED = ("configurations", "frameworks", "corpora", "sweep", "prompts_sample", "experiment", "questions", "batch_size", "shard_size",
             "bootstrap", "seed", "thresholds")  # fmt: skip


def split_questions(qa: pd.DataFrame, split: str, limit: int | None = None) -> pd.DataFrame:
    """The first ``limit`` questions of ``split`` by id hash (all of them for None), in the QA table's order."""
    missing = [c for c in ("id", "question", "answers", "split") if c not in qa.columns]
    if missing:
        raise InputError(f"the QA table lacks columns {missing}: rerun the prepare stage")
    rows = qa[qa["split"] == split].reset_index(drop=True)
    if rows.empty:
        raise InputError(f"the QA table has no {split} question: check qa.splits in params.yaml")
    return sample(rows, limit)


# ---- resumable runs --------------------------------------------------------------------------------------------


def run_questions(directory: Path, key: dict[str, Any], rows: pd.DataFrame, answer: Callable[[list[str], list[bool]], list[dict]],
                  prompts_sample: int, desc: str, shard_size: int) -> list[dict]:  # fmt: skip
    """Answer every row (``id``, ``question``) with ``answer(questions, record_prompts)`` (JSON-able dicts,
    ``dataclasses.asdict`` of RagResults), in resumable shards of ``shard_size`` questions under ``directory`` (a
    :class:`~detectors.shards.ShardStore` keyed on ``key``: what shapes the answers; another key starts it again).
    Each question is a row ``id``, ``status`` (``error: …`` for a question whose loop raised, computed again by the
    next run) and ``line`` (its result as JSON); the first ``prompts_sample`` rows record their prompts. Returns the
    lines of every row, in the rows' order."""
    ids = hashlib.sha256("\x1f".join(rows["id"]).encode()).hexdigest()[:16]  # the shards cover exactly these questions
    store = ShardStore(directory, {**key, "questions_digest": ids, "shard_size": shard_size})
    table = rows[["id", "question"]].reset_index(drop=True)
    todo = store.todo(table, shard_size)
    left = sum(len(chunk) for _, chunk in todo)
    with progress(total=len(table), initial=len(table) - left, desc=desc, unit="question") as bar:
        for k, chunk in todo:
            results = answer(list(chunk["question"]), [i < prompts_sample for i in chunk.index])
            status = [f"{ERROR}{r['error']}" if str(r.get("error") or "").startswith(FAILED) else OK for r in results]
            store.write(k, pd.DataFrame({"id": list(chunk["id"]), "status": status, "line": [json.dumps(r) for r in results]}))
            bar.update(len(chunk))
    frame = store.read_all(len(table), shard_size)
    return [{"id": i, **json.loads(line)} for i, line in zip(frame["id"], frame["line"])]


# ---- thresholds and outputs --------------------------------------------------------------------------


def choose_thresholds(lines: list[dict], triggers: list[str], fixed: dict[str, float]) -> dict[str, float]:
    """Each trigger's operating threshold: the number ``fixed`` gives it, else the most accurate point of its curve on
    the validation sweep's ``lines`` (:func:`~detectors.rag.sweep.operating_point`; +inf when never retrieving is the
    most accurate). Test questions never enter."""
    curves = sweep_curves(lines, [t for t in triggers if t not in fixed])
    return {t: float(fixed[t]) if t in fixed else operating_point(curves[t]) for t in triggers}


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
                    f.write(json.dumps({"corpus": corpus, "configuration": name, "id": line["id"], "prompts": line.get("prompts", [])}) + "\n")


def check_failures(lines: list[dict], what: str, share: float = 0.5) -> None:
    """Stop when most questions of a configuration raised (a systematic fault, not a hard question); their lines stay
    on disk and the next run retries nothing it finished. Fewer failures are counted in the metrics (``failed``)."""
    failed = [line for line in lines if str(line.get("error") or "").startswith(FAILED)]
    if lines and len(failed) > share * len(lines):
        raise RuntimeError(f"{what}: {len(failed)} of {len(lines)} questions failed, e.g. {failed[0]['error']}")


def references(configurations: dict) -> dict[str, str]:
    """The reference configurations every other is compared with: ``never``, the first without triggers; ``always``,
    the first that retrieves once with the question before generating (only ``always``, no post-retrieval)."""
    out = {}
    for name, c in configurations.items():
        if not c.triggers:
            out.setdefault("never", name)
        elif c.triggers == ["always"] and c.query == "question" and not (c.stepwise or c.chunk or c.steering):
            out.setdefault("always", name)
    return out


def evaluate_lines(lines: dict[str, dict[str, list[dict]]], answers: list[list[str]], refs: dict[str, str], bootstrap: int,
                   seed: int) -> dict[str, dict[str, dict]]:  # fmt: skip
    """``{corpus: {configuration: metrics}}`` of the stored lines (one per question, in the order of ``answers``), with
    each configuration's paired accuracy difference to the reference configurations ``refs`` and, with an ``always``
    reference, the retrievals it saves at always's accuracy or the accuracy it loses (:func:`versus_always`)."""
    out = {}
    for corpus, configs in lines.items():
        deltas = reference_deltas(configs, answers, refs, bootstrap, seed)
        out[corpus] = {name: {**summarise(results, answers), **deltas[name]} for name, results in configs.items()}
        if "always" in refs:
            trade = versus_always(out[corpus], refs["always"])
            out[corpus] = {name: {**values, **trade[name]} for name, values in out[corpus].items()}
    return out


class RunWorker:
    """Answers the questions of one run per call (a corpus × configuration at its corpus's ``thresholds``, a framework,
    or a sweep: of the test questions, or of the validation ones), resuming it; builds the LLM, retrievers and triggers
    once (in the stage's process or a Ray actor). Returns the run's lines and the digests that identify what answered
    them."""

    def __init__(self, params, rows: dict[str, pd.DataFrame], base_key: dict[str, Any], thresholds: dict[str, dict[str, float]] | None = None):
        from pipelines._rag_runtime import RagRuntime  # the loop, the retrievers and the LLM

        self.runtime, self.rag, self.rows, self.base_key, self.thresholds = RagRuntime(params), params["rag_eval"], rows, base_key, thresholds
        self.runs_dir = Path(params["paths.rag_runs"])

    def __call__(self, unit: tuple[str, str]) -> dict[str, Any]:
        corpus, name = unit
        runtime, rag = self.runtime, self.rag
        base = {**self.base_key, "llm": runtime.llm_digest, "corpus": runtime.corpus_digest(corpus)}
        out: dict[str, Any] = {"llm": [runtime.llm_name, runtime.llm_digest], "corpus_digest": base["corpus"]}
        directory, desc, rows = self.runs_dir / corpus / name, f"{corpus} · {name}", self.rows["test"]
        if name in (SWEEP, VAL_SWEEP):
            rows = self.rows["val" if name == VAL_SWEEP else "test"]
            sweep_loop, out["triggers"] = runtime.sweep_loop(corpus)
            key = {**base, "sweep": dataclasses.asdict(rag.sweep), "triggers": out["triggers"], "questions": name}
            refs = {q: list(a) for q, a in zip(rows["question"], rows["answers"])}
            answer, sample = (lambda qs, _: sweep_loop(qs, [refs[q] for q in qs])), 0
        elif name in rag.frameworks:  # a seed system with its own loop; its params are the section of its name
            key = {**base, "framework": name, "params": dataclasses.asdict(runtime.stage_params[name])}
            answer, sample = runtime.framework(name, corpus), rag.prompts_sample
        else:
            config = rag.configurations[name]
            names = {n for s in config.triggers for n in trigger_names(s, [corpus])}
            thresholds = {t: v for t, v in self.thresholds[corpus].items() if t in names}
            key = {**base, "configuration": dataclasses.asdict(config), "thresholds": thresholds}
            answer, sample = runtime.loop(name, config, corpus, self.thresholds[corpus]), rag.prompts_sample
        out["lines"] = run_questions(directory, key, rows, answer, sample, desc, rag.shard_size)
        return out


def champion_versions(params) -> dict[str, str]:
    """The version each registered ``<name>@<alias>`` of the configurations points to now (triggers on every corpus and
    honesty steering): part of every run's key, so that moving an alias (``promote``) outside the pipeline makes
    the runs that read it compute again instead of resuming what another version answered."""
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
            raise InputError(f"rag_eval uses {spec}, but {name} is not registered in {params['mlflow'].tracking_uri}: run the register stages "
                             f"first ({err.error_code})") from err  # fmt: skip
        if version is None:
            raise InputError(f"rag_eval uses {spec}, but {name} has no alias {alias!r} in {params['mlflow'].tracking_uri}: run the register stages first")
        out[spec] = str(version.version)
    return out


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "rag_eval")
    rag = params["rag_eval"]
    check_specs([t for config in rag.configurations.values() for t in config.triggers])  # before any work
    qa = pd.read_parquet(params["paths.qa"])
    rows = {"test": split_questions(qa, "test", rag.questions), "val": split_questions(qa, "val")}
    answers = [list(a) for a in rows["test"]["answers"]]
    registries = {k: file_digest(params[f"paths.registry_{k}"]) for k in ("early", "realtime", "ctrla", "utility") if Path(params[f"paths.registry_{k}"]).exists()}
    base_key = {"code": code_digest("pipelines.rag_eval"), "registry": registries, "champions": champion_versions(params), "qa": file_digest(params["paths.qa"]),
                "shared": {k: v for k, v in dataclasses.asdict(rag).items() if k not in NOT_KEYED}}  # fmt: skip
    # first every corpus's validation sweep (the operating thresholds) and the test sweep (the curves)
    sweeps = [(corpus, VAL_SWEEP) for corpus in rag.corpora] + [(rag.sweep.corpus, SWEEP)]
    swept = {sweeps[i]: result for i, result in map_units(sweeps, functools.partial(RunWorker, params, rows, base_key), params["execution"])}
    thresholds = {c: choose_thresholds(swept[(c, VAL_SWEEP)]["lines"], list(swept[(c, VAL_SWEEP)]["triggers"]), rag.thresholds) for c in rag.corpora}
    for corpus, chosen in thresholds.items():
        log.info("%s: thresholds chosen on %d validation questions: %s", corpus, len(rows["val"]), chosen)
    first = rag.corpora[0]
    units = [(corpus, name) for corpus in rag.corpora for name, config in rag.configurations.items() if config.triggers or corpus == first]
    units += [(corpus, name) for corpus in rag.corpora for name in rag.frameworks]
    # a configuration that never retrieves answers the same on every corpus: run once
    worker = functools.partial(RunWorker, params, rows, base_key, thresholds)
    results = {units[i]: result for i, result in map_units(units, worker, params["execution"])}
    lines = {corpus: {**{name: results[(corpus, name) if config.triggers else (first, name)]["lines"] for name, config in rag.configurations.items()},
                      **{name: results[(corpus, name)]["lines"] for name in rag.frameworks}} for corpus in rag.corpora}  # fmt: skip
    for corpus, name in units:
        check_failures(lines[corpus][name], f"{corpus} · {name}")
    refs = references(rag.configurations)
    metrics: dict[str, Any] = evaluate_lines(lines, answers, refs, rag.bootstrap, rag.seed)
    test_sweep = swept[(rag.sweep.corpus, SWEEP)]
    curves = sweep_curves(test_sweep["lines"], list(test_sweep["triggers"]), rag.bootstrap, rag.seed, test_sweep["triggers"])
    metrics[SWEEP] = {"corpus": rag.sweep.corpus, "query": rag.sweep.query, "curves": {t: c.summary() for t, c in curves.items()}}
    metrics["thresholds"] = thresholds
    llm_name, llm_digest = test_sweep["llm"]
    digests = {corpus: result["corpus_digest"] for (corpus, _), result in {**swept, **results}.items()}
    metrics["digests"] = {"llm": llm_digest, "corpora": {c: digests[c] for c in rag.corpora}}
    write_json(params["paths.rag_metrics"], metrics)
    table = {c: metrics[c] for c in rag.corpora}
    markdown = markdown_table(table) + "\n" + thresholds_table(thresholds, len(rows["val"])) + "\n" + curves_table(metrics[SWEEP])
    Path(params["paths.rag_table"]).parent.mkdir(parents=True, exist_ok=True)
    Path(params["paths.rag_table"]).write_text(markdown, encoding="utf-8")
    log.info("RAG evaluation:\n%s", markdown)
    write_curves(params["paths.rag_curves"], curves)
    write_prompts(params["paths.rag_prompts"], lines, rag.prompts_sample)
    configs = {name: dataclasses.asdict(c) for name, c in rag.configurations.items()}
    configs |= {name: {"triggers": [name], "query": name, **dataclasses.asdict(params[name])} for name in rag.frameworks}
    tags = {"llm": llm_name, "llm_digest": llm_digest}
    log_rag_runs(table, metrics[SWEEP], configs, rag.experiment, tags, params["mlflow"].artifact_root, metrics["digests"]["corpora"])


if __name__ == "__main__":
    run(main)
