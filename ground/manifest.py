"""headfold.json, the manifest of a checkpoint headfold wrote: written by `headfold convert` and,
chained, by `headfold distill`; read by verify (is this a conversion of that reference?), by
distill (is the student converted from the teacher?) and by convert (a converted source's own
manifest is kept under `source.manifest`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headfold.ground.artifacts import MANIFEST, Record, keep_unknown, load_record, mark, optional

FORMAT = 1
Counts = int | list[int]  # one value for every layer, or one per layer


@dataclass(kw_only=True)
class ManifestSource(Record):
    path: str
    model_type: str | None
    family: str | None = None
    heads: int | None = None
    kv_heads: Counts | None = None
    head_dim: int | None = None
    config_sha256: str  # identifies the source model: verify and distill compare it
    manifest: dict[str, Any] | None = None  # the source's own headfold.json when it was a conversion
    repo_id: str | None = optional()  # a source given as a hub id: the repo, and the commit it resolved to
    revision: str | None = optional()
    extra: dict[str, Any] = keep_unknown()


@dataclass(kw_only=True)
class Conversion(Record):
    method: str
    kv_heads: Counts
    group_size: Counts | None = None
    kv_head_of_query_head: list[Any] | None = None  # one list, or one per layer
    # which source kv heads each new kv head pools: one list for every layer, or one per layer
    # when `grouped` chose per layer (query heads were then permuted to match)
    source_kv_heads_of_kv_head: list[Any] | None = None
    calibration: dict[str, Any] | None = optional()  # data-aware methods: text, tokens, seed
    # encoder-decoders: per attention kind {heads, kv_heads, pooled}; the per-block lists above run over the
    # kinds in this order. cache_bytes_per_token: {"self"/"cross": {"before", "after"}} (cross: per source token)
    attentions: dict[str, Any] | None = optional()
    cache_bytes_per_token: dict[str, Any] | None = optional()
    extra: dict[str, Any] = keep_unknown()


@dataclass(kw_only=True)
class Manifest(Record):
    format: int = FORMAT
    created_by: str = mark()  # --overwrite replaces the folder only with this mark in it
    source: ManifestSource
    conversion: Conversion
    loader: str | None = None  # transformers | headfold.load_model
    versions: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # every written file -> sha256
    skipped_weight_files: list[str] = field(default_factory=list)
    distillation: dict[str, Any] | None = optional()  # headfold distill's record
    extra: dict[str, Any] = keep_unknown()

    def save_in(self, folder: Path) -> None:
        self.save(Path(folder) / MANIFEST)


def exists(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def load(folder: Path, fix: str | None = None) -> Manifest:
    """The headfold.json in `folder`; BadInput "…/headfold.json is corrupt (why); fix" when it does not fit."""
    return load_record(Manifest, Path(folder) / MANIFEST, fix or f"re-run headfold convert into {folder}")


def load_raw(folder: Path, fix: str) -> dict[str, Any]:
    """A manifest as it is written (checked against the contract first), to nest in another one."""
    return load(folder, fix).to_dict()
