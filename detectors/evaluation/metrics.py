"""Metrics shared by every scorer: AUROC, AUPRC, accuracy/F1 at a validation threshold, ECE.

Scores are "higher = more likely hallucinated" (label 1). Thresholds are chosen on validation data
only; scores that are not probabilities are mapped to probabilities by a Platt fit on validation.
"""

from __future__ import annotations

import numpy as np
import torch
from torchmetrics.functional.classification import binary_calibration_error

from detectors.errors import InputError


class OneClassError(InputError, ValueError):
    """A split holds only one class: AUROC and thresholds are undefined."""


ONE_CLASS_FIX = "Use more questions (qa.limit), another source, or other split ratios."


def require_both_classes(
    labels: np.ndarray, what: str, positive: str = "hallucinated", fix: str = ONE_CLASS_FIX
) -> None:
    """Raise :class:`OneClassError` (one line: ``what``, how many of ``labels`` are ``positive``, then ``fix``) when
    ``labels`` hold only 0s or only 1s. A caller whose label 1 means something else (retrieval ``helps``) or whose
    fix is another setting names them."""
    labels = np.asarray(labels)
    n_pos = int(labels.sum())
    if n_pos == 0 or n_pos == len(labels):
        raise OneClassError(
            f"{what} has only one class ({n_pos} {positive} of {len(labels)}): AUROC and the threshold are "
            f"undefined. {fix}"
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


def precision_recall(labels, scores) -> tuple[np.ndarray, np.ndarray]:
    """``recall, precision`` at every distinct threshold (predict 1 when score >= t), from recall 0."""
    y = np.asarray(labels, dtype=np.float64)
    fpr, tpr, _ = roc(labels, scores)
    tp, fp = tpr * y.sum(), fpr * (len(y) - y.sum())
    precision = np.divide(tp, tp + fp, out=np.ones_like(tp), where=(tp + fp) > 0)
    return tpr, precision


def auprc(labels, scores) -> float:
    """Average precision: sum over thresholds of (recall gain) x precision."""
    recall, precision = precision_recall(labels, scores)
    return float(np.sum(np.diff(recall) * precision[1:]))


def choose_threshold(labels, scores, strategy: str = "youden") -> float:
    """Threshold on validation scores: Youden's J (tpr - fpr), best F1, or ``prevalence``, the fixed target: the score
    at which the share of validation units at or above it is nearest the share of hallucinated ones (ties: the higher
    score). Youden's J and F1 take the best of every threshold, and on a few hundred units their flat maxima let the
    choice jump between runs; the prevalence target moves only as far as the scores' own quantile does."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    require_both_classes(labels, "the validation split")
    if strategy == "prevalence":
        candidates = np.unique(scores)[::-1]  # descending: the share at or above each grows
        shares = np.searchsorted(np.sort(scores), candidates, side="left")
        shares = (len(scores) - shares) / len(scores)
        return float(candidates[int(np.argmin(np.abs(shares - labels.mean())))])
    if strategy == "youden":
        fpr, tpr, thr = roc(labels, scores)
        return float(thr[1:][int(np.argmax((tpr - fpr)[1:]))])
    if strategy == "f1":
        candidates = np.unique(scores)
        f1s = [f1_at(labels, scores, t) for t in candidates]
        return float(candidates[int(np.argmax(f1s))])
    raise ValueError(f"threshold strategy {strategy!r}: use youden, f1 or prevalence")


def f1_at(labels, scores, threshold: float) -> float:
    pred = np.asarray(scores) >= threshold
    labels = np.asarray(labels).astype(bool)
    tp = float((pred & labels).sum())
    denom = float(pred.sum() + labels.sum())
    return 2 * tp / denom if denom else 0.0


def fit_logistic(features, labels, l2: float = 1e-3, smooth: bool = True):
    """L2-regularised logistic regression on standardised features; returns ``x -> P(label 1)``.

    With ``smooth``, Platt's targets (N+1)/(N+2) and 1/(N+2) keep separable data from giving
    probabilities of exactly 0 or 1.
    """
    x = _t(features)
    x = x[:, None] if x.ndim == 1 else x
    y = _t(labels)
    n_pos, n_neg = float(y.sum()), float(len(y) - y.sum())
    target = torch.where(y > 0, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2)) if smooth else y
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-8)
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logits = ((x - mu) / sd) @ w[:-1] + w[-1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    coef = w.detach()

    def predict(z) -> np.ndarray:
        z = _t(z)
        z = z[:, None] if z.ndim == 1 else z
        return torch.sigmoid(((z - mu) / sd) @ coef[:-1] + coef[-1]).numpy()

    return predict


def platt(val_labels, val_scores):
    """A monotone map score -> probability fitted on validation data (1-D logistic regression)."""
    return fit_logistic(val_scores, val_labels, l2=0.0)


def first_hit(hits) -> int | None:
    """The first position where ``hits`` (booleans: a score at or over a threshold, a token that fires) is true; None
    when none is: where a trigger fires in a segment."""
    found = np.flatnonzero(np.asarray(hits, dtype=bool))
    return int(found[0]) if len(found) else None


def trigger_rate(scores, threshold: float) -> float:
    """Share of units whose score reaches ``threshold`` (how often the scorer would fire as a trigger)."""
    return float((np.asarray(scores, dtype=np.float64) >= threshold).mean())


def binary_metrics(labels, scores, threshold: float, probabilities, ece_bins: int = 10) -> dict[str, float]:
    """The comparison metrics of one scorer on one split (its AUROC interval: :mod:`detectors.evaluation.bootstrap`)."""
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
        "trigger_rate": trigger_rate(scores, threshold),
        "n": int(len(labels)),
        "positive_rate": float(labels.mean()),
    }
