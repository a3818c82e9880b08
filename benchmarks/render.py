"""Render benchmarks/results/*.json into docs/benchmarks.md and the marked figures of README.md and docs/.

    python -m benchmarks.render            # write the pages
    python -m benchmarks.render --check    # exit 1 when a page differs from what the results give (CI)

Figures are never typed into the pages by hand: docs/benchmarks.md is written whole from the results
files, and README.md / docs/*.md carry figures only between markers this script fills:

    <!-- results:NAME -->  …  <!-- /results:NAME -->      (NAME: a function of SNIPPETS)

Every results file must render. Its name picks its renderer in RENDERERS: the benchmark script that
writes it, e.g. `generate_throughput_idle.json` → `generate_throughput`. A file no renderer claims
renders as one table when it has the standard shape {"what": text, "rows": [objects of numbers and
text]} (a new benchmark can start there); anything else is an error naming the file, never skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
MARKED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


class RenderError(Exception):
    """A results file or marker this script cannot render (one line naming it)."""


# -- formatting ---------------------------------------------------------------------------------


def fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and all(isinstance(v, int | float | str) for v in value):
        return ",".join(map(fmt, value))
    if isinstance(value, int | str):
        return str(value)
    raise TypeError(f"a value that is not a number, text or list of them: {value!r}")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell if isinstance(cell, str) else fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def about(data: dict, *keys: str) -> str:
    """The file's own description lines (what was measured, on which machine)."""
    return "\n\n".join(f"*{key}*: {data[key]}" for key in keys if key in data)


def pct(fraction: float) -> str:
    return f"{fraction:+.0%}" if abs(fraction) >= 1 else f"{fraction:+.1%}"


# -- renderers, one per benchmark script ------------------------------------------------------------


def conversion_quality(data: list[dict]) -> str:
    """benchmarks/conversion_quality.py: every method at every kv-head count, no training."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in data):
        rows = [r for r in data if r["model"] == model]
        kvs = list(dict.fromkeys(r["kv_heads"] for r in rows))
        cell = {(r["method"], r["kv_heads"]): r for r in rows}
        decoder = "kl" in rows[0]
        if decoder:
            intro = (
                f"**{model}**: KL(original ‖ converted) per token / perplexity on held-out text (original perplexity "
                f"{rows[0]['reference_ppl']:.4g}); lower is better."
            )
            show = lambda r: f"{r['kl']:.4g} / {r['ppl']:.4g}"  # noqa: E731
        else:
            intro = f"**{model}**: cosine of the sentence embeddings to the original's (mean over held-out paragraphs); higher is better."
            show = lambda r: f"{r['cosine']:.4g}"  # noqa: E731
        methods = list(dict.fromkeys(r["method"] for r in rows))
        body = [[f"`{m}`", *(show(cell[m, kv]) if (m, kv) in cell else "" for kv in kvs)] for m in methods]
        parts.append(intro + "\n\n" + table(["method", *(f"kv {kv}" for kv in kvs)], body))
    return "\n\n".join(parts)


def per_layer_plans(data: list[dict]) -> str:
    """benchmarks/per_layer_plans.py: inspect's per-layer plan against the best uniform count, equal KV cache."""
    body = []
    for r in data:
        held_out = f"KL {r['kl']:.4g}" if "kl" in r else f"cosine {r['cosine']:.4g}"
        body.append(
            [
                r["model"],
                f"{r['budget']:.0%}",
                r["choice"],
                f"`{fmt(r['kv_heads'])}`",
                f"{r['cache_fraction']:.1%}",
                r["predicted"],
                r["calibration_measured"],
                held_out,
                r["inspect_s"],
            ]
        )
    header = ["model", "budget", "choice", "--kv-heads", "cache", "predicted (sum of layers)", "measured (calibration)", "held-out", "inspect s"]
    return "Predicted and measured losses are on the calibration text's held-out windows; *held-out* on the evaluation text.\n\n" + table(header, body)


def decode_latency(data: dict) -> str:
    """benchmarks/decode_latency.py: one ONNX Runtime decode step, MHA against its conversions."""
    args = data["args"]
    parts = [
        f"Milliseconds per generated token (speed-up over MHA); load average {data['load_avg_before'][0]:.2f} before, "
        f"{data['load_avg_after'][0]:.2f} after, {data['cpus']} CPUs; {args['threads']} intra-op threads, median of {args['runs']} steps."
    ]
    for model in dict.fromkeys(r["model"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["model"] == model]
        kvs = sorted({r["kv_heads"] for r in rows}, reverse=True)
        cell = {(r["batch"], r["past"], r["kv_heads"]): r for r in rows}
        body = []
        for batch, past in dict.fromkeys((r["batch"], r["past"]) for r in rows):
            here = [cell.get((batch, past, kv)) for kv in kvs]
            body.append([batch, past, *(_step(r) if r else "" for r in here)])
        parts.append(f"**{model}** ({rows[0]['heads']} heads)\n\n" + table(["batch", "past", *(f"kv {kv}" for kv in kvs)], body))
    return "\n\n".join(parts)


def _step(row: dict) -> str:
    return f"{row['ms_per_token']:.3g} ms" + ("" if row["kv_heads"] == row["heads"] else f" ({row['speedup_vs_mha']:.2f}×)")


def distill_recovery(data: dict) -> str:
    """benchmarks/distill_recovery.py: distillation from each start, read at fractions of the pre-training tokens."""
    parts = [about(data, "machine"), *(f"*held-out, {kind}*: {text}" for kind, text in data["eval"].items())]
    for section, rows in data.items():
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
            continue
        budgets = list(dict.fromkeys(p["budget"] for r in rows for p in r["points"]))
        recipes = {_recipe(r["recipe"]) for r in rows}
        shared = recipes.pop() if len(recipes) == 1 else None  # one recipe: said once, above the table
        body = []
        for r in rows:
            points = {p["budget"]: p for p in r["points"]}
            recipe = [] if shared else [_recipe(r["recipe"])]
            body.append([r["kv_heads"], f"`{r['start']}`", *(_score(points[b]) if b in points else "" for b in budgets), r["steps"], r["distill_s"], *recipe])
        header = ["kv", "start", *(f"{b:.3g} %" if b else "0" for b in (100 * b for b in budgets)), "steps", "distill s", *([] if shared else ["recipe"])]
        parts.append(f"**`{section}`**" + (f" ({shared})" if shared else "") + "\n\n" + table(header, body))
    return "Decoders: KL / perplexity (relative increase); encoders: cosine. Columns: percent of the teacher's pre-training tokens.\n\n" + "\n\n".join(parts)


def _score(point: dict) -> str:
    if "kl" in point:
        return f"{point['kl']:.3g} / {point['ppl']:.4g} ({pct(point['ppl_increase'])})"
    return f"{point['cosine']:.4g}"


def _recipe(recipe: dict) -> str:
    return ", ".join(f"{k} {fmt(v)}" for k, v in recipe.items())


def distill_recipe_sweep(data: dict) -> str:
    """Distillation recipes, one change at a time (rows of benchmarks/distill_recovery.py runs)."""
    body = []
    for r in data["runs"]:
        options = ", ".join(f"{k} {fmt(v)}" for k, v in r["opts"].items())
        if "evals" in r:  # [tokens, KL, ppl] at each mark: the last is the result
            tokens, kl, ppl = r["evals"][-1]
            body.append([r["name"], r["kv"], options, r["steps"], kl, f"{ppl:.4g}", "", ""])
        else:
            body.append([r["name"], r["kv"], options, r["steps"], r["kl"], f"{r['ppl']:.4g}", pct(r["ppl_increase"]), r["cpu"]])
    return about(data, "what", "how", "machine") + "\n\n" + table(["run", "kv", "options", "steps", "KL", "perplexity", "increase", "CPU s"], body)


def _zoo_cell(point: dict | None) -> str:
    return f"{point['ppl_increase']:+.2%} / {point['kl']:.3g}" if point else ""  # two decimals: the goals are 2 and 3 %


def _zoo_points(rows: list[dict], model: str, recipe: str) -> dict[str, dict]:
    """One recipe's points on one model: "start", each budget's own run ("1%"), the longest run on the way ("1% on the way")."""
    mine = sorted((r for r in rows if (r["model"], r["recipe"]) == (model, recipe)), key=lambda r: r["budget"])
    points = {"start": mine[0]["points"][0]} if mine else {}
    for r in mine:
        points[f"{r['budget']:.1%}"] = r["points"][-1]
    for p in mine[-1]["points"][1:-1] if mine else ():
        points[f"{p['budget']:.1%} on the way"] = p
    return points


def sweep_models(data: dict) -> list[str]:
    """The models distill_zoo's recipes were ranked on (all of them in a file that does not say)."""
    return data.get("sweep") or list(data["models"])


def distill_zoo_ranks(data: dict) -> list[tuple[str, float, dict[str, float]]]:
    """The recipes run on every model of the sweep at every budget with a goal, best first: (recipe, mean
    rank over those models and budgets by perplexity increase (rank_in), the mean increase per budget); a tie
    goes to the lower mean increase. The zoo's other models check the chosen recipe only."""
    rows, models = data["rows"], sweep_models(data)
    budgets = sorted(map(float, data["goals"]))
    final = {(r["model"], r["recipe"], r["budget"]): r["points"][-1]["ppl_increase"] for r in rows}
    complete = [rc for rc in dict.fromkeys(r["recipe"] for r in rows) if all((m, rc, b) in final for m in models for b in budgets)]
    ranks: dict[str, list[float]] = {rc: [] for rc in complete}
    for m in models:
        for b in budgets:
            here = {rc: final[m, rc, b] for rc in complete}
            for rc in complete:
                ranks[rc].append(rank_in(here, rc))  # the zoo's rule: ties share the mean of their ranks
    means = {rc: {f"{b:.1%}": sum(final[m, rc, b] for m in models) / len(models) for b in budgets} for rc in complete}
    return sorted(((rc, sum(v) / len(v), means[rc]) for rc, v in ranks.items()), key=lambda item: (item[1], sum(item[2].values())))


def distill_zoo(data: dict) -> str:
    """Distillation recipes across the quality zoo: perplexity increase / KL on each model's held-out text."""
    rows = data["rows"]
    columns = ["start", "0.5%", "0.5% on the way", "1.0%", "1.0% on the way", "5.0%"]
    body = []
    for model, m in data["models"].items():
        for recipe in dict.fromkeys(r["recipe"] for r in rows if r["model"] == model):
            points = _zoo_points(rows, model, recipe)
            last = max((r for r in rows if (r["model"], r["recipe"]) == (model, recipe)), key=lambda r: r["budget"])
            body.append(
                [
                    f"{model} (kv {m['kv_heads']} of {m['heads']})",
                    f"`{recipe}`",
                    *(_zoo_cell(points.get(c)) for c in columns),
                    f"{last['points'][-1]['top1']:.1%}",
                    last["cpu_s"],
                ]
            )
    header = ["model", "recipe", *(c.replace("%", " %") for c in columns), "top-1, last", "CPU s, last"]
    base = "*base*: " + ", ".join(f"{k} {fmt(v)}" for k, v in data["base"].items())
    return "\n\n".join([about(data, "what", "machine"), base, table(header, body), distill_zoo_summary(data)])


def distill_zoo_summary(data: dict) -> str:
    """The recipes run everywhere ranked, the other changes against the recipe they change, and the goals per model for the best."""
    ranked = distill_zoo_ranks(data)
    budgets = sorted(map(float, data["goals"]))
    ranks = table(
        ["recipe", "mean rank", *(f"mean increase, {b:.1%}" for b in budgets)],
        [[f"`{rc}`", f"{rank:.2f}", *(f"{v:+.2%}" for v in means.values())] for rc, rank, means in ranked],
    )
    best = ranked[0][0]
    others = []
    for r in data["rows"]:
        if r["recipe"] not in {rc for rc, _, _ in ranked} and r["budget"] == budgets[-1] and r["model"] in sweep_models(data):
            points = _zoo_points(data["rows"], r["model"], r["recipe"])
            changed = ",".join(part for part in r["recipe"].split(",") if part.startswith("lr="))  # the recipe this one changes
            against = _zoo_points(data["rows"], r["model"], changed or "base")
            others.append(
                [
                    r["model"],
                    f"`{r['recipe']}`",
                    *(f"{_zoo_cell(points.get(k))} ({_zoo_cell(against.get(k)).split(' /')[0]})" for k in ("1.0% on the way", f"{budgets[-1]:.1%}")),
                ]
            )
    other_table = table(["model", "recipe", "1.0 % on the way", f"{budgets[-1]:.1%}"], others)
    goals = {float(b): v for b, v in data["goals"].items()}
    body = []
    for model in data["models"]:
        points = _zoo_points(data["rows"], model, best)
        cells = []
        for b, goal in sorted(goals.items()):
            p = points.get(f"{b:.1%}")
            cells.append(f"{p['ppl_increase']:+.2%}: {'met' if p['ppl_increase'] <= goal else 'missed'}" if p else "not run")
        body.append([model, _zoo_cell(points.get("start")), *cells])
    goal_table = table(["model", "start", *(f"{b:.0%} (goal ≤ {g:.0%})" for b, g in sorted(goals.items()))], body)
    return "\n\n".join(
        [
            f"**The recipes run on every model of the sweep ({', '.join(sweep_models(data))}) at every budget with a goal**, by mean rank over "
            "those models and budgets "
            "(perplexity increase of each budget's own run; 1 = best); the other models check the best:",
            ranks,
            "**One more change** (perplexity increase / KL; in brackets the recipe without that change):",
            other_table,
            f"**Goals with `{best}`** (perplexity increase / KL over the original; each budget's own run):",
            goal_table,
        ]
    )


def distill_rate_cases(data: dict) -> list[dict]:
    """Per model, start and budget: each fixed rate's and the chosen run's scores, the best fixed rate, and whether the
    chosen one is within the goal (perplexity increase within 10 % of the best fixed rate's, or 0.1 point)."""
    cases: dict[tuple, dict] = {}
    for r in data["rows"]:
        case = cases.setdefault((r["model"], r["start"], r["budget"]), {"model": r["model"], "start": r["start"], "budget": r["budget"], "runs": {}})
        case["runs"][str(r["lr"])] = r
    for case in cases.values():
        fixed = {lr: r for lr, r in case["runs"].items() if lr != "chosen"}
        case["best"] = min(fixed, key=lambda lr: fixed[lr]["ppl_increase"]) if fixed else None
        chosen, best = case["runs"].get("chosen"), fixed.get(case["best"] or "")
        case["within"] = None if chosen is None or best is None else _within_goal(chosen, best)
        case["fixed_within"] = {lr: _within_goal(r, best) for lr, r in fixed.items()} if best else {}
    return list(cases.values())


def _within_goal(run: dict, best: dict) -> bool:
    """Issue 42's goal: a perplexity increase within 10 % of the best's, or 0.1 point above it."""
    return run["ppl_increase"] <= max(1.1 * best["ppl_increase"], best["ppl_increase"] + 0.001)


def _rate(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def distill_rate(data: dict) -> str:
    """The rate distill chooses against each fixed rate (`benchmarks/distill_rate.py`)."""
    return "\n\n".join([about(data, "what", "machine"), distill_rate_table(data)])


def distill_rate_table(data: dict) -> str:
    cases = distill_rate_cases(data)
    rates = sorted({lr for c in cases for lr in c["runs"] if lr != "chosen"}, key=float)

    def cell(run: dict | None, bold: bool = False) -> str:
        text = "" if run is None else f"{pct(run['ppl_increase'])} / {run['kl']:.3g}"
        return f"**{text}**" if bold and text else text

    body = [
        [c["model"], c["start"], f"{c['budget']:.0%}", pct(c["runs"][next(iter(c["runs"]))]["start_ppl_increase"]),
         *(cell(c["runs"].get(lr), lr == c["best"]) for lr in rates),
         cell(c["runs"].get("chosen")) + (f" (`{_rate(c['runs']['chosen']['chosen_lr'])}`)" if "chosen" in c["runs"] else ""),
         {True: "yes", False: "no", None: ""}[c["within"]]]
        for c in cases
    ]  # fmt: skip
    header = ["model", "start", "budget", "before", *(f"`--lr {_rate(float(lr))}`" for lr in rates), "chosen (its rate)", "within the goal"]
    judged = [c for c in cases if c["within"] is not None]
    summary = (
        f"Perplexity increase / KL over the original on held-out text, the best fixed rate in bold. The chosen rate is within the goal "
        f"(10 % of the best fixed rate's increase, or 0.1 point) in {sum(c['within'] for c in judged)} of {len(judged)} cases; "
        "each fixed rate alone: " + ", ".join(f"{_rate(float(lr))} in {sum(c['fixed_within'].get(lr, False) for c in judged)}" for lr in rates) + "."
    )
    return "\n\n".join([table(header, body), summary])


def generate_throughput(data: dict) -> str:
    """benchmarks/generate_throughput.py: onnxruntime-genai tokens/s, headfold's export against og's model builder."""
    args = data["args"]
    setup = (
        f"{args['new_tokens']} tokens generated after a {args['context']}-token prompt; Llama of {args['layers']} layers, {args['heads']} heads of "
        f"{args['head_dim']}; {args['threads']} threads"
    )
    exporters = args["exporters"]
    speed = {(r["variant"], r["batch"], r["round"], r["exporter"]): r for r in data["rows"]}
    body = []
    for p in data["pairs"]:
        here = [speed[p["variant"], p["batch"], p["round"], e] for e in exporters]
        body.append([p["variant"], p["batch"], p["round"], *(r["tokens_per_s"] for r in here), p["vs_builder"], here[0]["load_1min"]])
    parts = [setup, table(["model", "batch", "round", *(f"{e} tok/s" for e in exporters), "ratio to the builder", "load"], body)]
    if data.get("medians"):
        parts.append(
            table(
                ["model", "batch", "rounds", "median ratio", "range"],
                [[m["variant"], m["batch"], m["rounds"], m["median_vs_builder"], f"{m['min']:.3g}–{m['max']:.3g}"] for m in data["medians"]],
            )
        )
    return "\n\n".join(parts)


def side_by_side(data: dict) -> str:
    """benchmarks/side_by_side.py: onnxruntime-genai decode speed of headfold's default folder and the model builder's, same checkpoint."""
    return "\n\n".join(filter(None, [_side_by_side_setup(data), side_by_side_tables(data), _profile_table(data.get("profile") or {})]))


def _side_by_side_setup(data: dict) -> str:
    a = data["args"]
    loads = [r["load_1min"] for r in data["rows"]]
    return (
        f"A random-weights Llama of {a['layers']} layers, {a['heads']} heads of {a['head_dim']} (vocabulary {a['vocab']}) and its kv = h/4 "
        f"conversion; {a['new_tokens']} greedy tokens after a prompt of *past* tokens, {a['threads']} threads, the exporters interleaved over "
        f"{a['rounds']} rounds, medians; load average {min(loads)}–{max(loads)} on {data['machine']}."
    )


def side_by_side_tables(data: dict) -> str:
    """The speed table and the MHA → h/4 table (docs/deploying.md quotes both)."""
    speed = [
        [
            s["precision"],
            s["model"],
            s["batch"],
            s["past"],
            s["builder_step_ms"],
            s["headfold_step_ms"],
            s["builder_tokens_per_s"],
            s["headfold_tokens_per_s"],
            f"{s['headfold_vs_builder']:.2f} ({s['ratio_range'][0]:.2f}–{s['ratio_range'][1]:.2f})",
            f"{s['headfold_vs_builder_cpu']:.2f}",
        ]
        for s in data["summary"]
    ]
    header = [
        "weights",
        "model",
        "batch",
        "past",
        "builder ms/step",
        "headfold ms/step",
        "builder tok/s",
        "headfold tok/s",
        "headfold ÷ builder (range)",
        "by CPU time",
    ]
    gqa = [
        [
            g["precision"],
            g["batch"],
            g["past"],
            f"{g['speedup']:.2f}×",
            f"{g['speedup_cpu']:.2f}×",
            f"{g['ideal_bytes_ratio']:.2f}×",
            f"{g['of_ideal']:.0%}",
            f"{g['builder_speedup']:.2f}× ({g['builder_of_ideal']:.0%})",
        ]
        for g in data["gqa_speedup"]
    ]
    return "\n\n".join(
        [
            table(header, speed),
            "headfold's folder, MHA → GQA h/4: decode-step speed-up (by wall and by CPU time) beside the ideal, the ratio of bytes a step moves "
            "(weights + K/V cache read + K/V written), and the builder's folders' own speed-up (of ideal):",
            table(["weights", "batch", "past", "speed-up", "by CPU time", "ideal (bytes)", "of ideal", "builder's folders"], gqa),
        ]
    )


def _profile_table(profile: dict) -> str:
    folders = [k for k in profile if k not in ("setup", "optimized_ops")]
    if not folders:
        return ""
    ops = sorted({op for f in folders for op in profile[f] if op != "kernel_us_per_step"}, key=lambda op: (-max(profile[f].get(op, 0) for f in folders), op))
    body = [[op, *(f"{profile[f][op]:.1%}" if op in profile[f] else "" for f in folders)] for op in ops]
    body.append(["kernel µs per step", *(fmt(profile[f]["kernel_us_per_step"]) for f in folders)])
    shares = (
        f"ONNX Runtime's profile of the decode steps ({profile['setup']}): each op type's share of a step's kernel time (the median step per op type)\n\n"
        + table(["op", *folders], body)
    )
    optimized = profile.get("optimized_ops", {})
    graphs = [[f, counts["nodes"], ", ".join(f"{n} {op}" for op, n in counts.items() if op != "nodes")] for f, counts in optimized.items()]
    return shares + ("\n\nThe graph ONNX Runtime runs, after its own optimizer:\n\n" + table(["folder", "nodes", "op types"], graphs) if graphs else "")


def calibration_memory(data: dict) -> str:
    """benchmarks/calibration_memory.py: a data-aware conversion's memory and time, and the scaling plan from them."""
    labels = sorted({k.split("_")[0] for k in data if k.endswith("_peak_rss_mb")})
    fields = [
        ("peak_rss_mb", "peak RSS MB"),
        ("total_s", "wall s"),
        ("calibration_s", "of which calibration"),
        ("cpu_s", "CPU s"),
        ("calibration_cpu_s", "of which calibration"),
    ]
    runs = table(["run", *(name for _, name in fields)], [[label, *(data[f"{label}_{key}"] for key, _ in fields)] for label in labels])
    bound = (
        f"bound: 2 × largest fp32 layer ({data['largest_fp32_layer_mb']} MB) + activations ({data['activations_mb']} MB) + 500 MB = {data['rss_bound_mb']} MB"
    )
    return about(data, "what", "machine") + "\n\n" + runs + "\n\n" + bound + "\n\n" + scaling_table(data)


def scaling_table(data: dict) -> str:
    rows = [
        [
            r["model"],
            f"{r['checkpoint_gb']} GB",
            f"{_duration(r['mean_s'])}, {r['mean_rss_gb']} GB",
            _duration(r["calibration_cpu_s"]),
            _duration(r["conversion_cpu_s"]),
            _duration(r["calibration_gpu_s"]),
            _duration(r["conversion_gpu_s"]),
            f"{r['rss_gb']} GB",
            f"{r['disk_gb']} GB",
            f"{r['local_disk_gb']} GB",
        ]
        for r in data["scaling_plan"]
    ]
    header = [
        "layout (MHA K/V, bf16)",
        "checkpoint",
        "`mean`: time, RSS",
        "calibration, CPU",
        "a+g+r maths, CPU",
        "calibration, 1 GPU",
        "maths, 1 GPU",
        "RSS (calibrating)",
        "scratch disk",
        "+ with `local`",
    ]
    return table(header, rows)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _part_name(row: dict) -> str:
    """A method_parts row's method, with local's budget and, in an ablation or a later fit, its other settings."""
    if "local_steps" not in row:
        return f"`{row['method']}`"
    extra = (", sequential" if row.get("local_sequential") else "") + (f", {row['fit']}" if row.get("fit") else "")
    return f"`{row['method']}` ({row['local_steps']} steps{extra})"


def local_cost(data: dict) -> list[str]:
    """Per layout row with local: one step's CPU seconds (local's fits over the steps it ran) and the
    conversion's CPU seconds at the default budget: the rest of the run plus that many steps."""
    lines, default = [], data.get("default_local_steps")
    for r in data["rows"]:
        if r.get("fit"):  # today's fit stops early: its conversion is measured at the default budget, not extrapolated
            lines.append(
                f"`{r['method']}` with {r['fit']}, at its default budget of at most {r['local_steps']} steps: {r['convert_cpu_s']:,.0f} CPU s "
                f"({r['convert_cpu_s'] / 60:.0f} CPU minutes), of which local's fits {r['local_fit_cpu_s']:,.0f}; the rows before it ran the previous fit."
            )
        elif r.get("local_steps") and "local_fit_cpu_s" in r and default:
            step, rest = r["local_fit_cpu_s"] / r["local_steps"], r["convert_cpu_s"] - r["local_fit_cpu_s"]
            total = rest + default * step
            lines.append(
                f"`{r['method']}`: one local step (every layer) costs {step:.1f} CPU s on this layout, the rest of the conversion "
                f"{rest:,.0f} CPU s; at the default {default} steps the conversion costs about {total:,.0f} CPU s "
                f"({total / 3600:.1f} CPU hours; from the run with {r['local_steps']} steps)."
            )
    return lines


def method_parts(data: dict) -> str:
    """benchmarks/method_parts.py: the training-free method parts on several trained models, and what they cost."""
    rows = data["rows"]
    if "layout" in rows[0]:
        shown = [
            [
                r["layout"],
                r["kv_heads"],
                _part_name(r) if "local_steps" in r else r["method"],
                r["convert_cpu_s"],
                r["convert_s"],
                r.get("peak_rss_mb", ""),
                r["load_average_1min"],
            ]
            for r in rows
        ]
        return "\n\n".join([about(data, "what"), table(["layout", "kv heads", "method", "CPU s", "wall s", "peak RSS MB", "load"], shown), *local_cost(data)])
    parts = [
        about(data, "what"),
        "Each cell: KL(original ‖ converted) per token, how many times less than `mean`'s at that kv count, and the conversion's CPU seconds.",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        kvs = sorted({r["kv_heads"] for r in mine}, reverse=True)
        mean = {r["kv_heads"]: r["kl"] for r in mine if r["method"] == "mean"}
        cell = {(_part_name(r), r["kv_heads"]): r for r in mine}
        names = list(dict.fromkeys(_part_name(r) for r in mine))

        def show(r: dict | None, mean: dict = mean) -> str:
            if r is None:
                return ""
            return f"{r['kl']:.3g}" + ("" if r["method"] == "mean" else f" ({mean[r['kv_heads']] / r['kl']:.1f}×)") + f" · {r['convert_cpu_s']:.0f} s"

        first = mine[0]
        intro = (
            f"**{model}** ({first['family']}, {first['layers']} layers, {first['heads']} heads of {first['head_dim']}; original perplexity "
            f"{first['reference_ppl']:.4g}):"
        )
        parts += [intro, table(["method", *(f"kv {k}" for k in kvs)], [[name, *(show(cell.get((name, k))) for k in kvs)] for name in names])]
    return "\n\n".join(parts)


def zoo_quality(data: dict) -> str:
    """benchmarks/zoo.py quality: every training-free method on every zoo model at h/2, h/4 and MQA."""
    c = data["corpus"]
    corpus = (
        f"*corpus of the trained members*: {c['source']}; {c['files']} files, {c['heldout_files']} of them held out ({c['split']}); "
        f"{c['train_bytes']} training and {c['heldout_bytes']} held-out bytes, sha256 `{c['sha256']}`"
    )
    parts = [about(data, "what", "machine"), corpus, zoo_models_table(data), zoo_table(data), zoo_choice(data), zoo_leave_one_out(data), zoo_summary(data)]
    for key, name in (("ppl_increase", "perplexity increase"), ("top1", "top-1 agreement"), ("convert_s", "conversion wall seconds")):
        show = (lambda r, k=key: pct(r[k])) if key == "ppl_increase" else (lambda r, k=key: f"{r[k]:.1%}") if key == "top1" else (lambda r, k=key: fmt(r[k]))
        parts.append(f"**{name.capitalize()}**\n\n" + zoo_grid(data, show, decoders_only=key != "convert_s"))
    return "\n\n".join(parts)


def zoo_models_table(data: dict) -> str:
    body = [
        [
            m["model"],
            m["family"],
            m["heads"],
            m["head_dim"],
            m["layers"],
            m.get("parameters", ""),
            m.get("pretraining_tokens", ""),
            m.get("heldout_perplexity", ""),
            f"`{m['weights_sha256'][:12]}`",
        ]
        for m in data["models"]
    ]
    return table(["model", "what", "heads", "head_dim", "layers", "parameters", "pre-training tokens", "held-out ppl", "weights sha256"], body)


def _zoo_loss(row: dict) -> float:
    return row["kl"] if "kl" in row else 1 - row["cosine"]


def zoo_grid(data: dict, show: Callable, decoders_only: bool = False) -> str:
    """(model, kv) × method, calibrated on the built-in text; the last column: the default on the model's own training split."""
    rows = [r for r in data["rows"] if not decoders_only or "kl" in r]
    methods = list(dict.fromkeys(r["method"] for r in rows if r["calibration"] == "built-in"))
    cell = {(r["model"], r["kv"], r["method"], r["calibration"]): r for r in rows}
    own = list(dict.fromkeys(r["method"] for r in rows if r["calibration"] == "training split"))  # the default when it was measured
    body = []
    for model, kv, heads in dict.fromkeys((r["model"], r["kv"], r["kv_heads"]) for r in rows):
        here = [cell.get((model, kv, m, "built-in")) for m in methods] + [cell.get((model, kv, m, "training split")) for m in own]
        body.append([model, f"{kv} ({heads})", *(show(r) + ("†" if "ran_as" in r else "") if r else "" for r in here)])
    ran_as = sorted({f"`{r['method']}` as `{r['ran_as']}`" for r in rows if "ran_as" in r})
    note = (
        f"\n\n† the family refuses a part of the method, which ran without it (as `headfold convert` runs the default): {', '.join(ran_as)}." if ran_as else ""
    )
    return table(["model", "kv", *(f"`{m}`" for m in methods), *(f"`{m}`, own text" for m in own)], body) + note


def zoo_table(data: dict) -> str:
    """The main grid: KL per token for the decoders, 1 − cosine for the encoder (lower is better)."""
    show = lambda r: f"{r['kl']:.3g}" if "kl" in r else f"{1 - r['cosine']:.3g} (1−cos)"  # noqa: E731
    intro = (
        "**KL(original ‖ converted) per token** on each model's held-out text (all-MiniLM-L6-v2: 1 − sentence-embedding cosine), "
        "calibrated on the built-in text; *own text*: a method calibrated on the model's training split (the embedded model's is the "
        "built-in text; MiniLM's is not ours). Lower is better."
    )
    return intro + "\n\n" + zoo_grid(data, show)


def zoo_summary(data: dict) -> str:
    """Per model at h/4: how many times less loss the default method leaves than `mean` (the goal: 3 or more)."""
    default, cell = data["default_method"], {(r["model"], r["kv"], r["method"], r["calibration"]): r for r in data["rows"]}
    body = []
    for m in data["models"]:
        mean, best, own = (
            cell.get((m["model"], "h/4", method, calibration))
            for method, calibration in (("mean", "built-in"), (default, "built-in"), (default, "training split"))
        )
        if mean and best:
            ratio = lambda r, mean=mean: f"{_zoo_loss(mean) / _zoo_loss(r):.2f}×" if r else ""  # noqa: E731
            body.append([m["model"], f"{_zoo_loss(mean):.3g}", f"{_zoo_loss(best):.3g}", ratio(best), f"{_zoo_loss(own):.3g}" if own else "", ratio(own)])
    intro = (
        f"**At h/4: `mean` against the default `{default}`** (KL, or 1 − cosine for the encoder; ratio: `mean`'s over the default's, the goal is 3× or more)"
    )
    header = ["model", "`mean`", "default", "ratio", "default, own text", "ratio"]
    if not any(row[4] for row in body):  # the default not measured on own text (yet): no empty columns
        header, body = header[:4], [row[:4] for row in body]
    return intro + "\n\n" + table(header, body)


def zoo_losses(data: dict, kv: str = "h/4") -> dict[str, dict[str, float]]:
    """Model → method → loss at `kv`, calibrated on the built-in text, for the methods measured on every zoo model."""
    models = [m["model"] for m in data["models"]]
    loss = {(r["model"], r["method"]): _zoo_loss(r) for r in data["rows"] if r["kv"] == kv and r["calibration"] == "built-in"}
    methods = [m for m in dict.fromkeys(method for _, method in loss) if all((model, m) in loss for model in models)]
    return {model: {m: loss[model, m] for m in methods} for model in models}


def rank_in(here: dict[str, float], method: str) -> float:
    """`method`'s rank by loss among `here` (1 = least; ties share the mean of their ranks)."""
    value = here[method]
    return 1 + sum(v < value for v in here.values()) + (sum(v == value for v in here.values()) - 1) / 2


def zoo_ranks(data: dict, kv: str = "h/4", leave_out: str | None = None) -> dict[str, tuple[float, float]]:
    """Each method measured on every zoo model (but `leave_out`) at `kv`, ranked per model by its loss →
    (mean rank over the models, its largest loss over the best loss on a model), best first: by mean
    rank, a tie by the second."""
    losses = {model: here for model, here in zoo_losses(data, kv).items() if model != leave_out}
    methods = list(next(iter(losses.values()), {}))
    scores = {
        m: (sum(rank_in(here, m) for here in losses.values()) / len(losses), max(here[m] / min(here.values()) for here in losses.values())) for m in methods
    }
    return dict(sorted(scores.items(), key=lambda item: item[1]))


def zoo_leave_one_out(data: dict) -> str:
    """The rule applied to every model but one, and how the method it chooses does on the one left out."""
    rows, agreed = [], 0
    for model, here in zoo_losses(data).items():
        chosen = next(iter(zoo_ranks(data, leave_out=model)))
        best = min(here, key=here.get)
        agreed += here[chosen] == here[best]
        rows.append([model, f"`{chosen}`", f"{rank_in(here, chosen):g} of {len(here)}", f"{here[chosen] / here[best]:.3f}", f"`{best}`"])
    intro = (
        f"**Left out**: the rule applied to every model but one chooses the method in the second column; on the model left "
        f"out, that method was the best (or tied with it) on {agreed} of {len(rows)} models."
    )
    return intro + "\n\n" + table(["left-out model", "chosen on the others", "its rank there", "its loss over the best there", "best there"], rows)


def zoo_choice(data: dict) -> str:
    """The rule that chooses the default method, the ranks it reads, and whether the file's default is its choice."""
    ranks, default = zoo_ranks(data), data["default_method"]
    chosen = next(iter(ranks), None)
    everywhere = [m for m, (_, worst) in ranks.items() if worst <= 1.05]
    verdict = (
        f"Chosen: `{chosen}`"
        + (", within 5 % of the best on every model" if chosen in everywhere else "")
        + (f"; the default, `{default}`, is that method." if chosen == default else f"; the default is `{default}`.")
    )
    body = [[f"`{m}`" + (" (default)" if m == default else ""), f"{rank:.2f}", f"{worst:.3f}"] for m, (rank, worst) in ranks.items()]
    intro = (
        "**How the default is chosen**: at h/4 the methods measured on every zoo model are ranked on each model by their loss "
        "(1 = least; ties share a rank). The default is the method with the lowest mean rank, a tie going to the one whose loss "
        "stays closest to the best on its worst model (a method within 5 % of the best on every model would be chosen as well). " + verdict
    )
    return intro + "\n\n" + table(["method", "mean rank", "largest loss over the best"], body)


def standard(data: dict) -> str:
    """{"what": text, "rows": [flat objects]} (optional "machine", "args"): one table."""
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"] or not isinstance(data.get("what"), str):
        raise KeyError("rows")
    columns = list(dict.fromkeys(k for r in data["rows"] for k in r))
    args = "*args*: " + ", ".join(f"{k} {fmt(v)}" for k, v in data["args"].items()) if "args" in data else ""
    return "\n\n".join(filter(None, [about(data, "what", "machine"), args, table(columns, [[r.get(c, "") for c in columns] for r in data["rows"]])]))


RENDERERS: dict[str, Callable] = {
    "conversion_quality": conversion_quality,
    "per_layer_plans": per_layer_plans,
    "decode_latency": decode_latency,
    "distill_recovery": distill_recovery,
    "distill_recipe_sweep": distill_recipe_sweep,
    "distill_zoo": distill_zoo,
    "distill_rate": distill_rate,
    "generate_throughput": generate_throughput,
    "side_by_side": side_by_side,
    "calibration": calibration_memory,  # calibration_memory.py --json …
    "method_parts": method_parts,
    "zoo_quality": zoo_quality,
}


def renderer_for(path: Path) -> Callable:
    matches = [prefix for prefix in RENDERERS if path.stem == prefix or path.stem.startswith(prefix + "_")]
    return RENDERERS[max(matches, key=len)] if matches else standard


def render_file(path: Path) -> str:
    """One results file as a section of docs/benchmarks.md; RenderError when it cannot be rendered."""
    render = renderer_for(path)
    try:
        body = render(json.loads(path.read_text()))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration) as err:
        hint = (
            f"its renderer {render.__name__}"
            if render is not standard
            else 'no renderer in RENDERERS, and it lacks the standard shape {"what": text, "rows": [flat objects]}'
        )
        raise RenderError(
            f"{path.relative_to(ROOT)}: cannot render it ({type(err).__name__}: {err}) with {hint}; fix the file or benchmarks/render.py"
        ) from None
    title = (render.__doc__ or "").strip().splitlines()[0] if render is not standard else ""
    return "\n\n".join(filter(None, [f"## `{path.name}`", title, body]))


def benchmarks_page() -> str:
    files = sorted(RESULTS.glob("*.json"))
    if not files:
        raise RenderError(f"no results in {RESULTS.relative_to(ROOT)}")
    head = (
        "# Benchmarks\n\n"
        "<!-- Generated by `python -m benchmarks.render` from benchmarks/results/*.json: edit those or the script, not this page. -->\n\n"
        "Every figure below comes from a results file in [`benchmarks/results/`](../benchmarks/results/), written by the\n"
        "benchmark script its section names (each prints a table and writes its JSON: see [benchmarks/](../benchmarks/)).\n"
        "All ran on a 2-core CPU without a GPU; each file says how loaded the machine was.\n\n" + "\n".join(f"- [`{p.name}`](#{p.stem}json)" for p in files)
    )
    return head + "\n\n" + "\n\n".join(render_file(p) for p in files) + "\n"


# -- figures quoted in README.md and docs/*.md --------------------------------------------------------


def _load(name: str):
    path = RESULTS / name
    if not path.is_file():
        raise RenderError(f"a marked figure needs {path.relative_to(ROOT)}, which does not exist; run the benchmark that writes it")
    return json.loads(path.read_text())


def _source(*names: str) -> str:
    return ", ".join(f"[`{n}`](benchmarks/results/{n})" for n in names)


def headline() -> str:
    """README: the few figures that say what headfold is for."""
    decoder = _load("distill_recovery.json")["decoder"]
    kv = min(r["kv_heads"] for r in decoder if r["kv_heads"] > 1)  # h/4
    start = {r["start"]: r["points"] for r in decoder if r["kv_heads"] == kv}
    mean, distilled = start["mean"][0], start["aligned+grouped+refit"][-1]  # before any training; the distilled end
    zoo = _load("zoo_quality.json")
    default = zoo["default_method"]
    cell = {(r["model"], r["method"]): r for r in zoo["rows"] if r["kv"] == "h/4" and r["calibration"] == "built-in"}
    best = cell[("embedded", default)]
    ratios = [_zoo_loss(cell[(m["model"], "mean")]) / _zoo_loss(cell[(m["model"], default)]) for m in zoo["models"] if (m["model"], default) in cell]
    generate = [r for r in _load("generate_throughput_idle.json")["rows"] if r["exporter"] == "headfold gqa" and r["batch"] == 8]
    speeds = {r["variant"]: r["tokens_per_s"] for r in generate}
    rows = [
        [f"pooled 8 → {kv} kv heads, no training: `mean`", f"KL {mean['kl']:.3g}, perplexity {pct(mean['ppl_increase'])}", _source("distill_recovery.json")],
        [
            f"pooled 8 → {kv} kv heads, no training: the default `{default}`",
            f"KL {best['kl']:.3g}, perplexity {pct(best['ppl_increase'])}",
            _source("zoo_quality.json"),
        ],
        [
            f"the default's KL against `mean`'s at h/4 on each of the quality zoo's {len(ratios)} models",
            f"{min(ratios):.3g}× to {max(ratios):,.0f}× less",
            _source("zoo_quality.json"),
        ],
        [
            f"`aligned+grouped+refit` (no local), then distilled on {distilled['budget']:.0%} of its pre-training tokens",
            f"KL {distilled['kl']:.3g}, perplexity {pct(distilled['ppl_increase'])}",
            _source("distill_recovery.json"),
        ],
        [
            "onnxruntime-genai tokens/s at batch 8, GQA h/4 over MHA (a random 4-layer Llama, CPU)",
            f"{speeds['GQA h/4'] / speeds['MHA']:.2f}×",
            _source("generate_throughput_idle.json"),
        ],
    ]
    intro = (
        "Measured: the embedded model's KL to the original and perplexity change on held-out text, and generation speed "
        "([docs/benchmarks.md](docs/benchmarks.md) has every figure):"
    )
    return intro + "\n\n" + table(["", "measured", "from"], rows)


def scaling_plan() -> str:
    """docs/scaling.md: the plan's table, from the calibration benchmark's per-layer measurement."""
    return table_note("calibration_before_after.json") + "\n\n" + scaling_table(_load("calibration_before_after.json"))


def deployed_speed() -> str:
    """docs/deploying.md: the default folder against the builder's, and MHA against h/4."""
    note = (
        "From [`side_by_side.json`](../benchmarks/results/side_by_side.json) (`benchmarks/side_by_side.py`; its setup and profiles: "
        "[benchmarks.md](benchmarks.md#side_by_sidejson)):"
    )
    return note + "\n\n" + side_by_side_tables(_load("side_by_side.json"))


def table_note(name: str) -> str:
    return f"From [`{name}`](../benchmarks/results/{name}) (`benchmarks/calibration_memory.py`):"


def demo_reference() -> str:
    """docs/run.md: what `headfold demo` measures against its reference budget."""
    data = _load("demo_reference.json")
    body = [[f"`{r['command']}`", pct(r["ppl_increase"]), f"{r['kl']:.3g}", f"{r['top1']:.1%}", "pass" if r["passed"] else "fail"] for r in data["rows"]]
    note = "From [`demo_reference.json`](../benchmarks/results/demo_reference.json) (`benchmarks/demo_reference.py`), the conversion-loss check:"
    return note + "\n\n" + table(["command", "perplexity", "KL", "top-1", "budget"], body)


def method_parts_h4() -> str:
    """docs/methods.md: every model at kv = h/4 (the issue's goal: a third of mean's KL), each method at local's usual budget."""
    rows = [r for r in _load("method_parts.json")["rows"] if not r.get("local_sequential")]
    covered = {steps: len({r["model"] for r in rows if r.get("local_steps") == steps}) for steps in {r["local_steps"] for r in rows if "local_steps" in r}}
    budget = max(covered, key=lambda steps: (covered[steps], steps), default=0)  # the budget run on the most models (the larger on a tie)
    rows = [r for r in rows if r.get("local_steps", budget) == budget]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    body = []
    for model in dict.fromkeys(r["model"] for r in rows):
        first = next(r for r in rows if r["model"] == model)
        at = {r["label"]: r for r in rows if r["model"] == model and r["kv_heads"] == first["heads"] // 4}
        mean = at["mean"]["kl"]
        cell = lambda r, mean=mean: f"{r['kl']:.3g} ({mean / r['kl']:.1f}×)" if r["label"] != "mean" else f"{r['kl']:.3g}"  # noqa: E731
        body.append(
            [f"{model} ({first['family']}, {first['heads']} heads of {first['head_dim']})", *(cell(at[label]) if label in at else "" for label in labels)]
        )
    note = (
        f"From [`method_parts.json`](../benchmarks/results/method_parts.json) (`benchmarks/method_parts.py`): KL at kv = h/4 and how many times less "
        f"than `mean`'s; each method as the family allows it (BLOOM: without `grouped` and `scored`; benchmarks.md names what ran), local ran {budget} steps:"
    )
    return note + "\n\n" + table(["model", *(f"`{label}`" for label in labels)], body)


def distill_zoo_recipes() -> str:
    """docs/distill.md: the recipes' ranks over the zoo and the goals for the best one."""
    note = "From [`distill_zoo.json`](benchmarks.md#distill_zoojson) (`benchmarks/distill_zoo.py`; every run's curve is there):"
    return note + "\n\n" + distill_zoo_summary(_load("distill_zoo.json"))


def distill_rate_choice() -> str:
    """docs/distill.md: the chosen rate against each fixed one."""
    note = "From [`distill_rate.json`](benchmarks.md#distill_ratejson) (`benchmarks/distill_rate.py`):"
    return note + "\n\n" + distill_rate_table(_load("distill_rate.json"))


def layout_cost() -> str:
    """docs/scaling.md: what the default method (and mean) cost on the generated 1.29 GB Llama layout."""
    data = _load("method_parts_cost.json")
    rows = [r for r in data["rows"] if r["layout"].startswith("Llama")]
    note = (
        "Measured ([`method_parts_cost.json`](benchmarks.md#method_parts_costjson), `benchmarks/method_parts.py --layout`), "
        + rows[0]["layout"]
        + ", to 4 kv heads:"
    )
    shown = [[_part_name(r), r["convert_cpu_s"], r["convert_s"], r.get("peak_rss_mb", "")] for r in rows]
    return "\n\n".join([note, table(["method", "CPU s", "wall s", "peak RSS MB"], shown), *local_cost(data)])


def zoo_methods() -> str:
    """docs/methods.md: the zoo's KL grid and the default against `mean` at h/4."""
    data = _load("zoo_quality.json")
    note = (
        "From [`zoo_quality.json`](benchmarks.md#zoo_qualityjson) (`benchmarks/zoo.py quality`; the models, their perplexity, top-1 and conversion "
        "times are there):"
    )
    return "\n\n".join([note, zoo_table(data), zoo_choice(data), zoo_leave_one_out(data), zoo_summary(data)])


def local_fit() -> str:
    """docs/methods.md: local's fits side by side per model and calibration-token count (KL, convert CPU seconds)."""
    data = _load("local_fit.json")
    fits = list(dict.fromkeys(r["fit"] for r in data["rows"]))
    cells = {(r["model"], r["calibration_tokens"], r["fit"]): f"{r['kl']:.3g} ({r['convert_cpu_s']:.0f} s)" for r in data["rows"]}
    groups = sorted({(r["model"], r["calibration_tokens"]) for r in data["rows"]}, key=lambda g: ([r["model"] for r in data["rows"]].index(g[0]), g[1]))
    body = [[model, f"{tokens}", *(cells.get((model, tokens, fit), "") for fit in fits)] for model, tokens in groups]
    note = (
        "From [`local_fit.json`](benchmarks.md#local_fitjson) (`benchmarks/local_fit.py`): the default method at kv = h/4, "
        "KL(original ‖ converted) per token on each model's held-out text (convert CPU seconds on a shared 2-core machine); "
        "a fit named by assignments is the default with those LocalFit settings changed (ground/settings.py):"
    )
    return note + "\n\n" + table(["model", "calibration tokens", *(f"`{fit}`" for fit in fits)], body)


SNIPPETS: dict[str, Callable[[], str]] = {
    "headline": headline,
    "scaling-plan": scaling_plan,
    "demo-reference": demo_reference,
    "method-parts-h4": method_parts_h4,
    "zoo-quality": zoo_methods,
    "side-by-side": deployed_speed,
    "distill-zoo": distill_zoo_recipes,
    "distill-rate": distill_rate_choice,
    "layout-cost": layout_cost,
    "local-fit": local_fit,
}
MARKER = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def fill_markers(text: str, where: Path) -> str:
    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in SNIPPETS:
            raise RenderError(f"{where.relative_to(ROOT)}: unknown marker results:{name}; known: {', '.join(SNIPPETS)}")
        return match.group(1) + SNIPPETS[name]() + "\n" + match.group(4)

    return MARKER.sub(fill, text)


def pages() -> dict[Path, str]:
    """Every page this script owns or fills, as it should read."""
    wanted = {PAGE: benchmarks_page()}
    for path in MARKED:
        if path != PAGE and path.is_file():
            wanted[path] = fill_markers(path.read_text(), path)
    return wanted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is not what the results give")
    args = parser.parse_args()
    try:
        wanted = pages()
    except RenderError as err:
        print(f"render: {err}", file=sys.stderr)
        return 2
    stale = [p for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"render: {path.relative_to(ROOT)} is not what the results give; run python -m benchmarks.render", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
