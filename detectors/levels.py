"""Token-, entity- and continuation-level score tables of the real-time set.

Every score is a hallucination score (higher = more likely hallucinated), so one evaluation serves
all of them. Training-free scores follow their papers: FLARE (token probability; at the sentence
level its trigger, the least probable token of the whole continuation), Stitch-in-Time (MIN, AVG
and normalised product of an entity's token probabilities), token entropy.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

# name: (token score it reads, how the tokens of a unit become one hallucination score)
TOKEN_RULES = {
    "mlp": ("mlp", lambda v: v),
    "flare": ("prob", lambda p: 1 - p),
    "token_entropy": ("entropy", lambda v: v),
    "ctrla_confidence": ("ctrla_confidence", lambda v: v),
}
ENTITY_RULES = {
    "mlp": ("mlp", np.max),
    "sit_min": ("prob", lambda p: 1 - p.min()),
    "sit_avg": ("prob", lambda p: 1 - p.mean()),
    "sit_norm": ("prob", lambda p: 1 - np.exp(np.log(np.clip(p, 1e-12, None)).mean())),
    "token_entropy": ("entropy", np.max),
    "ctrla_confidence": ("ctrla_confidence", np.max),
}


def level_tables(frame: pd.DataFrame, token_scores: dict[str, dict[str, np.ndarray]]) -> dict[str, pd.DataFrame]:
    """The three tables (columns ``id``, ``split``, ``label``, ``status`` and one per score).

    ``token_scores[record_id][name]`` holds a score for every generated token of the record:
    ``mlp`` (may be NaN off entities), ``prob``, ``entropy`` and optionally ``ctrla_confidence``.
    A continuation is hallucinated when any of its entities is; it scores the max over its entities.
    """
    tokens, entities, sentences = [], [], []
    for row in frame[frame["status"] == "ok"].itertuples():
        scores = {k: np.asarray(v, dtype=np.float64) for k, v in token_scores[row.id].items()}
        base = {"split": row.split, "status": "ok"}
        labels = np.asarray(row.token_label)
        for i in np.flatnonzero(labels >= 0):
            rules = {name: float(fn(scores[src][i])) for name, (src, fn) in TOKEN_RULES.items() if src in scores}
            tokens.append({"id": f"{row.id}:{i}", **base, "label": int(labels[i]), **rules})
        ents = []
        for j, ent in enumerate(json.loads(row.entities)):
            idx = np.asarray(ent["tokens"])
            rules = {name: float(fn(scores[src][idx])) for name, (src, fn) in ENTITY_RULES.items() if src in scores}
            ents.append({"id": f"{row.id}:e{j}", **base, "label": int(ent["hallucinated"]), **rules})
        entities += ents
        sentence = {"id": row.id, **base, "label": int(row.label), "flare": float(1 - scores["prob"].min())}
        sentence |= {name: max(e[name] for e in ents) for name in ENTITY_RULES if name in ents[0]}
        sentences.append(sentence)
    return {"token": pd.DataFrame(tokens), "entity": pd.DataFrame(entities), "sentence": pd.DataFrame(sentences)}
