"""onnxruntime-genai generation throughput: headfold's merged export vs og's own model builder, MHA vs GQA h/4.

A random-weights Llama layout (hidden size ≠ vocabulary: the builder takes any Linear with
out_features == vocab_size for the LM head) is converted to kv = heads / 4 (mean pooling), and
both checkpoints are turned into og model folders by --exporters: `python -m
onnxruntime_genai.models.builder -p fp32 -e cpu` ("og builder", the reference), `headfold export
--attention ort-gqa --optimize ort` ("headfold gqa": GroupQueryAttention with rotary inside, packed
QKV, shared buffers, fused norms: today's default folder) and, when asked, `headfold export --attention
onnx` ("headfold": standard Attention, separate past/present buffers). benchmarks/side_by_side.py
measures the default folder against the builder's in fp32 and int4, at several past lengths. Each folder then generates --new-tokens greedy tokens
after a --context-token random prompt at each --batch; tokens/s counts the generated tokens of every
row over the generation steps only (the prompt step is timed apart). The exporters run back to back
in --rounds interleaved rounds (who goes first alternates), and each round's ratio to the builder
is reported with the median over rounds, so a loaded machine slows both sides of a ratio alike.
Prints a table and writes JSON to benchmarks/results/.

    python -m benchmarks.generate_throughput [--context 2048] [--new-tokens 128] [--batch 1 8] [--threads 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
import torch
import transformers

from headfold import convert
from headfold.graphs.export import export
from headfold.ground.artifacts import GENAI_CONFIG

RESULTS = Path(__file__).parent / "results" / "generate_throughput.json"


def random_llama(folder: Path, layers: int, heads: int, head_dim: int, vocab: int, positions: int) -> Path:
    """A Llama of random weights N(0, 0.02), MLP 2.6875 × hidden, saved with a minimal generation config."""
    hidden = heads * head_dim
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, max_position_embeddings=positions,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    assert hidden != vocab, "the model builder would mistake a hidden × hidden Linear for the LM head"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02) if param.ndim > 1 else param.fill_(1.0)
    model.save_pretrained(folder)
    _word_tokenizer(folder, vocab)
    return folder


def _word_tokenizer(folder: Path, vocab: int) -> None:
    """A WordLevel tokenizer of `vocab` placeholder words: the builder copies a tokenizer into its folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w3"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w3"}) + "\n")


def build_with_og(checkpoint: Path, out: Path) -> Path:
    """og's own builder; the config's search block is left as the builder writes it."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out), "-p", "fp32", "-e", "cpu"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return out


def _set_threads(folder: Path, threads: int) -> None:
    """The same intra-op thread count for every folder (genai_config's session options)."""
    path = folder / GENAI_CONFIG
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=2))


def tokens_per_second(folder: Path, batch: int, context: int, new_tokens: int, vocab: int, threads: int) -> dict:
    _set_threads(folder, threads)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + new_tokens, min_length=context + new_tokens, do_sample=False, batch_size=batch)
    generator = og.Generator(model, params)
    prompt = np.random.default_rng(0).integers(3, vocab, (batch, context)).astype(np.int32)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    generator.generate_next_token()  # the prompt step: logits of the whole context
    prompted = time.perf_counter()
    steps = 1
    while not generator.is_done():
        generator.generate_next_token()
        steps += 1
    done = time.perf_counter()
    return {"prompt_s": round(prompted - start, 3), "steps": steps, "tokens_per_s": round(batch * (steps - 1) / (done - prompted), 1)}


def nodes_and_files(folder: Path) -> dict:
    import onnx

    graph = onnx.load(folder / "model.onnx", load_external_data=False)
    return {"nodes": len(graph.graph.node), "files": sorted(p.name for p in folder.iterdir() if ".onnx" in p.name)}


EXPORTERS = {
    "og builder": None,
    "headfold": {"attention": "onnx"},  # the standard Attention graph
    "headfold gqa": {"attention": "ort-gqa", "optimize": "ort"},  # what the default folder is now
}


def model_folders(checkpoint: Path, root: Path, exporters: list[str]) -> dict[str, Path]:
    folders = {}
    for exporter in exporters:
        folder = root / f"{checkpoint.name}-{exporter.replace(' ', '-')}"
        if EXPORTERS[exporter] is None:
            build_with_og(checkpoint, folder)
        else:
            export(checkpoint, folder, progress=False, **EXPORTERS[exporter])
        folders[exporter] = folder
    return folders


def paired_ratios(rows: list[dict], exporters: list[str]) -> list[dict]:
    """Per (variant, batch, round): each exporter's tokens/s over the builder's, measured back to back."""
    pairs = []
    for key in sorted({(r["variant"], r["batch"], r["round"]) for r in rows}, key=str):
        same = {r["exporter"]: r["tokens_per_s"] for r in rows if (r["variant"], r["batch"], r["round"]) == key}
        for exporter in exporters[1:]:
            pairs.append(
                {"variant": key[0], "batch": key[1], "round": key[2], "exporter": exporter, "vs_builder": round(same[exporter] / same[exporters[0]], 3)}
            )
    return pairs


def median_ratios(pairs: list[dict]) -> list[dict]:
    """Per (variant, batch, exporter): the median of the rounds' ratios, and their range."""
    summary = []
    for key in sorted({(p["variant"], p["batch"], p["exporter"]) for p in pairs}, key=str):
        ratios = [p["vs_builder"] for p in pairs if (p["variant"], p["batch"], p["exporter"]) == key]
        summary.append({"variant": key[0], "batch": key[1], "exporter": key[2], "rounds": len(ratios),
                        "median_vs_builder": round(float(np.median(ratios)), 3), "min": min(ratios), "max": max(ratios)})  # fmt: skip
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds: every exporter once per round, back to back")
    parser.add_argument("--exporters", nargs="+", default=["og builder", "headfold gqa"], choices=list(EXPORTERS), help="the first is the reference")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON results file")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        positions = 2 * (args.context + args.new_tokens)
        mha = random_llama(root / "MHA", args.layers, args.heads, args.head_dim, args.vocab, positions)
        checkpoints = {"MHA": mha, "GQA h/4": convert(mha, root / "GQA-h4", args.heads // 4, progress=False)}
        for variant, checkpoint in checkpoints.items():
            folders = model_folders(checkpoint, root, args.exporters)
            for batch in args.batch:
                for round_ in range(args.rounds):  # interleaved: the machine's load hits every exporter alike
                    order = list(folders.items())
                    for exporter, folder in order if round_ % 2 == 0 else order[::-1]:  # who goes first alternates
                        result = tokens_per_second(folder, batch, args.context, args.new_tokens, args.vocab, args.threads)
                        row = {"variant": variant, "exporter": exporter, "batch": batch, "round": round_, **result}
                        rows.append({**row, "load_1min": round(os.getloadavg()[0], 1), **nodes_and_files(folder)})
                        print(json.dumps(rows[-1]), flush=True)
    pairs = paired_ratios(rows, args.exporters)
    print(f"\n{'variant':8} {'exporter':12} {'batch':>5} {'round':>5} {'tokens/s':>9} {'prompt s':>8} {'nodes':>5} {'load':>5}")
    for r in rows:
        print(
            f"{r['variant']:8} {r['exporter']:12} {r['batch']:>5} {r['round']:>5} {r['tokens_per_s']:>9} {r['prompt_s']:>8} {r['nodes']:>5} {r['load_1min']:>5}"
        )
    for p in pairs:
        print(f"{p['variant']:8} batch {p['batch']} round {p['round']}: {p['exporter']} / builder = {p['vs_builder']}")
    medians = median_ratios(pairs)
    for m in medians:
        print(
            f"{m['variant']:8} batch {m['batch']}: {m['exporter']} / builder, median of {m['rounds']} rounds = {m['median_vs_builder']} ({m['min']}–{m['max']})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "rows": rows, "pairs": pairs, "medians": medians}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
