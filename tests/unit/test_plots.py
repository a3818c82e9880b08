"""The PNGs are readable: no label runs into another, every layer's plan choice is outlined."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from headfold.converter.planning import Plan
from headfold.distillation.output import curve_figure
from headfold.inspection import HeadSimilarity, Inspection, LayerReport, PlanReport, heatmap_figure


def drawn(fig):
    FigureCanvasAgg(fig).draw()  # as savefig(png) draws it
    return fig


def extents(fig, artists) -> list:
    renderer = fig.canvas.get_renderer()
    return [a.get_window_extent(renderer) for a in artists if a.get_visible() and a.get_text()]


def assert_apart(boxes) -> None:
    for a, b in itertools.pairwise(boxes):
        assert not a.overlaps(b), f"labels overlap: {a} and {b}"


@pytest.mark.parametrize("tokens", [4096, 163_840, 2_000_000, 150_000_000])
def test_distill_curve_tick_labels_stay_apart(tokens: int) -> None:
    steps = 640
    log = {
        "train": [{"tokens": tokens * s // steps, "loss": 2 * math.exp(-s / 100) + 0.05} for s in range(1, steps + 1)],
        "eval": [{"tokens": tokens * s // steps, "kl": math.exp(-s / 120)} for s in range(0, steps + 1, 80)],
    }
    fig = drawn(curve_figure(log, "kl"))
    for axes in fig.axes:
        labels = extents(fig, axes.get_xticklabels())
        assert len(labels) >= 3
        assert_apart(labels)
        assert all(len(t.get_text()) <= 5 for t in axes.get_xticklabels())  # 200k, 1.5M, 150M


def inspection(heads: int, candidates: list[int], plan: tuple[int, ...] | None, layers: int = 4) -> Inspection:
    torch.manual_seed(0)
    reports = []
    for i in range(layers):
        aligned = torch.rand(heads, heads).double()
        similarity = HeadSimilarity(aligned, aligned, (aligned + aligned.T) / 2)
        reports.append(LayerReport(similarity, {k: (i + 1) * 0.05 * heads / k for k in candidates}, {}))
    planned = None if plan is None else PlanReport(Plan(plan, 1.0), 1.2, heads * layers)
    calibration = {"text": "t", "eval_text": "t", "fit_windows": 1, "eval_windows": 1, "eval_held_out": True, "seed": 0}
    return Inspection(Path("src"), "llama", "decoder", heads, heads, 32, "aligned+grouped+refit", candidates, calibration, reports, plan and sum(plan), planned)


@pytest.mark.parametrize("heads,candidates,plan", [(8, [4, 2, 1], (8, 4, 2, 2)), (12, [6, 4, 3, 2, 1], (1, 1, 1, 2, 1, 12)), (8, [4, 2, 1], None)])
def test_heatmap_outlines_every_choice_and_keeps_its_labels_apart(heads: int, candidates: list[int], plan: tuple[int, ...] | None) -> None:
    layers = len(plan) if plan else 4
    fig = drawn(heatmap_figure(inspection(heads, candidates, plan, layers)))
    left, right = fig.axes[:2]
    bars = fig.axes[2:]
    columns = [t.get_text() for t in right.get_xticklabels()]
    kept = plan is not None and heads in plan
    assert columns == ([f"{heads} (kept)"] if kept else []) + [str(k) for k in candidates]
    assert len(right.patches) == (layers if plan else 0)  # a layer kept whole is outlined too
    renderer = fig.canvas.get_renderer()
    panels = [left.get_window_extent(renderer), right.get_window_extent(renderer)]
    for bar in bars:
        label = bar.xaxis.label.get_window_extent(renderer)
        assert not any(label.overlaps(panel) for panel in panels), "a colour bar's label runs into a panel"
        assert_apart(extents(fig, bar.get_xticklabels()))
    assert_apart(extents(fig, right.get_xticklabels()))
