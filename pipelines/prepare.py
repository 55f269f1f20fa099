"""Stage prepare: materialise the LLM (GGUF converted once) and normalise the QA source into splits."""

from __future__ import annotations

import logging
from pathlib import Path

from detectors.errors import SourceError
from detectors.io import write_json
from detectors.llm.loading import prepare_llm, resolve_source
from detectors.sources.ids import sample, split_of
from detectors.sources.qa import load_raw, normalize_records
from pipelines._stage import run, stage_params

log = logging.getLogger("prepare")
READS = ("llm", "qa", "paths.llm", "paths.raw", "paths.qa", "paths.qa_report")
OUTS = (
    "${paths.llm}",
    "${paths.qa}",
    ("${paths.qa_report}", {"cache": False}),
)


def prepare_qa(qa, raw_dir: str, out: str, report_path: str) -> dict:
    raw = load_raw(qa.source, raw_dir)
    table, rejected = normalize_records(raw, qa.source, qa.question_field, qa.answers_field, qa.id_field)
    if table.empty:
        raise SourceError(
            f"qa.source = {qa.source!r}: no usable record among {len(raw)} "
            f"({rejected['reason'].value_counts().to_dict()})"
        )
    table = sample(table, qa.limit)
    table["split"] = table["id"].map(lambda i: split_of(i, qa.splits))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(out, index=False)
    report = {
        "source": qa.source,
        "raw_records": len(raw),
        "accepted": int(len(table)),
        "split_sizes": table["split"].value_counts().to_dict(),
        "rejected": int(len(rejected)),
        "rejected_reasons": rejected["reason"].value_counts().to_dict(),
        "rejected_examples": rejected.head(20).to_dict("records"),
    }
    write_json(report_path, report)
    return report


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "prepare")
    llm = params["llm"]
    resolve_source(llm.source, llm.gguf_file)  # unknown model: fail before the heavy work
    log.info("QA: %s", prepare_qa(params["qa"], params["paths.raw"], params["paths.qa"], params["paths.qa_report"]))
    log.info("LLM: %s", prepare_llm(llm.source, params["paths.llm"], llm.gguf_file))


if __name__ == "__main__":
    run(main)
