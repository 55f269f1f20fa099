"""Stage prepare_articles: normalise the Wikipedia article source into one table with stable ids and splits."""

from __future__ import annotations

import logging
from pathlib import Path

from detectors.articles import load_articles
from detectors.config import load_section
from detectors.qa import sample, split_of
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("prepare_articles")


def main(argv: list[str] | None = None) -> None:
    params = load_section("articles", data=stage_params(__doc__, argv))
    table, rejected = load_articles(params.source)
    total = len(table)
    table = sample(table, params.limit)
    table["split"] = table["id"].map(lambda i: split_of(i, params.splits))
    out = Path(params.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(out, index=False)
    report = {
        "source": params.source,
        "accepted": total,
        "sampled": int(len(table)),
        "split_sizes": table["split"].value_counts().to_dict(),
        "rejected": int(len(rejected)),
        "rejected_reasons": rejected["reason"].value_counts().to_dict(),
    }
    write_json(out.with_name("articles_report.json"), report)
    log.info("%s", report)


if __name__ == "__main__":
    main()
