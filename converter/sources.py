"""Where a checkpoint comes from: a local folder, or a Hugging Face hub id `ORG/NAME` resolved to its
snapshot in the hub cache through huggingface_hub (its cache, HF_HOME, HF_HUB_OFFLINE, HF_TOKEN).

Only the files a stage reads are fetched: config, generation config, tokenizer and processor files,
sentence-transformers modules, and the weights, safetensors first (`model*.safetensors` and their
index, never a repo's other copies such as `consolidated.safetensors`); pickles only with
allow_pickle and only when the repo has no safetensors. A snapshot folder (…/models--ORG--NAME/
snapshots/COMMIT) names its repo and commit itself: `hub_origin` reads them back for manifests.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from headfold.ground.errors import BadInput, first_line

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})")
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
    """`ORG/NAME` that is not a path on this machine (a local folder always wins)."""
    text = os.fspath(source)
    return bool(HUB_ID.fullmatch(text)) and not os.path.lexists(text)


def hub_origin(folder: Path) -> HubOrigin | None:
    """The repo and commit of a hub cache snapshot folder; None for any other folder."""
    m = _SNAPSHOT.search(Path(folder).resolve().as_posix())
    return HubOrigin(f"{m['org']}/{m['name']}", m["commit"]) if m else None


def checkpoint_folders(*sources: str | os.PathLike, revision: str | None = None, allow_pickle: bool = False) -> list[Path]:
    """Each source's local folder (checkpoint_folder); `revision` applies to the hub ids among them,
    and is refused when there is none."""
    if revision is not None and not any(map(is_hub_id, sources)):
        raise BadInput(f"--revision {revision} applies to hub ids (ORG/NAME) and none was given; drop --revision")
    return [checkpoint_folder(s, revision=revision, allow_pickle=allow_pickle) for s in sources]


def checkpoint_folder(source: str | os.PathLike, *, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """The local folder of a checkpoint given as a folder (returned as it is: the stages check it) or
    a hub id (fetched into the hub cache when online, read from it when HF_HUB_OFFLINE=1); BadInput in
    one line naming the id and the fix. `revision` applies to hub ids only."""
    if not is_hub_id(source):
        return Path(source)
    repo_id = os.fspath(source)
    folder = _snapshot(repo_id, revision, [*CONFIGS, *TOKENIZERS, *SENTENCE_TRANSFORMERS, *SAFETENSORS])
    if allow_pickle and not any(folder.glob("*.safetensors")):
        folder = _snapshot(repo_id, revision, PICKLES)
    return folder


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub

    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except hub.LocalEntryNotFoundError:
        raise BadInput(
            f"{at} is neither a local folder nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), and downloads are off "
            f"(HF_HUB_OFFLINE); check the path, or fetch it with `hf download {repo_id}{f' --revision {revision}' if revision else ''}` "
            "(online) or unset HF_HUB_OFFLINE"
        ) from None
    except hub.GatedRepoError:
        raise BadInput(f"{repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN to a token with access") from None
    except hub.RevisionNotFoundError:
        raise BadInput(f"{repo_id} has no revision {revision!r}; pass an existing branch, tag or commit with --revision") from None
    except hub.RepositoryNotFoundError:
        raise BadInput(f"{repo_id} is neither a local folder nor a model on the Hugging Face hub (or it is private: set HF_TOKEN); check the name") from None
    except (hub.HfHubHTTPError, OSError) as err:
        raise BadInput(f"cannot fetch {at} from the Hugging Face hub ({first_line(err)}); check the network, or use a local folder") from None
