"""Child process of ``test_cp_translation.py``: builds vLLM 0.33's own process groups (gloo, CPU) for
several TP x PCP x DCP settings of one 4-process world and records, per setting, the ranks vLLM gives
this worker and what kvbridge's translation (:func:`kvbridge.integrations.vllm_cp.cp_from_worker`, reading
those groups) makes of them."""
from __future__ import annotations

import json

SETTINGS = [(2, 2, 4), (2, 2, 2), (2, 2, 1), (4, 1, 2), (4, 1, 4), (1, 4, 4)]  # (tp, pcp, dcp), tp * pcp = 4


def worker(rank: int, world: int, port: int, out: str) -> None:
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from kvbridge.integrations.vllm_cp import cp_from_worker
    res = []
    first = True
    for tp, pcp, dcp in SETTINGS:
        cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                                                        decode_context_parallel_size=dcp),
                         device_config=DeviceConfig("cpu"))
        with set_current_vllm_config(cfg):
            if first:
                ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{port}")
                first = False
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, prefill_context_model_parallel_size=pcp,
                                         decode_context_model_parallel_size=dcp, backend="gloo")
            cp = cp_from_worker(cfg)
            res.append({"setting": [tp, pcp, dcp], "tp_rank": ps.get_tp_group().rank_in_group,
                        "pcp_rank": ps.get_pcp_group().rank_in_group, "dcp_rank": ps.get_dcp_group().rank_in_group,
                        "kvbridge": [cp.stage_rank, cp.dcp_rank, cp.pcp, cp.dcp]})
            ps.destroy_model_parallel()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)
