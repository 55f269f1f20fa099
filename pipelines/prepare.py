"""Stage prepare: materialise the LLM (GGUF converted once) and normalise the QA source into splits."""

from __future__ import annotations

import logging
from pathlib import Path

from detectors.config import load_section
from detectors.llm import prepare_llm, resolve_source
from detectors.qa import SourceError, load_raw, normalize_records, sample, split_of
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("prepare")


def prepare_qa(qa) -> dict:
    raw = load_raw(qa.source, qa.raw_dir)
    table, rejected = normalize_records(raw, qa.source, qa.question_field, qa.answers_field, qa.id_field)
    if table.empty:
        raise SourceError(f"qa.source = {qa.source!r}: no usable record among {len(raw)} ({rejected['reason'].value_counts().to_dict()})")
    table = sample(table, qa.limit)
    table["split"] = table["id"].map(lambda i: split_of(i, qa.splits))
    out = Path(qa.out)
    out.parent.mkdir(parents=True, exist_ok=True)
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
    write_json(out.with_name("qa_report.json"), report)
    return report


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    llm_params, qa_params = load_section("llm", data=data), load_section("qa", data=data)
    resolve_source(llm_params.source, llm_params.gguf_file)  # unknown model: fail before the heavy work
    log.info("QA: %s", prepare_qa(qa_params))
    log.info("LLM: %s", prepare_llm(llm_params))


if __name__ == "__main__":
    main()
