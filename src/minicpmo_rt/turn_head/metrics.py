"""Binary classification metrics in numpy (no scikit-learn): ROC/PR curves, ROC-AUC with
tie handling, average precision, balanced accuracy and weighted F1 at a 0.5 threshold (VAP's
convention: the mean of per-class recalls, and F1 per class weighted by class support)."""

from __future__ import annotations

import math

import numpy as np


def roc_curve(y: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) from the highest threshold down; tied scores form one step."""
    y = np.asarray(y, bool)
    order = np.argsort(-np.asarray(score, np.float64), kind="stable")
    s, yy = np.asarray(score, np.float64)[order], y[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # last index of each tie group
    tp = np.cumsum(yy)[last]
    fp = (last + 1) - tp
    pos, neg = max(int(y.sum()), 1), max(int((~y).sum()), 1)
    return np.r_[0.0, fp / neg], np.r_[0.0, tp / pos]


def roc_auc(y: np.ndarray, score: np.ndarray) -> float:
    """Mann-Whitney AUC (ties count one half); NaN when one class is absent."""
    y = np.asarray(y, bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return math.nan
    s = np.asarray(score, np.float64)
    order = np.argsort(s, kind="stable")
    ranks = np.empty(s.size)
    sorted_s = s[order]
    # average ranks over ties
    starts = np.r_[0, np.nonzero(np.diff(sorted_s))[0] + 1]
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def pr_curve(y: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(recall, precision) from the highest threshold down."""
    y = np.asarray(y, bool)
    order = np.argsort(-np.asarray(score, np.float64), kind="stable")
    s, yy = np.asarray(score, np.float64)[order], y[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]
    tp = np.cumsum(yy)[last]
    precision = tp / (last + 1)
    recall = tp / max(int(y.sum()), 1)
    return np.r_[0.0, recall], np.r_[1.0, precision]


def average_precision(y: np.ndarray, score: np.ndarray) -> float:
    y = np.asarray(y, bool)
    if not y.any():
        return math.nan
    r, p = pr_curve(y, score)
    return float(np.sum(np.diff(r) * p[1:]))


def balanced_accuracy(y: np.ndarray, pred: np.ndarray) -> float:
    y, pred = np.asarray(y, bool), np.asarray(pred, bool)
    recalls = [float((pred[y == c] == c).mean()) for c in (False, True) if (y == c).any()]
    return float(np.mean(recalls)) if recalls else math.nan


def weighted_f1(y: np.ndarray, pred: np.ndarray) -> float:
    y, pred = np.asarray(y, bool), np.asarray(pred, bool)
    if y.size == 0:
        return math.nan
    total = 0.0
    for c in (False, True):
        tp = float(((pred == c) & (y == c)).sum())
        fp = float(((pred == c) & (y != c)).sum())
        fn = float(((pred != c) & (y == c)).sum())
        f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn > 0 else 0.0
        total += f1 * float((y == c).sum())
    return total / y.size


def binary_report(y: np.ndarray, prob: np.ndarray, threshold: float = 0.5) -> dict[str, float]:
    y = np.asarray(y, bool)
    pred = np.asarray(prob) >= threshold
    return {"n": int(y.size), "positives": int(y.sum()),
            "balanced_accuracy": balanced_accuracy(y, pred), "weighted_f1": weighted_f1(y, pred),
            "roc_auc": roc_auc(y, prob), "average_precision": average_precision(y, prob)}
