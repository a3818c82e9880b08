"""The `headfold` command line (contract in DESIGN.md): exit 0 ok, 1 a check failed, 2 bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from headfold.errors import HeadfoldError

METHOD_CHOICES = ("mean", "first")  # mirrors headfold.converter.METHODS without importing torch


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="headfold")
def cli() -> None:
    """Convert MHA transformers to GQA/MQA, export, build engines, verify."""


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--kv-heads", type=int, required=True, help="K/V heads per layer after conversion; must divide the attention heads (1 = MQA, all heads = unchanged).")
@click.option("--method", type=click.Choice(METHOD_CHOICES), default="mean", help="How the K/V heads of a group become one: mean = average them (Ainslie et al. 2023), first = keep the first.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (atomically, only after the conversion succeeded).")
@click.option("--shard-size", default=None, metavar="SIZE", help="Largest output shard, e.g. 2GB or 500MiB. Default: like the source (one file stays one file).")
@click.option("--allow-pickle", is_flag=True, help="Accept pytorch_model.bin pickles (loaded with weights_only=True). Off by default: pickles can run code.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def convert(src: Path, out: Path, kv_heads: int, method: str, overwrite: bool, shard_size: str | None, allow_pickle: bool, quiet: bool) -> None:
    """Convert the Hugging Face checkpoint folder SRC to a GQA/MQA checkpoint in OUT.

    Reads config.json and model.safetensors (or sharded safetensors with their index),
    pools the K/V projection heads of each contiguous group of query heads, and writes
    weights in the source dtype, the updated config.json, every tokenizer/other file and a
    headfold.json manifest. OUT appears only when complete; SRC is never modified.
    """
    from headfold.converter import convert as run_convert

    result = run_convert(src, out, kv_heads, method, overwrite=overwrite, max_shard_size=shard_size, allow_pickle=allow_pickle, progress=not quiet)
    click.echo(f"wrote {result} ({kv_heads} kv heads, method {method})")


@cli.command("export")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--opset", type=int, default=23, help="ONNX opset: 23, 24 or 25 (Attention exists from 23; torch writes invalid models above 25).")
@click.option("--dtype", type=click.Choice(("fp32", "fp16", "bf16")), default="fp32", help="Weight dtype; normalisations stay fp32 inside.")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists (atomically).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def export_cmd(src: Path, out_dir: Path, opset: int, dtype: str, overwrite: bool, quiet: bool) -> None:
    """Export the checkpoint folder SRC to ONNX with one GQA Attention node per layer.

    Decoders get prefill.onnx and decode.onnx (KV cache at kv-heads), encoders model.onnx;
    weights go to .onnx.data. Exits 1 when an attention layer did not fuse.
    """
    from headfold.graphs.export import export

    summary = export(src, out_dir, opset=opset, dtype=dtype, overwrite=overwrite, progress=not quiet)
    for name, graph in summary["graphs"].items():
        click.echo(f"wrote {out_dir / name}: {graph['attention_nodes']} Attention nodes, kv-heads {graph['attention_kv_heads']}")


@cli.command()
@click.option("--kv-heads", "kv_heads", type=int, multiple=True, default=(4, 2, 1), help="Targets to convert to (repeat the option).")
@click.option("--method", "methods", type=click.Choice(METHOD_CHOICES), multiple=True, default=METHOD_CHOICES, help="Methods to compare (repeat the option).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the table as JSON.")
def demo(kv_heads: tuple[int, ...], methods: tuple[str, ...], json_path: Path | None) -> None:
    """Convert the embedded trained model (Llama layout, 8 heads) and measure the cost.

    For each target: KV-cache bytes per token, held-out perplexity, KL to the original and
    top-1 agreement, on Python documentation text the model never saw in training.
    """
    import json

    from headfold.demo import format_table, run_demo

    rows = run_demo(kv_heads, methods)
    click.echo(format_table(rows))
    if json_path:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: headfold's errors become one line and an exit code."""
    try:
        cli.main(args=argv, prog_name="headfold", standalone_mode=False)
    except HeadfoldError as e:
        click.secho(f"headfold: error: {e}", fg="red", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("headfold: aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
