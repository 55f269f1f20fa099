"""The units each level scores, as tables: questions (the early set itself), and the real-time set's
entity tokens, entities and continuations.

A real-time unit row carries ``stats``: for every per-token statistic (``prob``, ``entropy``, the
detector's ``mlp`` probability, ``ctrla_confidence``) the values of the unit's tokens; a continuation
also carries ``entities``, the token indices of each of its entities. Scorers at these levels read
only ``stats`` (and ``entities``), so a new token-level baseline needs no change here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
import pandas as pd

from detectors.interfaces import Level


def realtime_token_stats(
    frame: pd.DataFrame,
    detector_scores: dict[str, np.ndarray] | None = None,
    columns: Iterable[str] = (),
    more_scores: dict[str, dict[str, np.ndarray]] | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """Per record, per generated token: probability, entropy, every list-valued column of ``columns`` (the
    per-token scores joined from other stages' tables, e.g. CtrlA's ``ctrla_confidence*`` or RIND's ``rind``)
    under its own name, ``mlp``, the real-time detector's probability (``detector_scores``, from
    :meth:`~detectors.dior.realtime_detector.RealtimeDetector.record_scores`) when given, and each of
    ``more_scores`` (stat → scores of the same shape: the detector's single seeds, say) under its name."""
    out = {}
    for row in frame[frame["status"] == "ok"].to_dict("records"):
        stats = {
            "prob": np.asarray(row["prob"], dtype=np.float64),
            "entropy": np.asarray(row["entropy"], dtype=np.float64),
        }
        for column in columns:
            if isinstance(row.get(column), (list, np.ndarray)):
                values = np.asarray(row[column], dtype=np.float64)
                if len(values) != len(stats["prob"]):
                    raise ValueError(
                        f"record {row['id']!r}: column {column!r} holds {len(values)} values for {len(stats['prob'])} "
                        f"generated "
                        "tokens; rerun the stage that wrote it on this real-time set"
                    )
                stats[column] = values
        if detector_scores is not None:
            stats["mlp"] = detector_scores[row["id"]]
        for stat, scores in (more_scores or {}).items():
            stats[stat] = scores[row["id"]]
        out[row["id"]] = stats
    return out


def realtime_units(frame: pd.DataFrame, token_stats: dict[str, dict[str, np.ndarray]]) -> dict[Level, pd.DataFrame]:
    """The token, entity and continuation tables of the ok records (columns ``id, group, split, label, status,
    stats``; continuations also ``entities``). ``group`` is the record id at every level: the bootstrap resamples
    continuations, since the tokens of one entity share its label and the entities of one continuation its context. A
    continuation is hallucinated when any of its entities is."""
    tokens, entities, continuations = [], [], []
    for row in frame[frame["status"] == "ok"].itertuples():
        stats = token_stats[row.id]
        base = {"group": row.id, "split": row.split, "status": "ok"}
        labels = np.asarray(row.token_label)
        for i in np.flatnonzero(labels >= 0):
            tokens.append(
                {
                    "id": f"{row.id}:{i}",
                    **base,
                    "label": int(labels[i]),
                    "stats": {k: v[i : i + 1] for k, v in stats.items()},
                }
            )
        spans = []
        for j, ent in enumerate(json.loads(row.entities)):
            idx = np.asarray(ent["tokens"])
            spans.append(idx)
            entities.append(
                {
                    "id": f"{row.id}:e{j}",
                    **base,
                    "label": int(ent["hallucinated"]),
                    "stats": {k: v[idx] for k, v in stats.items()},
                }
            )
        continuations.append({"id": row.id, **base, "label": int(row.label), "stats": stats, "entities": spans})
    return {
        Level.TOKEN: pd.DataFrame(tokens),
        Level.ENTITY: pd.DataFrame(entities),
        Level.CONTINUATION: pd.DataFrame(continuations),
    }
