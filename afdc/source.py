"""Where a model comes from: a hub id, a local model directory, or a ``config.json`` file.

Configs resolve through transformers (and so the standard Hugging Face cache, honouring
``HF_HUB_OFFLINE``). Models for inspection and compilation are built on the meta device with
accelerate's empty-weight init: no weights are read or allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig, PreTrainedModel

from afdc import model_class
from afdc.artifact.manifest import MANIFEST
from afdc.errors import AfdcError, UnsupportedModelError


def load_config(source: str) -> PretrainedConfig:
    path = Path(source)
    if path.is_file():
        data = json.loads(path.read_text())
        model_type = data.pop("model_type", None)
        if model_type not in CONFIG_MAPPING:
            raise UnsupportedModelError(
                f"{source}: unknown model_type {model_type!r}; transformers {_tf_version()} knows "
                f"{len(CONFIG_MAPPING)} types (upgrade transformers or check the file)"
            )
        return CONFIG_MAPPING[model_type](**data)
    if path.is_dir() and not (path / "config.json").is_file():
        if (path / MANIFEST).is_file():
            raise AfdcError(
                f"{source} is an afdc artifact, not a model: serve it (afdc serve / afdc up) or load it "
                f"(afdc.load_deployment); its model's config is {path / 'model' / 'config.json'}"
            )
        raise AfdcError(f"{source} has no config.json: give the directory a model was saved to (save_pretrained)")
    if not path.exists() and (source.startswith((".", "/", "~")) or source.count("/") > 1):
        raise AfdcError(f"no such directory: {source} (give a model directory, a config .json file or a hub id)")
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as err:
        hint = "a local directory with config.json, a config .json file, or a hub id in the local cache"
        raise AfdcError(f"cannot load a model config from {source!r} ({err}); MODEL must be {hint}") from err


def empty_model(config: PretrainedConfig, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The model's module tree on the meta device (no memory for weights), in the config's dtype."""
    if dtype is None:
        dtype = getattr(config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with init_empty_weights(include_buffers=True):
        try:
            model = model_class.from_config(config, dtype=dtype)
        except ValueError as err:
            raise UnsupportedModelError(
                f"{config.model_type} has no causal-LM (or image-text-to-text) class in transformers: {err}"
            ) from err
        except ImportError as err:  # a multimodal model's tower (Gemma 3n's vision tower needs timm)
            needs = " ".join(str(err).split())
            raise AfdcError(
                f"transformers builds {config.model_type}'s model class only with a library that is not installed "
                f"here; install it and compile again ({needs})"
            ) from err
    return model.eval()


def _tf_version() -> str:
    import transformers

    return transformers.__version__
