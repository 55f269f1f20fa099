"""Metrics shared by every scorer: AUROC, AUPRC, accuracy/F1 at a validation threshold, ECE.

Scores are "higher = more likely hallucinated" (label 1). Thresholds are chosen on validation data
only; scores that are not probabilities are mapped to probabilities by a Platt fit on validation.
"""

from __future__ import annotations

import numpy as np
import torch
from torchmetrics.functional.classification import binary_calibration_error


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
    """``fpr, tpr, thresholds`` with thresholds in the scores' own units (predict 1 when score >= t).

    Computed here rather than by torchmetrics, which squashes scores outside [0, 1] with a sigmoid.
    """
    y = np.asarray(labels, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # last index of each distinct score
    tps = np.cumsum(y)[last]
    fps = (last + 1) - tps
    tpr = np.r_[0.0, tps / max(y.sum(), 1.0)]
    fpr = np.r_[0.0, fps / max(len(y) - y.sum(), 1.0)]
    return fpr, tpr, np.r_[np.inf, s[last]]


def auroc(labels, scores) -> float:
    fpr, tpr, _ = roc(labels, scores)
    return float(np.trapezoid(tpr, fpr))


def auprc(labels, scores) -> float:
    """Average precision: sum over thresholds of (recall gain) x precision."""
    y = np.asarray(labels, dtype=np.float64)
    fpr, tpr, _ = roc(labels, scores)
    tp = tpr * y.sum()
    fp = fpr * (len(y) - y.sum())
    precision = np.divide(tp, tp + fp, out=np.ones_like(tp), where=(tp + fp) > 0)
    return float(np.sum(np.diff(tpr) * precision[1:]))


def choose_threshold(labels, scores, strategy: str = "youden") -> float:
    """Threshold on validation scores: Youden's J (tpr - fpr) or best F1."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    require_both_classes(labels, "the validation split")
    if strategy == "youden":
        fpr, tpr, thr = roc(labels, scores)
        return float(thr[1:][int(np.argmax((tpr - fpr)[1:]))])
    if strategy == "f1":
        candidates = np.unique(scores)
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
    """A monotone map score -> probability fitted on validation data (1-D logistic regression with
    Platt's smoothed targets, so separable data still gives probabilities strictly inside (0, 1))."""
    x, y = _t(val_scores), _t(val_labels)
    n_pos, n_neg = float(y.sum()), float(len(y) - y.sum())
    target = torch.where(y > 0, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))
    mu, sd = x.mean(), x.std().clamp_min(1e-8)
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(w[0] * (x - mu) / sd + w[1], target)
        loss.backward()
        return loss

    opt.step(closure)
    a, b = w.detach()
    return lambda s: torch.sigmoid(a * (_t(s) - mu) / sd + b).numpy()


def binary_metrics(labels, scores, threshold: float, probabilities, ece_bins: int = 10) -> dict[str, float]:
    """The comparison metrics of one scorer on one split."""
    labels = np.asarray(labels)
    require_both_classes(labels, "the evaluated split")
    y, p = _t(labels).long(), _t(probabilities).clamp(0, 1)
    pred = np.asarray(scores) >= threshold
    return {
        "auroc": auroc(labels, scores),
        "auprc": auprc(labels, scores),
        "accuracy": float((pred == labels.astype(bool)).mean()),
        "f1": f1_at(labels, scores, threshold),
        "ece": float(binary_calibration_error(p, y, n_bins=ece_bins, norm="l1")),
        "threshold": float(threshold),
        "n": int(len(labels)),
        "positive_rate": float(labels.mean()),
    }
