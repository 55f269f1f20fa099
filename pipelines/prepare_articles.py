"""Stage prepare_articles: normalise the Wikipedia article source into one table with stable ids and splits."""

from __future__ import annotations

import logging
from pathlib import Path

from detectors.io import write_json
from detectors.sources.articles import load_articles
from detectors.sources.ids import sample, split_of
from pipelines._stage import run, stage_params

log = logging.getLogger("prepare_articles")
READS = ("articles", "paths.articles", "paths.articles_report")
OUTS = (
    "${paths.articles}",
    ("${paths.articles_report}", {"cache": False}),
)


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "prepare_articles")
    articles = params["articles"]
    table, rejected = load_articles(articles.source)
    total = len(table)
    table = sample(table, articles.limit)
    table["split"] = table["id"].map(lambda i: split_of(i, articles.splits))
    out = Path(params["paths.articles"])
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(out, index=False)
    report = {
        "source": articles.source,
        "accepted": total,
        "sampled": int(len(table)),
        "split_sizes": table["split"].value_counts().to_dict(),
        "rejected": int(len(rejected)),
        "rejected_reasons": rejected["reason"].value_counts().to_dict(),
    }
    write_json(params["paths.articles_report"], report)
    log.info("%s", report)


if __name__ == "__main__":
    run(main)
