"""Where a checkpoint comes from: a local folder, or a Hugging Face hub id (`ORG/NAME`, or a canonical
id without an organisation such as `gpt2`) resolved to its snapshot in the hub cache through
huggingface_hub (its cache, HF_HOME, HF_HUB_OFFLINE, HF_TOKEN).

How an argument reads (`checkpoint_folder`): what exists here is local, always. What does not exist
and looks like a path (`./x`, `../x`, `/x`, `~/x`, `x/`, more than one `/`, or a first part that is
a folder here: `out/typo`) is "no such file or folder". Anything else is a hub id when huggingface_hub's
own validator takes it, and "neither a folder nor a valid hub id" when it does not. An id the cache
lacks is answered with the cause that holds (HF_HUB_OFFLINE set, the hub unreachable, or a revision
the cache does not have), naming both readings and a folder with a near name if there is one.

The cache never leads outside itself: a --revision that is a path, a refs/ file that is a link or
names anything but a commit, and a snapshot folder or tree listing that resolves outside the cache
are refused before huggingface_hub reads them (the links inside a snapshot are checked where the
folder is read: ground/inputs.py).

Only the files a stage reads are fetched: config, generation config, tokenizer and processor files,
sentence-transformers modules, and the weights, safetensors first (`model*.safetensors` and their
index, never a repo's other copies such as `consolidated.safetensors`); pickles only with
allow_pickle and only when the repo has no safetensors. A snapshot folder (…/models--ORG--NAME/
snapshots/COMMIT) names its repo and commit itself: `hub_origin` reads them back for manifests.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from headfold.ground import inputs
from headfold.ground.errors import BadInput, first_line
from headfold.ground.lazy import lazy_import

# huggingface_hub loads for a hub id only: a local folder (and `headfold --help`) never imports it
huggingface_hub = lazy_import("huggingface_hub")
constants = lazy_import("huggingface_hub.constants")
file_download = lazy_import("huggingface_hub.file_download")
hub = lazy_import("huggingface_hub.errors")
hub_utils = lazy_import("huggingface_hub.utils")

_SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})")
CONFIGS = ["config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json"]
TOKENIZERS = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
              "vocab.txt", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja"]  # fmt: skip
SENTENCE_TRANSFORMERS = ["modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "[0-9]_*/*.json"]
SAFETENSORS = ["model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"]
PICKLES = ["pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json"]


@dataclass(frozen=True)
class HubOrigin:
    repo_id: str
    commit: str


def is_hub_id(source: str | os.PathLike) -> bool:
    """Whether `source` reads as a hub id: nothing of that name here, not shaped like a path, and a
    repo id huggingface_hub accepts."""
    text = os.fspath(source)
    return not os.path.lexists(text) and not _looks_like_path(text) and _invalid_id(text) is None


def hub_origin(folder: Path) -> HubOrigin | None:
    """The repo and commit of a hub cache snapshot folder; None for any other folder."""
    m = _SNAPSHOT.search(Path(folder).resolve().as_posix())
    return HubOrigin(m["repo"].replace("--", "/"), m["commit"]) if m else None  # an id never holds "--"


def checkpoint_folders(*sources: str | os.PathLike, revision: str | None = None, allow_pickle: bool = False) -> list[Path]:
    """Each source's local folder (checkpoint_folder); `revision` applies to the hub ids among them,
    and is refused when there is none."""
    if revision is not None and not any(map(is_hub_id, sources)):
        raise BadInput(f"--revision {revision} applies to hub ids (ORG/NAME) and none was given; drop --revision")
    return [checkpoint_folder(s, revision=revision, allow_pickle=allow_pickle) for s in sources]


def checkpoint_folder(source: str | os.PathLike, *, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """The local folder of a checkpoint given as a path (returned as it is when it exists: the stages
    check it) or a hub id (fetched into the hub cache when online, read from it when HF_HUB_OFFLINE=1);
    BadInput in one line naming the argument, how it was read, and the fix. `revision` applies to hub
    ids only."""
    text = os.fspath(source)
    if os.path.lexists(text):
        return Path(source)
    if _looks_like_path(text):
        reads = f" ({text.split('/')[0]}/ is a folder here, so this reads as a path, not a hub id)" if _under_local_folder(text) else ""
        raise BadInput(f"no such file or folder: {text}{_near(text)}{reads}; check the path")
    if (invalid := _invalid_id(text)) is not None:
        raise BadInput(f"{text} is neither a local folder{_near(text)} nor a valid hub id ({invalid}); check the path or the id")
    folder = _snapshot(text, revision, [*CONFIGS, *TOKENIZERS, *SENTENCE_TRANSFORMERS, *SAFETENSORS])
    if allow_pickle and not any(folder.glob("*.safetensors")):
        folder = _snapshot(text, revision, PICKLES)
    return folder


# -- how an argument reads ----------------------------------------------------------------------
def _looks_like_path(text: str) -> bool:
    """`./x`, `../x`, `/x`, `~/x`, `.x`, `x/`, a backslash, more than one `/`, or `DIR/x` with DIR a folder
    here: no hub id is written so."""
    return text.startswith((".", "/", "~")) or text.endswith("/") or "\\" in text or text.count("/") > 1 or _under_local_folder(text)


def _under_local_folder(text: str) -> bool:
    """`DIR/x` with DIR a folder here, named as an organisation could be."""
    head = text.split("/")[0]
    return text.count("/") == 1 and not head.startswith((".", "~")) and os.path.isdir(head)


def _invalid_id(text: str) -> str | None:
    """Why huggingface_hub refuses `text` as a repo id, or None when it takes it."""
    try:
        hub_utils.validate_repo_id(text)
    except hub.HFValidationError as err:
        return first_line(err).replace(f": '{text}'", "").rstrip(".")  # the id once in the line is enough
    return None


def _near(text: str) -> str:
    """' (did you mean NAME?)' for an entry beside the missing path whose name is close to it."""
    path = Path(text).expanduser()
    try:
        names = [entry.name for entry in os.scandir(path.parent)]
    except OSError:
        return ""
    near = difflib.get_close_matches(path.name, names, n=1, cutoff=0.75)
    return f" (did you mean {path.parent / near[0]}?)" if near else ""


# -- the hub cache ------------------------------------------------------------------------------
def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    _stay_inside_cache(repo_id, revision)
    try:
        folder = Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except hub.LocalEntryNotFoundError as err:  # offline, unreachable, or an incomplete copy: what the cache has decides
        raise BadInput(_not_in_cache(repo_id, revision, err)) from None
    except hub.GatedRepoError:
        raise BadInput(f"{repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN to a token with access") from None
    except hub.RevisionNotFoundError:
        raise BadInput(f"{repo_id} has no revision {revision!r} on the hub; pass an existing branch, tag or commit with --revision") from None
    except hub.RepositoryNotFoundError:
        raise BadInput(
            f"{repo_id} is neither a local folder{_near(repo_id)} nor a model on the Hugging Face hub (or it is private: set HF_TOKEN); check the name"
        ) from None
    except (hub.HfHubHTTPError, OSError) as err:
        raise BadInput(
            f"cannot fetch {_at(repo_id, revision)} from the Hugging Face hub ({first_line(err)}); check the network, or use a local folder"
        ) from None
    cache = Path(constants.HF_HUB_CACHE).resolve()
    if inputs.outside(folder, (cache,)):
        raise BadInput(f"{folder} resolves outside the Hugging Face cache ({cache}); headfold reads nothing outside it: delete {folder} and download again")
    return folder


def _stay_inside_cache(repo_id: str, revision: str | None) -> None:
    """Refuse, before huggingface_hub reads them, a revision that is a path, and the cache entries it
    would follow (refs/REVISION, snapshots/COMMIT, trees/COMMIT.json) when one leads outside the cache
    or a ref is not a plain file naming a commit."""
    if revision is not None and (revision.startswith(("/", "~")) or "\\" in revision or ".." in revision or "" in revision.split("/")):
        raise BadInput(f"--revision {revision} is a path, not a branch, tag or commit; pass one of those")
    cache = Path(constants.HF_HUB_CACHE)
    repo = cache / file_download.repo_folder_name(repo_id=repo_id, repo_type="model")
    roots = (cache.resolve(),)
    fix = f"delete {repo} and download it again"
    commit = revision or "main"
    ref = repo / "refs" / commit
    if not file_download.REGEX_COMMIT_HASH.fullmatch(commit) and os.path.lexists(ref):
        if ref.is_symlink() or not ref.is_file() or inputs.outside(ref, roots):
            raise BadInput(f"{ref} is not a plain file inside the Hugging Face cache ({cache}); a ref is a file naming a commit: {fix}")
        with open(ref, encoding="utf-8", errors="replace") as file:
            commit = file.read(64)
        if not file_download.REGEX_COMMIT_HASH.fullmatch(commit):
            raise BadInput(f"{ref} names {inputs.printable(commit[:48])!r}, not a commit; {fix}")
    for entry in (repo / "snapshots" / commit, repo / "trees" / f"{commit}.json"):
        if os.path.lexists(entry) and inputs.outside(entry, roots):
            raise BadInput(f"{entry} leads outside the Hugging Face cache ({cache}), to {entry.resolve()}; headfold reads nothing outside it: {fix}")


def _not_in_cache(repo_id: str, revision: str | None, err: Exception) -> str:
    """The one line for an id the cache cannot serve: what the cache has, then why nothing was fetched."""
    at, cache = _at(repo_id, revision), constants.HF_HUB_CACHE
    if isinstance(err, getattr(hub, "IncompleteSnapshotError", ())):  # huggingface_hub 2 on
        what = f"the Hugging Face cache ({cache}) holds an incomplete copy of {at}"
    elif refs := _cached_refs(repo_id):
        what = f"the Hugging Face cache ({cache}) has {repo_id} at {', '.join(refs)} but not at {revision or 'main'} (--revision picks one)"
    else:
        what = f"{at} is neither a local folder{_near(repo_id)} nor in the Hugging Face cache ({cache})"
    if constants.HF_HUB_OFFLINE:
        fetch = f"hf download {repo_id}{f' --revision {revision}' if revision else ''}"
        return f"{what}, and downloads are off because HF_HUB_OFFLINE is set; check the name, or fetch it with `{fetch}` where online, or unset HF_HUB_OFFLINE"
    return (
        f"{what}, and the Hugging Face hub cannot be reached ({first_line(err.__cause__ or err)}); check the name, the network or HF_ENDPOINT, or "
        "use a local folder"
    )


def _cached_refs(repo_id: str) -> list[str]:
    """The branch and tag names the cache has for `repo_id` (names only: nothing is read)."""
    refs = Path(constants.HF_HUB_CACHE) / file_download.repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    return sorted(Path(parent, name).relative_to(refs).as_posix() for parent, _, names in os.walk(refs) for name in names)


def _at(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id
