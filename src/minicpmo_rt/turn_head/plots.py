"""PNG plots (matplotlib, Agg): ROC / PR curves per target and a session timeline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from . import metrics as M
from .data import TARGET_NAMES, SessionData


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_curves(systems: dict[str, tuple[Sequence[SessionData], Sequence[np.ndarray]]], path: Path,
                kind: str = "roc", title: str = "") -> None:
    """One panel per target, one line per system (its AUC or AP in the legend)."""
    plt = _plt()
    cols = 4
    rows = math.ceil(len(TARGET_NAMES) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.6 * rows), squeeze=False)
    for j, name in enumerate(TARGET_NAMES):
        ax = axes[j // cols][j % cols]
        for sys_name, (sessions, probs) in systems.items():
            y = np.concatenate([s.y[s.mask[:, j], j] for s in sessions]) > 0.5
            p = np.concatenate([pr[s.mask[:, j], j] for s, pr in zip(sessions, probs)])
            if y.size == 0 or y.all() or not y.any():
                continue
            if kind == "roc":
                fx, fy = M.roc_curve(y, p)
                ax.plot(fx, fy, label=f"{sys_name} {M.roc_auc(y, p):.2f}")
            else:
                fx, fy = M.pr_curve(y, p)
                ax.plot(fx, fy, label=f"{sys_name} {M.average_precision(y, p):.2f}")
        if kind == "roc":
            ax.plot([0, 1], [0, 1], color="0.7", lw=0.8, ls="--")
            ax.set_xlabel("false positive rate")
            ax.set_ylabel("true positive rate")
        else:
            ax.set_xlabel("recall")
            ax.set_ylabel("precision")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.set_title(name)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right" if kind == "roc" else "lower left")
        else:
            ax.text(0.5, 0.5, "one class only:\nno curve", ha="center", va="center", fontsize=8)
    for j in range(len(TARGET_NAMES), rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_timeline(session: SessionData, probs: np.ndarray, path: Path, model_name: str = "head",
                  max_seconds: float = 120.0) -> None:
    """Labels (shaded) against predicted probabilities for the first ``max_seconds``."""
    plt = _plt()
    n = int(min(session.times.size, round(max_seconds / 0.2)))
    t = session.times[:n]
    panels = [("wearer", "wearer now"), ("partner", "partner now"),
              ("wearer_f2", "wearer\n+0.6-1.2 s"), ("partner_f2", "partner\n+0.6-1.2 s")]
    fig, axes = plt.subplots(len(panels) + 1, 1, figsize=(14, 2.0 * (len(panels) + 1)), sharex=True)
    for ax, (name, label) in zip(axes, panels):
        j = TARGET_NAMES.index(name)
        ax.fill_between(t, 0, session.y[:n, j], step="pre", color="tab:green", alpha=0.3, label="label")
        ax.plot(t, probs[:n, j], color="tab:blue", lw=1.0, label=f"{model_name} p")
        unmasked = ~session.mask[:n, j]
        if unmasked.any():
            ax.fill_between(t, 0, 1, where=unmasked, step="pre", color="0.85", alpha=0.6, label="masked")
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(label, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    ax = axes[-1]
    j = TARGET_NAMES.index("shift")
    ev = np.nonzero(session.mask[:n, j])[0]
    for i in ev:
        shift = session.y[i, j] > 0.5
        ax.scatter(t[i], probs[i, j], marker="^" if shift else "o", color="tab:red" if shift else "tab:gray")
    ax.scatter([], [], marker="^", color="tab:red", label="shift (p shift)")
    ax.scatter([], [], marker="o", color="tab:gray", label="hold (p shift)")
    ax.axhline(0.5, color="0.6", lw=0.8, ls="--")
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("p(shift) at\nshift/hold", fontsize=8)
    ax.set_xlabel("media time (s; redaction gaps skipped, as in the artifact)")
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.suptitle(f"{session.name}: labels vs {model_name} predictions ({session.extractor_mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
