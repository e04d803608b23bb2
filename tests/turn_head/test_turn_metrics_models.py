"""Metrics against brute-force definitions; heads are strictly causal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minicpmo_rt.turn_head import metrics as M
from minicpmo_rt.turn_head.models import HeadConfig, build_head


def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    s = np.round(rng.random(300) + 0.5 * y, 1)  # rounding makes many ties
    pos, neg = s[y], s[~y]
    brute = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (pos.size * neg.size)
    assert M.roc_auc(y, s) == pytest.approx(brute, abs=1e-12)
    fpr, tpr = M.roc_curve(y, s)
    assert np.trapezoid(tpr, fpr) == pytest.approx(brute, abs=1e-12)  # tie groups are one step
    assert math.isnan(M.roc_auc(np.ones(4, bool), np.arange(4.0)))


def test_thresholded_metrics_by_hand():
    y = np.array([1, 1, 1, 0, 0, 0, 0, 0], bool)
    p = np.array([.9, .8, .2, .7, .1, .1, .1, .1])
    # recall(1) = 2/3, recall(0) = 4/5
    assert M.balanced_accuracy(y, p >= 0.5) == pytest.approx((2 / 3 + 4 / 5) / 2)
    # F1(1) = 2*2/(4+1+1) = 2/3, F1(0) = 2*4/(8+1+1) = 0.8; weights 3/8, 5/8
    assert M.weighted_f1(y, p >= 0.5) == pytest.approx(3 / 8 * 2 / 3 + 5 / 8 * 0.8)
    # AP: ranks .9(+) .8(+) .7(-) .2(+): precision at each positive 1, 1, 3/4
    assert M.average_precision(y, p) == pytest.approx((1 + 1 + 0.75) / 3)


@pytest.mark.parametrize("kind", ["linear", "tcn", "gru"])
def test_heads_are_causal(kind):
    torch.manual_seed(0)
    head = build_head(HeadConfig(kind=kind, in_dim=5, num_targets=11, hidden=8, layers=3)).eval()
    x = torch.randn(2, 40, 5)
    x2 = x.clone()
    x2[:, 25:] = torch.randn(2, 15, 5) * 10
    a, b = head(x), head(x2)
    assert a.shape == (2, 40, 11)
    assert torch.allclose(a[:, :25], b[:, :25], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 25:], b[:, 25:])
