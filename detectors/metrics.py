"""Metrics shared by every scorer: AUROC, AUPRC, accuracy/F1 at a validation threshold, ECE.

Scores are "higher = more likely hallucinated" (label 1). Thresholds are chosen on validation data
only; scores that are not probabilities are mapped to probabilities by a Platt fit on validation.
"""

from __future__ import annotations

import numpy as np
import torch
from torchmetrics.functional.classification import (
    binary_auroc,
    binary_average_precision,
    binary_calibration_error,
    binary_roc,
)


class OneClassError(ValueError):
    """A split holds only one class: AUROC and thresholds are undefined."""


def require_both_classes(labels: np.ndarray, what: str) -> None:
    labels = np.asarray(labels)
    n_pos = int(labels.sum())
    if n_pos == 0 or n_pos == len(labels):
        raise OneClassError(
            f"{what} has only one class ({n_pos} hallucinated of {len(labels)}): AUROC and the threshold are "
            "undefined. Use more questions (qa.limit), another source, or other split ratios."
        )


def _t(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x, dtype=np.float64))


def roc(labels, scores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    fpr, tpr, thr = binary_roc(_t(scores), _t(labels).long(), thresholds=None)
    return fpr.numpy(), tpr.numpy(), thr.numpy()


def choose_threshold(labels, scores, strategy: str = "youden") -> float:
    """Threshold on validation scores: Youden's J (tpr - fpr) or best F1."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    require_both_classes(labels, "the validation split")
    candidates = np.unique(scores)
    if strategy == "youden":
        fpr, tpr, thr = roc(labels, scores)
        return float(thr[int(np.argmax(tpr - fpr))])
    if strategy == "f1":
        f1s = [f1_at(labels, scores, t) for t in candidates]
        return float(candidates[int(np.argmax(f1s))])
    raise ValueError(f"threshold strategy {strategy!r}: use youden or f1")


def f1_at(labels, scores, threshold: float) -> float:
    pred = np.asarray(scores) >= threshold
    labels = np.asarray(labels).astype(bool)
    tp = float((pred & labels).sum())
    denom = float(pred.sum() + labels.sum())
    return 2 * tp / denom if denom else 0.0


def platt(val_labels, val_scores):
    """A monotone map score -> probability fitted on validation data (1-D logistic regression)."""
    x, y = _t(val_scores).float(), _t(val_labels).float()
    mu, sd = x.mean(), x.std().clamp_min(1e-8)
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(w[0] * (x - mu) / sd + w[1], y)
        loss.backward()
        return loss

    opt.step(closure)
    a, b = w.detach()
    return lambda s: torch.sigmoid(a * (_t(s).float() - mu) / sd + b).numpy()


def binary_metrics(labels, scores, threshold: float, probabilities, ece_bins: int = 10) -> dict[str, float]:
    """The comparison metrics of one scorer on one split."""
    labels = np.asarray(labels)
    require_both_classes(labels, "the evaluated split")
    y, s, p = _t(labels).long(), _t(scores), _t(probabilities).clamp(0, 1)
    pred = np.asarray(scores) >= threshold
    return {
        "auroc": float(binary_auroc(s, y)),
        "auprc": float(binary_average_precision(s, y)),
        "accuracy": float((pred == labels.astype(bool)).mean()),
        "f1": f1_at(labels, scores, threshold),
        "ece": float(binary_calibration_error(p, y, n_bins=ece_bins, norm="l1")),
        "threshold": float(threshold),
        "n": int(len(labels)),
        "positive_rate": float(labels.mean()),
    }
