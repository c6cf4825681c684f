"""Test-only: kvbridge's vLLM connector that corrupts the KV a decode worker received, so that an
end-to-end test can fail (tests/vllm/test_e2e_engines.py).

Load it like the real one, with ``"kv_connector": "CorruptingKVBridgeConnector",
"kv_connector_module_path": "corrupting_connector"`` (this directory on the engine's PYTHONPATH) and
``kv_connector_extra_config``:

* ``"corrupt": true`` — every received request;
* ``"corrupt": "<text>"`` — only requests whose vLLM request id contains ``<text>`` (the router sets the
  id with an ``X-Request-Id`` header), so one engine serves clean and corrupted requests;
* absent / false — behaves exactly like ``KVBridgeConnector``;
* ``"corrupt_layers": "draft"`` — only the speculative draft's layers (EAGLE / MTP layers numbered after the
  target's, a separate draft model's ``draft_model.*`` layers): the target's KV stays right, so the tokens
  stay equal and only the draft's acceptance can show the corruption (tests/vllm/test_e2e_spec.py).

When a read is reported done (``get_transfer_results`` → ``finished_recving``, not failed), the sign bit of
every element of the request's received blocks, in every layer, is flipped *before* vLLM is told, i.e.
before the decode's first forward reads them. Only public pieces are used: ``register_kv_caches`` (the
tensors), ``bind_connector_metadata`` (``KVBridgeConnectorMetadata.recv[req].local_block_ids``) and
``get_transfer_results``. A connector that never reports the read done (e.g. recomputes the prompt
instead) is not corrupted, and its tokens will match: the test's "tokens differ" check catches that too.
"""
from __future__ import annotations

import logging

from kvbridge.integrations.vllm import KVBridgeConnector

# under "vllm." so vLLM's log handler (the engine's log file) shows it
log = logging.getLogger("vllm.kvbridge_test.corrupting_connector")


class CorruptingKVBridgeConnector(KVBridgeConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.corrupt = extra.get("corrupt", False)
        self.corrupt_layers = extra.get("corrupt_layers", "all")
        self.num_target_layers = int(getattr(vllm_config.model_config.hf_config, "num_hidden_layers", 0) or 0)
        self.corrupt_kv: dict = {}
        self.corrupt_blocks: dict[str, list[int]] = {}
        self.corrupted: list[str] = []

    def _wants(self, req_id: str) -> bool:
        if isinstance(self.corrupt, str):
            return self.corrupt in req_id
        return bool(self.corrupt)

    def register_kv_caches(self, kv_caches):
        self.corrupt_kv = dict(kv_caches)
        if self.corrupt_layers == "draft":
            from kvbridge.integrations.vllm.translate import layer_index
            self.corrupt_kv = {n: t for n, t in kv_caches.items()
                               if layer_index(n, self.num_target_layers) >= self.num_target_layers}
            log.warning("corrupting_connector: corrupts the draft layers only: %s", sorted(self.corrupt_kv))
        super().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        for rid, r in (getattr(connector_metadata, "recv", None) or {}).items():
            if self._wants(rid):
                self.corrupt_blocks[rid] = sorted({int(b) for g in r.local_block_ids for b in g})

    def get_transfer_results(self, finished_req_ids):
        out = super().get_transfer_results(finished_req_ids)
        failed = set(getattr(out, "failed_recving", None) or ())
        for rid in set(out.finished_recving or ()) - failed:
            blocks = self.corrupt_blocks.pop(rid, None)
            if blocks:
                self._flip(rid, blocks)
        for rid in failed:
            self.corrupt_blocks.pop(rid, None)
        return out

    def _flip(self, rid: str, blocks: list[int]) -> None:
        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        for t in self.corrupt_kv.values():
            flat = t.view({2: torch.int16, 4: torch.int32}.get(t.element_size(), torch.int8))
            sign = -(1 << (8 * flat.element_size() - 1))  # the sign bit, as a signed integer
            flat[idx] = flat[idx] ^ sign
        self.corrupted.append(rid)
        log.warning("corrupting_connector: flipped the sign bit of every element of %d received blocks "
                    "(%d layers) of request %s", len(blocks), len(self.corrupt_kv), rid)
