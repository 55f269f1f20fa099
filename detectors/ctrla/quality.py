"""How good the CtrlA directions are: held-out statement projections (honesty AUROC per layer and per layer range,
the range chosen on validation) and the confidence monitor as a hallucination scorer (its score columns of the early
and real-time sets). TruthfulQA multiple choice under honesty steering: :mod:`detectors.ctrla.truthfulqa`."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pandas as pd
import torch

from detectors.config.schema import PromptParams
from detectors.ctrla import RANGE_COLUMNS
from detectors.ctrla.directions import Directions
from detectors.ctrla.layer_ranges import choose_window
from detectors.ctrla.monitor import (
    hallucination_score,
    new_content,
    pooled_scores,
    project_sequences,
    trigger_position,
    unconfident,
)
from detectors.ctrla.statements import instruction_prefix, statement_ids
from detectors.evaluation.choice import scored_units
from detectors.evaluation.metrics import auroc
from detectors.llm.kv import batches, forward_rows, prefix_cache
from detectors.llm.layers import LayerTap
from detectors.llm.loading import LLM
from detectors.progress import progress as progress_bar
from detectors.registry import store

log = logging.getLogger(__name__)


def last_token_states(
    llm: LLM, instruction: str, statements: list[str], batch_size: int, max_tokens: int | None
) -> torch.Tensor:
    """Residual stream ``[N, L, H]`` at each statement's last token, after a neutral instruction (chat format)."""
    prefix = instruction_prefix(llm, instruction, chat=bool(getattr(llm.tokenizer, "chat_template", None)))
    rows = statement_ids(llm, statements, max_tokens, len(prefix))
    kv = prefix_cache(llm, prefix)
    n_layers = llm.fingerprint.num_layers
    out = torch.zeros(len(rows), n_layers, llm.fingerprint.hidden_size)
    for idx in progress_bar(list(batches(rows, batch_size)), desc="held-out statements", unit="batch"):
        captured: dict[int, torch.Tensor] = {}
        with LayerTap(
            llm.model,
            list(range(1, n_layers + 1)),
            lambda layer, h: captured.__setitem__(layer, h.detach().float().cpu()),
        ):
            forward_rows(llm, kv, [rows[i] for i in idx])
        for b, i in enumerate(idx):
            out[i] = torch.stack([captured[layer][b, len(rows[i]) - 1] for layer in range(1, n_layers + 1)])
    return out


def projection_scores(states: torch.Tensor, vectors: torch.Tensor, layers: list[int] | None = None) -> np.ndarray:
    """Projections of ``[N, L, H]`` states on per-layer directions ``[L, H]``: ``[N, L]``, or ``[N]`` averaged
    over ``layers`` (1-based, the monitor's pooling) when given."""
    proj = torch.einsum("nlh,lh->nl", states, vectors.float())
    if layers is None:
        return proj.numpy()
    return proj[:, [layer - 1 for layer in layers]].mean(1).numpy()


def early_sequences(
    llm: LLM, frame: pd.DataFrame, prompt: PromptParams
) -> tuple[list[list[int]], list[int], list[str]]:
    """Token ids of prompt + answer per early-set row (the prompt build_early used), the prompt lengths and texts.

    The answer is tokenised after the prompt with a separating space unless the prompt ends in whitespace,
    as the LLM generated it.
    """
    sequences, starts, texts = [], [], []
    for row in frame.itertuples(index=False):
        ids, _ = llm.encode_prompt(str(row.question), prompt)
        text = llm.tokenizer.decode(ids[0])
        answer = str(row.answer or "")
        spaced = answer if (not answer or text[-1:].isspace()) else " " + answer
        answer_ids = llm.tokenizer(spaced, add_special_tokens=False)["input_ids"] if answer else []
        sequences.append(ids[0].tolist() + answer_ids)
        starts.append(ids.shape[1])
        texts.append(text)
    return sequences, starts, texts


@dataclasses.dataclass
class MonitoredSet:
    """Teacher-forced sequences with the monitor's projections at every layer, so that Eq. 2 can be pooled over
    any layer range (the paper's, or a window chosen on validation) without another forward pass."""

    projections: list[np.ndarray]  # per sequence [T, L]: r·v_l at every layer l = 1..L
    starts: list[int]  # position of the first generated (answer) token
    # the generated tokens that are new non-stopword words (CtrlA's trigger looks only at these)
    masks: list[list[bool]]

    def eq2(self, layers: list[int], tau: float, clip: float) -> list[np.ndarray]:
        """Eq. 2 of every position of each sequence, mean-pooled over ``layers`` (1-based)."""
        return [pooled_scores(p, tau, clip, [layer - 1 for layer in layers]) for p in self.projections]

    def answer_scores(self, layers: list[int], tau: float, clip: float) -> np.ndarray:
        """Hallucination score per sequence: ``-min`` Eq. 2 over its new non-stopword generated tokens (all generated
        tokens when none is new; ``-`` Eq. 2 of the last prompt token when nothing was generated)."""
        return np.asarray(
            [
                hallucination_score(s[start:], mask, fallback=-float(s[start - 1]))
                for s, start, mask in zip(self.eq2(layers, tau, clip), self.starts, self.masks)
            ],
            dtype=np.float64,
        )

    def token_scores(self, layers: list[int], tau: float, clip: float) -> list[list[float]]:
        """Hallucination score per generated token: ``-`` Eq. 2 at the token's own position."""
        return [(-s[start:]).astype(float).tolist() for s, start in zip(self.eq2(layers, tau, clip), self.starts)]

    def trigger_rates(self, layers: list[int], tau: float, clip: float, rows: np.ndarray) -> dict[str, float | None]:
        """How often the monitor fires at τ (:func:`~detectors.ctrla.monitor.unconfident`) on the ``rows`` (a boolean
        mask): on generated tokens, on new non-stopword generated tokens, and per sequence as CtrlA's trigger
        (:func:`~detectors.ctrla.monitor.trigger_position`: some new non-stopword token fires)."""
        fired, content, trig = [], [], []
        for keep, s, start, mask in zip(rows, self.eq2(layers, tau, clip), self.starts, self.masks):
            if not keep:
                continue
            below, mask = unconfident(s[start:]), np.asarray(mask, dtype=bool)
            fired.append(below)
            content.append(below[mask])
            trig.append(trigger_position(s[start:], mask) is not None)
        share = lambda parts: round(float(np.concatenate(parts).mean()), 4) if parts and sum(map(len, parts)) else None  # noqa: E731
        return {
            "token": share(fired),
            "new_content_token": share(content),
            "sequence": round(float(np.mean(trig)), 4) if trig else None,
        }


def monitored_set(
    llm: LLM,
    directions: Directions,
    sequences: list[list[int]],
    starts: list[int],
    inputs: list[str],
    batch_size: int,
    desc: str,
) -> MonitoredSet:
    """Projections at every layer of each sequence, and the new-content masks of its generated part
    (:func:`~detectors.ctrla.monitor.new_content`, the RAG loop's: words not in ``inputs[k]``, the task's input q, nor
    earlier in the generation)."""
    layers = list(range(1, llm.fingerprint.num_layers + 1))
    with progress_bar(total=len(sequences), desc=desc, unit="seq") as bar:
        projections = project_sequences(llm, directions, sequences, layers, batch_size, progress=bar)
    masks = [new_content(llm.tokenizer, q, "", seq[start:]) for q, seq, start in zip(inputs, sequences, starts)]
    return MonitoredSet(projections, list(starts), masks)


def early_set(
    llm: LLM, directions: Directions, frame: pd.DataFrame, prompt: PromptParams, batch_size: int
) -> MonitoredSet:
    """The early set's prompt + answer sequences (the prompt build_early used), monitored at every layer; q is the
    question (the prompt's few-shot examples are template, as the loop's passages and template are)."""
    sequences, starts, _ = early_sequences(llm, frame, prompt)
    questions = [str(q) for q in frame["question"]]
    return monitored_set(llm, directions, sequences, starts, questions, batch_size, "confidence (early set)")


def realtime_set(llm: LLM, directions: Directions, frame: pd.DataFrame, batch_size: int) -> MonitoredSet:
    """The real-time set's prompt + generated continuation, monitored at every layer; q is the whole prompt (a
    continuation task has no question: its input is the instruction with the article's opening)."""
    prompts = [list(map(int, p)) for p in frame["prompt_ids"]]
    sequences = [p + list(map(int, g)) for p, g in zip(prompts, frame["gen_ids"])]
    inputs = [llm.tokenizer.decode(p) for p in prompts]
    return monitored_set(
        llm, directions, sequences, [len(p) for p in prompts], inputs, batch_size, "confidence (real-time set)"
    )


# ---- the evaluate_directions stage's metrics ------------------------------------------------------------------


def _auroc(labels, scores) -> float | None:
    labels = np.asarray(labels)
    if len(labels) == 0 or labels.min() == labels.max():
        return None
    return round(auroc(labels, scores), 4)


def _pooled(per_layer: np.ndarray, layers: list[int]) -> np.ndarray:
    """The monitor's and steering's pooling: the mean of the per-layer projections ``[N, L]`` over ``layers``."""
    return per_layer[:, [layer - 1 for layer in layers]].mean(1)


def honesty_metrics(
    llm, honesty: Directions, confidence: Directions, statements: pd.DataFrame, params, max_tokens
) -> dict:
    """Held-out (test) true-vs-false AUROC per layer, for the paper's range and for the window the rule keeps on the
    val statements (:func:`~detectors.ctrla.layer_ranges.choose_window`: the paper's range unless a window is surely
    better; ``choice`` records it), each with its val statements' scores (``validation``, which the registry's champion
    rule compares versions on), and per number of extraction statements."""
    held = statements[(statements["split"] == "test") & statements["label"].notna()]
    if held.empty or held["label"].nunique() < 2:
        log.warning("no held-out statements with both labels: the honesty AUROC is skipped")
        return {}
    states = last_token_states(llm, params.eval_instruction, held["statement"].tolist(), params.batch_size, max_tokens)
    labels = held["label"].astype(int).to_numpy()
    per_layer = projection_scores(states, honesty.vectors)
    ranges = {
        "paper": {
            "layers": honesty.layers,
            "val_auroc": None,
            "test_auroc": _auroc(labels, _pooled(per_layer, honesty.layers)),
        }
    }
    val = statements[(statements["split"] == "val") & statements["label"].notna()]
    val_digest, val_per_layer = None, []
    if val["label"].nunique() == 2:
        val_digest = store.validation_digest(val["id"])
        val_labels = val["label"].astype(int).to_numpy()
        val_states = last_token_states(
            llm, params.eval_instruction, val["statement"].tolist(), params.batch_size, max_tokens
        )
        val_proj = projection_scores(val_states, honesty.vectors)
        val_per_layer = [_auroc(val_labels, val_proj[:, i]) for i in range(val_proj.shape[1])]
        ranges["paper"]["val_auroc"] = _auroc(val_labels, _pooled(val_proj, honesty.layers))
        width = params.layer_window or len(honesty.layers)
        choice = choose_window(
            lambda w: _pooled(val_proj, w),
            val_labels,
            honesty.layers,
            per_layer.shape[1],
            width,
            "evaluate_directions.layer_window",
        )
        ranges["validation"] = {
            "layers": choice.layers,
            "val_auroc": _auroc(val_labels, _pooled(val_proj, choice.layers)),
            "test_auroc": _auroc(labels, _pooled(per_layer, choice.layers)),
            "choice": choice.choice,
        }
        for r in ranges.values():  # what the registry compares a later version on
            r["validation"] = scored_units(val["id"], val_labels, _pooled(val_proj, r["layers"]))
    else:
        log.warning("the val statements lack one of the labels: no honesty layer range is chosen on validation")
    curve = {
        str(n): _auroc(labels, projection_scores(states, v, honesty.layers)) for n, v in sorted(honesty.curve.items())
    }
    curve[str(honesty.config["n_statements"])] = ranges["paper"]["test_auroc"]
    return {
        "n_heldout": int(len(held)),
        "n_val": int(len(val)),
        "auroc_per_layer": [_auroc(labels, per_layer[:, i]) for i in range(per_layer.shape[1])],
        "val_auroc_per_layer": val_per_layer,
        "ranges": ranges,
        # the val statements' ids: the registry compares only versions evaluated on the same ones
        "val_digest": val_digest,
        "auroc_by_n_statements": curve,  # at the paper's range
        "confidence_direction_test_auroc": _auroc(
            labels, projection_scores(states, confidence.vectors, confidence.layers)
        ),
    }


def confidence_metrics(
    monitored: MonitoredSet, frame: pd.DataFrame, confidence: Directions, tau: float, clip: float, width: int | None
) -> tuple[dict, dict[str, np.ndarray]]:
    """The monitor's score columns of the early set per range (``validation``: the window the rule keeps on its val
    split, the paper's range unless a window is surely better; ``choice`` records it), their val/test AUROC, their val
    scores (``validation``, which the registry compares versions on) and how often the monitor fires at τ on the test
    split."""
    split, labels = frame["split"].to_numpy(), frame["label"].to_numpy()
    val, test = split == "val", split == "test"
    choice = choose_window(
        lambda w: monitored.answer_scores(w, tau, clip)[val],
        labels[val],
        confidence.layers,
        confidence.fingerprint.num_layers,
        width or len(confidence.layers),
        "evaluate_directions.layer_window",
    )
    layers = {"paper": confidence.layers, "validation": choice.layers}
    if choice.val_auroc is None:
        log.warning(
            "the early set's val split lacks one of the labels: no confidence layer range is chosen on validation"
        )
        del layers["validation"]
    metrics: dict = {
        "n": int(len(frame)),
        "n_test": int(test.sum()),
        "val_digest": store.validation_digest(frame.loc[val, "id"]),
        "ranges": {},
    }
    columns = {}
    for name, chosen in layers.items():
        scores = columns[RANGE_COLUMNS[name]] = monitored.answer_scores(chosen, tau, clip)
        rates = monitored.trigger_rates(chosen, tau, clip, test)
        metrics["ranges"][name] = {
            "layers": chosen,
            "val_auroc": _auroc(labels[val], scores[val]),
            "test_auroc": _auroc(labels[test], scores[test]),
            "test_trigger_rate": rates["sequence"],
            "test_token_trigger_rate": rates["token"],
            "validation": scored_units(frame.loc[val, "id"], labels[val], scores[val]),
        }
    if "validation" in metrics["ranges"]:
        metrics["ranges"]["validation"]["choice"] = choice.choice
    return metrics, columns


def realtime_metrics(
    monitored: MonitoredSet, frame: pd.DataFrame, layers: dict[str, list[int]], tau: float, clip: float
) -> tuple[dict, dict]:
    """Per-token score columns of the real-time set per range, and how often the monitor fires on its test split."""
    test = frame["split"].to_numpy() == "test"
    metrics: dict = {"n": int(len(frame)), "n_test": int(test.sum()), "ranges": {}}
    columns = {}
    for name, chosen in layers.items():
        columns[RANGE_COLUMNS[name]] = monitored.token_scores(chosen, tau, clip)
        rates = monitored.trigger_rates(chosen, tau, clip, test)
        metrics["ranges"][name] = {
            "layers": chosen,
            "test_token_trigger_rate": rates["token"],
            "test_new_content_token_trigger_rate": rates["new_content_token"],
            "test_continuation_trigger_rate": rates["sequence"],
        }
    return metrics, columns
