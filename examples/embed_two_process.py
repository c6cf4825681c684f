"""Embedding kvbridge in an engine: two processes, each allocating its own KV tensors.

The prefill (TP=1, block 16) keeps its cache as FlashAttention-style tensors (2, blocks, 16, heads,
dim) per layer; the decode (TP=1, block 32) keeps vLLM 0.33-style [blocks, heads, 32, K|V] views of
one flat buffer. The decode reads one request's KV over NIXL and checks it through its own tensors.

    python examples/embed_two_process.py
"""
import multiprocessing as mp
import time

import numpy as np

import kvbridge

MODEL, TOKENS = "tiny-dense", 100


def prefill(q_port, q_done):
    model = kvbridge.load_model(MODEL)
    engine = kvbridge.EngineLayout(model, tp=1, block_size=16, num_blocks=32)
    g = model.groups[0]
    # the engine allocates its cache: one tensor per layer, K/V axis first
    kv = {layer: np.zeros((2, 32, 16, g.num_heads, g.head_dim), np.float16) for layer in g.layers}
    memory = kvbridge.describe_memory(engine, (0, 0), {l: kvbridge.LayerKV(t, "KBTHD") for l, t in kv.items()})
    ep = kvbridge.PrefillEndpoint(engine, (0, 0), "prefill-0", memory=memory)
    blocks = np.array([5, 9, 2, 30, 17, 11, 8])        # the request's blocks (7 x 16 >= 100 tokens)
    for layer, t in kv.items():                          # "compute" the prompt's KV: token t -> value
        for tok in range(TOKENS):
            t[:, blocks[tok // 16], tok % 16] = layer * 1000 + tok
    attempt = ep.add_request("req-1", {g.name: kvbridge.GroupBlocks.of(blocks)})   # lease on the prefill's clock
    q_port.put((ep.port, attempt))                       # what a router passes on (kv_transfer_params)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "req-1" not in ep.take_freed()["freed"]:
        ep.serve_once()                                  # the engine loop serves the side channel
        time.sleep(0.001)
    q_done.put("freed")
    ep.close()


def decode(port: int, attempt: int) -> int:
    model = kvbridge.load_model(MODEL)
    engine = kvbridge.EngineLayout(model, tp=1, block_size=32, num_blocks=16)
    g = model.groups[0]
    H, D = g.num_heads, g.head_dim
    flat = np.zeros(len(g.layers) * 16 * H * 32 * 2 * D * 2, np.uint8)   # one flat buffer, LBHNC
    per_layer = 16 * H * 32 * 2 * D
    kv = {layer: flat.view(np.float16)[i * per_layer:(i + 1) * per_layer].reshape(16, H, 32, 2 * D)
          for i, layer in enumerate(g.layers)}
    memory = kvbridge.describe_memory(engine, (0, 0), {l: kvbridge.LayerKV(t, "BHNC") for l, t in kv.items()})
    ep = kvbridge.DecodeEndpoint(engine, (0, 0), "decode-0", memory=memory)
    ep.handshake("prefill-0", {(0, 0): f"127.0.0.1:{port}"})
    blocks = np.array([3, 12, 7, 0])                    # 4 x 32 >= 100 tokens
    ep.start(kvbridge.ReadRequest("req-1", "prefill-0", TOKENS,
                                  {g.name: kvbridge.GroupBlocks.of([5, 9, 2, 30, 17, 11, 8])},
                                  {g.name: kvbridge.GroupBlocks.of(blocks)}, attempt=attempt))
    done, failed = ep.wait(30.0)
    assert "req-1" in done, failed
    wrong = 0
    for layer, t in kv.items():                          # check through the decode's own tensors
        for tok in range(TOKENS):
            wrong += int(np.count_nonzero(t[blocks[tok // 32], :, tok % 32, :] != layer * 1000 + tok))
    print(f"decode read {TOKENS} tokens x {len(g.layers)} layers: {wrong} wrong elements")
    ep.close()
    return wrong


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q_port, q_done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=prefill, args=(q_port, q_done))
    p.start()
    wrong = decode(*q_port.get(timeout=60))
    print("prefill:", q_done.get(timeout=30))
    p.join(10)
    raise SystemExit(1 if wrong else 0)
