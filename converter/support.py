"""What headfold does with a model whose family it does not convert: one answer, the same in every command.

A family with a spec (converter/specs) converts. Any other model gets `unsupported(config)`: the
families that convert and whether `export` (and so `verify`) still runs on the model unconverted,
which is the case for built-in transformers text models with attention (Falcon, Mistral-likes, ELECTRA).
Only transformers' class-level tables are consulted: no checkpoint code runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from headfold.converter.spec import ConfigKeys, supported_model_types
from headfold.ground import inputs
from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# transformers' tables, read where a family has no spec or a model is built: a mean conversion never loads them
transformers = lazy_import("transformers")
configuration_auto = lazy_import("transformers.models.auto.configuration_auto")
modeling_auto = lazy_import("transformers.models.auto.modeling_auto")

COMMON_KEYS = ConfigKeys("num_attention_heads", "hidden_size", "num_hidden_layers")  # families without a spec


def common_keys(model_type: Any) -> ConfigKeys:
    """The common key names as a family's transformers config class maps them (MPT's `n_heads`)."""
    config_class = _config_class(model_type)
    aliases = config_class.attribute_map if config_class else {}
    return ConfigKeys(*(aliases.get(key, key) for key in (COMMON_KEYS.heads, COMMON_KEYS.hidden, COMMON_KEYS.layers)))


def unconverted_kind(config: dict[str, Any]) -> Literal["decoder", "encoder"]:
    """A family without a spec exports as a decoder when its class is a causal LM, else as an encoder."""
    architecture = (config.get("architectures") or [None])[0]
    return "decoder" if architecture in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else "encoder"


def export_blocker(config: dict[str, Any]) -> str | None:
    """Why `export` cannot run on this unconverted model, or None when it can."""
    model_type = config.get("model_type")
    shown = inputs.shown(model_type)
    if _config_class(model_type) is None:
        return f"transformers has no built-in model_type {shown} (headfold never runs checkpoint code)"
    if config.get("is_encoder_decoder"):
        return f"{shown} is an encoder-decoder; export runs decoder-only and encoder-only text models"
    if config.get("vocab_size") is None:
        return f"{shown} has no vocab_size in config.json (an image, audio or multi-tower model); export runs text models"
    if config.get(heads := common_keys(model_type).heads) is None:
        return f"{shown} has no attention heads (no {heads} in config.json)"
    if (model_class := builtin_class((config.get("architectures") or [None])[0])) is None:
        return "config.json's 'architectures' names no built-in transformers class (headfold never runs checkpoint code)"
    if not getattr(model_class, "_supports_sdpa", False):
        return f"transformers runs {model_class.__name__} with its own attention only, not SDPA, which export traces"
    return None


def unsupported(config: dict[str, Any]) -> BadInput:
    """The one line every command gives for a model headfold cannot convert."""
    blocker = export_blocker(config)
    export = f"export does not run on it either: {blocker}" if blocker else "export and verify run on it unconverted"
    return BadInput(
        f"headfold does not convert model_type {inputs.shown(config.get('model_type'))} (config.json); "
        f"it converts {', '.join(supported_model_types())}; {export}"
    )


def builtin_class(name: Any) -> type[PreTrainedModel] | None:
    """The transformers model class called `name` (config.json's architectures[0]); None for any other name."""
    from transformers import PreTrainedModel  # as the lazy module's attribute, but a class mypy can narrow by

    found = getattr(transformers, name, None) if isinstance(name, str) else None
    return found if isinstance(found, type) and issubclass(found, PreTrainedModel) and found.config_class else None


def _config_class(model_type: Any) -> type[PretrainedConfig] | None:
    mapping = configuration_auto.CONFIG_MAPPING
    return mapping[model_type] if isinstance(model_type, str) and model_type in mapping else None
