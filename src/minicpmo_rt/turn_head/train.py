"""Train a turn head on feature artifacts, evaluate it against baselines, write metrics and plots.

Loss: per target, a masked binary cross-entropy with ``pos_weight = negatives/positives`` on the
training rows (so the 0.5 threshold that balanced accuracy and weighted F1 use sits near the
balanced operating point), averaged over targets so the rare shift/hold rows are not drowned.
AdamW, random crops of ``crop`` rows from the training sessions, early stopping on the
validation loss (whole sessions, causal), the best epoch's weights kept.

Baselines, scored on exactly the same rows:

- ``majority``: the training set's majority class for every target (AUC 0.5 by construction).
- ``last_speaker``: whoever last spoke alone keeps the floor. Now-targets use the previous
  row's last speaker (the current row's would be the label itself); future bins use the
  current row's; shift/hold always predicts hold.
- ``vad_head``: a linear head on the labelled voice activity alone (wearer and partner flags of
  the current and previous ``vad_history - 1`` rows). It is an oracle for the now-targets (its
  input is their label); compare with it on the future bins and shift/hold.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..atomic import check_output_path, temp_dir_beside
from ..errors import InputError
from . import metrics as M
from .data import DEFAULT_SPLIT, NOW_NAMES, TARGET_NAMES, SessionData, SplitError, load_sessions, split_sessions
from .models import HeadConfig, build_head

Features = Callable[[SessionData], np.ndarray]


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tcn"
    hidden: int = 64
    layers: int = 3
    dropout: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 1e-2
    epochs: int = 60
    patience: int = 8
    batch_size: int = 16
    crop: int = 256
    min_steps: int = 20         # optimizer steps per epoch at least (small training sets)
    seed: int = 0
    split: str = DEFAULT_SPLIT
    vad_history: int = 10
    progress: bool = True
    device: str = "cpu"
    plots: bool = True

    def check(self) -> None:
        """Name the flag of a value the training cannot use, before any data is read (torch would fail
        later with a bare ValueError, a division by zero, or silently train nothing)."""
        def need(ok: bool, flag: str, value, what: str) -> None:
            if not ok:
                raise InputError(f"{flag} {value}: must be {what}")

        need(self.model in ("linear", "tcn", "gru"), "--model", self.model, "one of linear, tcn, gru")
        for flag, value in (("--hidden", self.hidden), ("--layers", self.layers), ("--epochs", self.epochs),
                            ("--patience", self.patience), ("--batch-size", self.batch_size), ("--crop", self.crop),
                            ("--vad-history", self.vad_history)):
            need(value >= 1, flag, value, "an integer >= 1")
        need(self.min_steps >= 0, "--min-steps", self.min_steps, "an integer >= 0")
        need(math.isfinite(self.lr) and self.lr > 0, "--lr", self.lr, "a positive number")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "--weight-decay", self.weight_decay,
             "a number >= 0")
        need(0 <= self.dropout < 1, "--dropout", self.dropout, "in [0, 1)")


def state_features(s: SessionData) -> np.ndarray:
    return s.states


def vad_features(history: int) -> Features:
    def fn(s: SessionData) -> np.ndarray:
        vad = np.stack([s.targets["wearer"], s.targets["partner"]], 1).astype(np.float32)
        vad *= s.targets["valid_now"][:, None]
        cols = [np.concatenate([np.zeros((j, 2), np.float32), vad[:vad.shape[0] - j]]) for j in range(history)]
        return np.concatenate(cols, 1)
    return fn


def _pos_weight(train: Sequence[SessionData]) -> torch.Tensor:
    y = np.concatenate([s.y for s in train])
    m = np.concatenate([s.mask for s in train])
    pos = (y * m).sum(0)
    neg = m.sum(0) - pos
    w = np.where((pos > 0) & (neg > 0), neg / np.maximum(pos, 1), 1.0)
    return torch.tensor(np.clip(w, 1e-2, 1e2), dtype=torch.float32)


def masked_loss(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                pos_weight: torch.Tensor) -> torch.Tensor:
    """Mean over targets (that have rows) of each target's masked, pos-weighted BCE."""
    raw = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight, reduction="none")
    m = mask.float()
    count = m.sum(dim=tuple(range(m.ndim - 1)))
    per = (raw * m).sum(dim=tuple(range(m.ndim - 1))) / count.clamp_min(1)
    present = count > 0
    return per[present].mean() if bool(present.any()) else logits.sum() * 0.0


def _crops(train: Sequence[SessionData], feats: list[np.ndarray], crop: int, rng: np.random.Generator,
           at_least: int) -> list[tuple[int, int]]:
    """Random crop starts, about one pass over the rows (``at_least`` crops in all)."""
    sizes = np.array([f.shape[0] for f in feats])
    per = np.maximum(1, np.ceil(sizes / crop)).astype(int)
    reps = max(1, math.ceil(at_least / per.sum()))
    out = [(j, int(rng.integers(0, max(1, sizes[j] - crop + 1))))
           for j in range(len(feats)) for _ in range(per[j] * reps)]
    rng.shuffle(out)
    return out


def _batch(items, train, feats, crop):
    d = feats[0].shape[1]
    n = len(items)
    x = np.zeros((n, crop, d), np.float32)
    y = np.zeros((n, crop, len(TARGET_NAMES)), np.float32)
    m = np.zeros((n, crop, len(TARGET_NAMES)), bool)
    for b, (j, a) in enumerate(items):
        seg = feats[j][a:a + crop]
        x[b, :len(seg)] = seg
        y[b, :len(seg)] = train[j].y[a:a + crop]
        m[b, :len(seg)] = train[j].mask[a:a + crop]
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(m)


@torch.no_grad()
def predict(model: torch.nn.Module, sessions: Sequence[SessionData], features: Features) -> list[np.ndarray]:
    """Probabilities [T, C] per session, each session run whole (the heads are causal)."""
    model.eval()
    dev = next(model.parameters()).device
    return [torch.sigmoid(model(torch.from_numpy(features(s)).float()[None].to(dev)))[0].cpu().numpy()
            for s in sessions]


def _eval_loss(model, sessions, features, pos_weight) -> float:
    model.eval()
    with torch.no_grad():
        dev = pos_weight.device
        losses = [float(masked_loss(model(torch.from_numpy(features(s)).float()[None].to(dev))[0],
                                    torch.from_numpy(s.y).to(dev), torch.from_numpy(s.mask).to(dev), pos_weight))
                  for s in sessions]
    return float(np.mean(losses))


def fit_head(train: Sequence[SessionData], val: Sequence[SessionData], cfg: TrainConfig,
             features: Features = state_features, kind: str | None = None,
             desc: str = "head") -> tuple[torch.nn.Module, list[dict[str, float]], HeadConfig]:
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    feats = [features(s).astype(np.float32, copy=False) for s in train]
    # streaming mean/std over the non-initialisation rows (no concatenated copy of a big root)
    s1, s2, count = np.zeros(feats[0].shape[1]), np.zeros(feats[0].shape[1]), 0
    for f, s in zip(feats, train):
        rows = f[~s.init_mask].astype(np.float64)
        s1, s2, count = s1 + rows.sum(0), s2 + (rows ** 2).sum(0), count + rows.shape[0]
    mean = s1 / max(count, 1)
    std = np.sqrt(np.maximum(s2 / max(count, 1) - mean ** 2, 0.0))
    hcfg = HeadConfig(kind=kind or cfg.model, in_dim=feats[0].shape[1], num_targets=len(TARGET_NAMES),
                      hidden=cfg.hidden, layers=cfg.layers, dropout=cfg.dropout)
    model = build_head(hcfg).to(cfg.device)
    model.norm.set_stats(torch.from_numpy(mean).float().to(cfg.device), torch.from_numpy(std).float().to(cfg.device))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    pw = _pos_weight(train).to(cfg.device)
    crop = min(cfg.crop, max(f.shape[0] for f in feats))
    # a manual bar: one wrapping the epoch range syncs its count lazily, so a postfix set inside the loop showed
    # a stale 0/N for fast heads; the with closes it also when early stopping breaks out
    best, best_state, bad, history = math.inf, None, 0, []
    with tqdm(total=cfg.epochs, desc=desc, leave=False, unit="epoch", disable=not cfg.progress) as bar:
        for epoch in range(cfg.epochs):
            model.train()
            items = _crops(train, feats, crop, rng, cfg.min_steps * cfg.batch_size)
            total = 0.0
            for k in range(0, len(items), cfg.batch_size):
                x, y, m = _batch(items[k:k + cfg.batch_size], train, feats, crop)
                x, y, m = x.to(cfg.device), y.to(cfg.device), m.to(cfg.device)
                loss = masked_loss(model(x), y, m, pw)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                total += float(loss.detach()) * len(x)
            vloss = _eval_loss(model, val, features, pw)
            history.append({"epoch": epoch, "train_loss": total / len(items), "val_loss": vloss})
            bar.set_postfix(train=f"{total / len(items):.4f}", val=f"{vloss:.4f}", refresh=False)
            bar.update(1)
            if vloss < best - 1e-5:
                best, bad = vloss, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                bad += 1
                if bad >= cfg.patience:
                    break
    if best_state is not None:
        model.load_state_dict(best_state)
    return model, history, hcfg


def majority_probs(train: Sequence[SessionData], sessions: Sequence[SessionData]) -> list[np.ndarray]:
    y = np.concatenate([s.y for s in train])
    m = np.concatenate([s.mask for s in train])
    rate = (y * m).sum(0) / np.maximum(m.sum(0), 1)
    const = (rate >= 0.5).astype(np.float32)
    return [np.broadcast_to(const, s.y.shape).copy() for s in sessions]


def last_speaker_probs(sessions: Sequence[SessionData], wearer_id: int = 2) -> list[np.ndarray]:
    out = []
    for s in sessions:
        cur = s.targets["last_speaker"].astype(np.int64)
        prev = np.r_[-1, cur[:-1]]
        p = np.zeros(s.y.shape, np.float32)
        for j, name in enumerate(TARGET_NAMES):
            if name == "shift":
                continue  # the last speaker continues: always hold
            last = prev if name in NOW_NAMES else cur
            who = last == wearer_id if name.startswith("wearer") else (last >= 0) & (last != wearer_id)
            p[:, j] = who
        out.append(p)
    return out


def evaluate(sessions: Sequence[SessionData], probs: Sequence[np.ndarray]) -> dict[str, dict[str, float]]:
    report = {}
    for j, name in enumerate(TARGET_NAMES):
        y = np.concatenate([s.y[s.mask[:, j], j] for s in sessions])
        p = np.concatenate([pr[s.mask[:, j], j] for s, pr in zip(sessions, probs)])
        report[name] = M.binary_report(y > 0.5, p)
    return report


def format_table(results: dict[str, dict[str, dict[str, float]]], title: str) -> str:
    systems = list(results)
    head = f"{'target':12s}" + "".join(f" | {s[:17]:>17s}" for s in systems)
    sub = f"{'':12s}" + "".join(f" | {'AUC   BA    wF1':>17s}" for _ in systems)
    lines = [title, head, sub, "-" * len(head)]

    def fmt(x: float) -> str:
        return " nan " if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    for name in TARGET_NAMES:
        row = f"{name:12s}"
        for s in systems:
            r = results[s][name]
            row += f" | {fmt(r['roc_auc'])} {fmt(r['balanced_accuracy'])} {fmt(r['weighted_f1'])}"
        lines.append(row)
    n = results[systems[0]]["shift"]
    lines.append(f"shift/hold events scored: {n['n']} ({n['positives']} shifts); "
                 f"AUC = ROC-AUC, BA = balanced accuracy, wF1 = weighted F1 (threshold 0.5)")
    return "\n".join(lines)


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def _prepare_out(out: Path, force: bool) -> Path:
    check_output_path(out, "--out", directory=True)
    if out.exists() and any(out.iterdir()) and not force:
        raise InputError(f"{out}: output directory exists and is not empty; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    return temp_dir_beside(out, prefix=f".{out.name}.", suffix=".tmp")


def _publish(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _run_split(sessions: list[SessionData], parts: dict[str, list[SessionData]], cfg: TrainConfig,
               where: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Train, evaluate and write one split's files into ``where``; returns its metrics."""
    model, history, hcfg = fit_head(parts["train"], parts["val"], cfg, desc=cfg.model)
    vad, vad_history, _ = fit_head(parts["train"], parts["val"], cfg,
                                   features=vad_features(cfg.vad_history), kind="linear", desc="vad")
    results: dict[str, Any] = {}
    curves: dict[str, dict[str, tuple[list[SessionData], list[np.ndarray]]]] = {}
    for split in ("val", "test"):
        ss = parts[split]
        if not ss:
            continue
        systems = {
            cfg.model: predict(model, ss, state_features),
            "vad_head": predict(vad, ss, vad_features(cfg.vad_history)),
            "last_speaker": last_speaker_probs(ss),
            "majority": majority_probs(parts["train"], ss),
        }
        results[split] = {name: evaluate(ss, probs) for name, probs in systems.items()}
        curves[split] = {name: (ss, probs) for name, probs in systems.items()}
    shown = "test" if "test" in results else "val"
    table = format_table(results[shown], f"{shown} sessions: {', '.join(s.name for s in parts[shown])}")
    echo(table)
    metrics = {
        "config": asdict(cfg), "head": asdict(hcfg), "feature_dim": sessions[0].dim,
        "extractor_modes": sorted({s.extractor_mode for s in sessions}),
        "sessions": {k: [s.name for s in v] for k, v in parts.items()},
        "rows": {k: int(sum(s.states.shape[0] for s in v)) for k, v in parts.items()},
        "targets": list(TARGET_NAMES), "history": history, "vad_history": vad_history,
        "results": results,
    }
    where.mkdir(parents=True, exist_ok=True)
    (where / "metrics.json").write_text(json.dumps(_nan_to_none(metrics), indent=2))
    (where / "table.txt").write_text(table + "\n")
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save({"head": asdict(hcfg), "state_dict": state, "targets": list(TARGET_NAMES), "config": asdict(cfg)},
               where / "head.pt")
    if cfg.plots:
        from .plots import plot_curves, plot_timeline

        for split, systems in curves.items():
            plot_curves(systems, where / f"roc_{split}.png", kind="roc", title=f"ROC, {split}")
            plot_curves(systems, where / f"pr_{split}.png", kind="pr", title=f"precision-recall, {split}")
        ss, probs = curves[shown][cfg.model]
        plot_timeline(ss[0], probs[0], where / f"timeline_{ss[0].name}.png", model_name=cfg.model)
    return metrics


def _fold_summary(folds: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and std over folds of each system's test metrics, per target."""
    out: dict[str, Any] = {}
    for system in folds[0]["results"]["test"]:
        out[system] = {}
        for name in TARGET_NAMES:
            out[system][name] = {}
            for key in ("roc_auc", "balanced_accuracy", "weighted_f1", "average_precision"):
                vals = np.array([f["results"]["test"][system][name][key] for f in folds], dtype=np.float64)
                vals = vals[~np.isnan(vals)]
                out[system][name][key] = {"mean": float(vals.mean()) if vals.size else math.nan,
                                          "std": float(vals.std()) if vals.size else math.nan,
                                          "folds": int(vals.size)}
    return out


def run(feature_root: str | os.PathLike, out: str | os.PathLike, cfg: TrainConfig = TrainConfig(),
        targets_root: str | os.PathLike | None = None, force: bool = False,
        echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Load, split, train the head and the VAD baseline, evaluate, write ``out/``.

    Files: ``metrics.json``, ``table.txt``, ``head.pt``, ``roc_<split>.png``,
    ``pr_<split>.png``, ``timeline_<session>.png``. With ``--split kfold:K`` every fold runs
    into ``fold_F/`` and ``metrics.json`` holds the folds' test mean and std. Nothing is
    written under ``out`` unless the whole run succeeds (a temp directory is renamed).
    """
    cfg.check()
    out = check_output_path(out, "--out", directory=True)     # before loading: a bad --out fails at once
    sessions = load_sessions(feature_root, targets_root)
    spec = cfg.split.strip()
    all_folds = spec.startswith("kfold:") and spec.count(":") == 1
    if all_folds:
        try:
            k = int(spec.split(":")[1])
        except ValueError:
            raise SplitError(f"split {spec!r}: write kfold:K (all folds) or kfold:K:F") from None
        splits = [(f"fold_{f}", replace(cfg, split=f"kfold:{k}:{f}")) for f in range(k)]
    else:
        splits = [("", cfg)]
    parts = [split_sessions(sessions, c.split) for _, c in splits]  # all split errors before training
    tmp = _prepare_out(out, force)
    try:
        runs = [_run_split(sessions, p, c, tmp / sub if sub else tmp, echo) for (sub, c), p in zip(splits, parts)]
        common = {"feature_root": str(Path(feature_root).resolve()),
                  "targets_root": str(Path(targets_root).resolve()) if targets_root else None}
        if all_folds:
            metrics = {**common, "config": asdict(cfg), "folds": [r["sessions"] for r in runs],
                       "test_mean_std": _fold_summary(runs)}
            lines = [f"{len(runs)}-fold test mean +- std (ROC-AUC / balanced accuracy), {cfg.model}:"]
            for name in TARGET_NAMES:
                r = metrics["test_mean_std"][cfg.model][name]
                line = (f"  {name:12s} {r['roc_auc']['mean']:.3f} +- {r['roc_auc']['std']:.3f}   "
                        f"{r['balanced_accuracy']['mean']:.3f} +- {r['balanced_accuracy']['std']:.3f}")
                # a fold whose test rows hold one class has no AUC: say how few folds the figure rests on
                scored = r["roc_auc"]["folds"]
                if scored < len(runs):
                    line += f"   (AUC from {scored} of {len(runs)} folds)"
                lines.append(line)
            echo("\n".join(lines))
            (tmp / "table.txt").write_text("\n".join(lines) + "\n")
        else:
            metrics = {**common, **runs[0]}
        (tmp / "metrics.json").write_text(json.dumps(_nan_to_none(metrics), indent=2))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return metrics


def build_parser(prog: str = "train_turn_head.py"):
    import argparse

    d = TrainConfig()
    p = argparse.ArgumentParser(prog=prog, description="Train and evaluate a turn head on feature artifacts.")
    p.add_argument("--feature-root", required=True, help="Directory of .pt artifacts (searched recursively).")
    p.add_argument("--targets-root", default=None,
                   help="Directory of make-targets Session_N.npy (default: the targets stored in each artifact).")
    p.add_argument("--out", required=True, help="Output directory (metrics.json, table.txt, head.pt, PNGs).")
    p.add_argument("--split", default=d.split,
                   help="'val=4,12;test=10,11' (default; the rest trains), 'named', 'kfold:K:F' (one fold) "
                        "or 'kfold:K' (every fold, into OUT/fold_F, with mean/std).")
    p.add_argument("--model", choices=("linear", "tcn", "gru"), default=d.model,
                   help="linear: the current row only; tcn: causal dilated convolutions; gru: a causal GRU "
                        "(default: %(default)s).")
    p.add_argument("--hidden", type=int, default=d.hidden, help="Width of the TCN or GRU (default: %(default)s).")
    p.add_argument("--layers", type=int, default=d.layers,
                   help="TCN blocks (dilations 1, 2, 4, ...) or GRU layers (default: %(default)s).")
    p.add_argument("--dropout", type=float, default=d.dropout, help="Dropout inside the TCN or GRU (default: %(default)s).")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default: %(default)s).")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (default: %(default)s).")
    p.add_argument("--epochs", type=int, default=d.epochs, help="Most training epochs (default: %(default)s).")
    p.add_argument("--patience", type=int, default=d.patience,
                   help="Epochs without a better val loss before stopping (default: %(default)s).")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="Crops per optimizer step (default: %(default)s).")
    p.add_argument("--crop", type=int, default=d.crop, help="Training crop length in 5 Hz rows (default: %(default)s).")
    p.add_argument("--min-steps", type=int, default=d.min_steps,
                   help="Optimizer steps per epoch at least; small training sets draw more crops (default: %(default)s).")
    p.add_argument("--seed", type=int, default=d.seed, help="Seed of the weights, crops and shuffles (default: %(default)s).")
    p.add_argument("--vad-history", type=int, default=d.vad_history,
                   help="Rows of VAD labels the VAD baseline sees (default: %(default)s).")
    p.add_argument("--device", default=d.device, help="Torch device for the head: cpu, cuda, cuda:1 (default: %(default)s).")
    p.add_argument("--no-progress", action="store_true", help="No progress bars.")
    p.add_argument("--no-plots", action="store_true", help="Skip the ROC, PR and timeline PNGs.")
    p.add_argument("--force", action="store_true", help="Replace a non-empty --out.")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "train_turn_head.py") -> int:
    import sys

    from ..errors import MiniCPMORTError

    args = build_parser(prog).parse_args(argv)
    cfg = TrainConfig(model=args.model, hidden=args.hidden, layers=args.layers, dropout=args.dropout,
                      lr=args.lr, weight_decay=args.weight_decay, epochs=args.epochs, patience=args.patience,
                      batch_size=args.batch_size, crop=args.crop, min_steps=args.min_steps, seed=args.seed,
                      split=args.split, vad_history=args.vad_history, progress=not args.no_progress,
                      plots=not args.no_plots, device=args.device)
    try:
        run(args.feature_root, args.out, cfg, targets_root=args.targets_root, force=args.force)
    except MiniCPMORTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    each = "metrics.json, table.txt, head.pt" + ("" if args.no_plots else " and plots")
    if args.split.strip().startswith("kfold:") and args.split.count(":") == 1:
        print(f"wrote {args.out}/metrics.json (fold mean/std) and {args.out}/fold_*/ ({each})")
    else:
        print(f"wrote {args.out}/{each}")
    return 0
