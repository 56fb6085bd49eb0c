"""afdc's out-of-tree vLLM platform: it points vLLM's engine at afdc's worker.

It is registered under the ``vllm.platform_plugins`` entry point and is active only in
processes started by ``afdc serve --role attn`` (which set :data:`afdc.serve.settings.ENV`),
so installing afdc never changes how vLLM runs anything else. The same platform serves a CPU
and a GPU device: only the device queries differ, the worker's code path does not.

vLLM resolves the served config's architecture in its model registry before any worker starts,
to learn the model's interfaces (hybrid, inner state), by importing its own implementation of it
in a subprocess; Qwen3.5-MoE's imports torchvision, and an architecture vLLM lacks falls back to
its Transformers backend. afdc's worker runs the artifact's attention program and never builds a
vLLM model, so every architecture of the served config resolves to :class:`AfdcServedModel`.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
from torch import nn
from vllm.platforms.interface import Platform, PlatformEnum

from afdc.serve.settings import WorkerSettings, active

WORKER = "afdc.serve.worker.AfdcWorker"
logger = logging.getLogger("vllm.afdc.platform")


def register() -> str | None:
    """The ``vllm.platform_plugins`` entry point."""
    return "afdc.serve.platform.AfdcPlatform" if active() else None


def _device() -> torch.device:
    return torch.device(WorkerSettings.from_env().device if active() else "cpu")


def _ray_resource() -> str:
    """What each attention rank takes from a Ray node under ``--data-parallel-backend ray``
    (vLLM places each DP engine on a node with one unit of it)."""
    chosen = WorkerSettings.from_env().ray_resource if active() else None
    return chosen or ("GPU" if _device().type == "cuda" else "CPU")


@functools.cache
def _has_mixers() -> bool:
    """Whether the served artifact has stateful mixers (their state goes in vLLM's hybrid groups)."""
    from afdc.artifact.manifest import read_manifest

    return active() and bool(read_manifest(Path(WorkerSettings.from_env().artifact)).mixers)


@functools.cache
def _attention_ranks() -> int:
    from afdc.artifact.manifest import read_manifest

    return read_manifest(Path(WorkerSettings.from_env().artifact)).plan.attention_ranks


def read_config_as_compiled() -> None:
    """vLLM reads the artifact's config as transformers writes it, which afdc compiled from.

    Where vLLM registers a config class of its own for the served model type and that class
    refuses the config (vLLM's DeepSeek-V4 config reads the released checkpoint's keys;
    transformers' names its MoE layers ``hash_moe``/``moe``, which vLLM's base class validation
    refuses), vLLM is told to read it with transformers' class. And RoPE parameters nested by
    RoPE kind rather than by layer type (DeepSeek-V4's ``main`` and ``compress``), which vLLM
    reads only to check the context length, are read as nested, not as one flat entry. Run in
    each vLLM process that reads the config: the API server (before vLLM builds its
    configuration) and the engine core (by afdc's worker, before vLLM reads it for the tokenizer)."""
    import vllm.config.model as model_config
    from huggingface_hub.errors import StrictDataclassError
    from vllm.transformers_utils.config import _CONFIG_REGISTRY, is_rope_parameters_nested

    def nested(rope: dict) -> bool:
        return is_rope_parameters_nested(rope) or all(isinstance(p, dict) and "rope_type" in p for p in rope.values())

    model_config.is_rope_parameters_nested = nested

    from afdc.artifact.load import model_dir

    directory = model_dir(WorkerSettings.from_env().artifact)
    model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    if model_type not in _CONFIG_REGISTRY:
        return
    try:
        _CONFIG_REGISTRY[model_type].from_pretrained(directory)
    except (ValueError, TypeError, StrictDataclassError) as err:
        logger.info("afdc: %s config read by transformers' class, as compiled (vLLM's refuses it: %s)",
                    model_type, err)
        del _CONFIG_REGISTRY[model_type]


def _architectures() -> list[str]:
    """The architectures the served artifact's model config names (what vLLM resolves)."""
    from afdc.artifact.load import model_dir

    config = json.loads((model_dir(WorkerSettings.from_env().artifact) / "config.json").read_text())
    return list(config.get("architectures") or [])


class AfdcServedModel(nn.Module):
    """What vLLM's model registry resolves the served architectures to: the interfaces vLLM's
    configuration reads (a subclass per artifact says whether it is a hybrid with mixer state),
    and no model: afdc's worker runs the artifact's attention program, so nothing builds this."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        raise NotImplementedError("afdc's worker runs the artifact's attention program; vLLM builds no model")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("afdc's worker runs the artifact's attention program")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("afdc's worker runs the artifact's attention program")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("afdc's worker runs the artifact's attention program")


def _served_model(name: str) -> type[AfdcServedModel]:
    # vLLM reads the interfaces as class attributes (vllm.model_executor.models.interfaces)
    hybrid = _has_mixers()
    return type(name, (AfdcServedModel,), {"is_hybrid": hybrid, "has_inner_state": hybrid})


def _check_speculation(config) -> None:
    """Refuse a speculative decoding method afdc's worker does not run (``vllm serve`` by hand;
    ``afdc serve`` refused it before vLLM started)."""
    from afdc.artifact.manifest import read_manifest
    from afdc.serve.speculative_config import DRAFTING, artifact_refusal

    if config is None:
        return
    manifest = read_manifest(Path(WorkerSettings.from_env().artifact))
    given = {"method": config.method, **{name: getattr(config, name, None) for name in DRAFTING}}
    why = artifact_refusal(given, manifest)
    if why:
        raise ValueError(why)


class AfdcPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = device_type = _device().type
    dispatch_key = device_type.upper()
    ray_device_key = _ray_resource()
    dist_backend = "gloo"

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Called by vLLM before it builds its configuration (and so resolves the architecture)."""
        from vllm.model_executor.models import ModelRegistry

        read_config_as_compiled()
        for name in _architectures():
            ModelRegistry.register_model(name, _served_model(name))

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        # afdc's worker runs the compiled attention program itself: no vLLM model, no vLLM
        # compilation or CUDA graphs, one worker in the engine-core process
        parallel = vllm_config.parallel_config
        parallel.worker_cls = WORKER
        parallel.distributed_executor_backend = "uni"
        # `vllm serve` run without `afdc serve` (which checks it before vLLM starts, a DP size of 1
        # included); an engine core's own config has a DP size of 1 once vLLM made it independent
        if parallel.data_parallel_size not in (1, _attention_ranks()):
            raise ValueError(
                f"the artifact's plan has {_attention_ranks()} attention ranks but vLLM runs "
                f"--data-parallel-size {parallel.data_parallel_size}: each attention rank is one DP rank"
            )
        # The served attention program has no experts: they are on the FFN ranks, which gather per
        # layer whatever the attention ranks send and run no collective across them. So the DP
        # ranks need none of vLLM's MoE lockstep (dummy steps on idle ranks, a DP all-reduce each
        # step): with no experts vLLM runs each DP rank's engine on its own (the coordinator still
        # balances requests), and an idle attention rank makes no step at all.
        _check_speculation(vllm_config.speculative_config)
        vllm_config.model_config.model_arch_config.num_experts = 0
        vllm_config.model_config.enforce_eager = True
        vllm_config.compilation_config.mode = CompilationMode.NONE
        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        vllm_config.scheduler_config.async_scheduling = False
        if vllm_config.cache_config.block_size is None:
            vllm_config.cache_config.block_size = 16
        if _has_mixers():
            cache = vllm_config.cache_config
            if cache.enable_prefix_caching:
                # a cached prefix's blocks hold its keys and values, but no mixer state at its end
                logger.info("afdc: prefix caching off: the model's stateful mixers keep no state per cached prefix")
                cache.enable_prefix_caching = False
            if cache.user_specified_mamba_block_size:
                raise ValueError("--mamba-block-size: afdc keeps one state block per request; leave it unset")
            # one state block per request, spanning the context (vLLM's own default without caching);
            # vLLM may have sized it for prefix caching when it knows the architecture
            cache.mamba_cache_mode, cache.mamba_block_size = "none", None

    @classmethod
    def update_block_size_for_backend(cls, vllm_config) -> None:
        """afdc's worker owns attention: no vLLM backend's block size applies (a mixer's state
        page and the attention page are unified when vLLM lays out the KV-cache groups)."""

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        device = _device()
        return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        device = _device()
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return WorkerSettings.from_env().kv_cache_bytes

    @classmethod
    def is_cpu(cls) -> bool:
        # vLLM's shutdown empties the accelerator cache unless told this is a CPU
        return _device().type == "cpu"

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        """afdc runs its own programs: vLLM's compiled kernels (``vllm._C``) are never loaded."""

    @classmethod
    def get_attn_backend_cls(cls, *args, **kwargs) -> str:
        raise NotImplementedError("afdc's worker owns attention; no vLLM attention backend is used")

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # stateful mixers' state blocks are a KV-cache group of their own; without mixers every
        # layer stays in one group (a sliding window keeps all its blocks: afdc's attention reads them)
        return _has_mixers()

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        device = device or _device()
        return float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0.0

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        from afdc.serve.sampling import refuse_unsupported

        refuse_unsupported(params)
