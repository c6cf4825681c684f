"""Tiny speculative-decoding checkpoints for the end-to-end tests (tests/vllm/test_e2e_spec.py), written
locally (transformers + safetensors, no hub), in a subprocess like ``e2e_utils.make_tiny_llama``.

A draft built to agree with the target makes acceptance observable: greedy speculative decoding returns
the target's tokens whatever the draft proposes, so only the number of accepted draft tokens shows whether
the draft's KV (moved by the connector) was right. The target is a **1-layer** Llama (hidden 256, 4 heads,
2 KV heads, head_dim 64, vocab 512) whose embedding rows have RMS 1 (``input_layernorm(emb) == emb``: the
norm weights are ones) and whose ``o_proj`` is multiplied by 16, so that attention over the context
dominates the residual (then wrong draft KV changes the draft's proposals). Directories written under
``root``:

* ``target``: that model;
* ``eagle``: an EAGLE-1 head (``EagleLlamaForCausalLM``; config.json a plain 1-layer ``LlamaConfig``) that
  copies the target: ``fc = [I | 0]`` (the next token's embedding, not the target's hidden state), the
  target's layer-0 weights, no ``input_layernorm`` (vLLM's layer 0 has none), the target's embedding and
  ``lm_head`` shared. It drafts the target's next token up to a one-token context shift;
* ``target3``: the target with its embedding rows scaled to RMS 0.01 (its layer sees the same normalised
  input; the residual is then almost all attention);
* ``eagle3``: an EAGLE-3 head for ``target3`` (``LlamaForCausalLMEagle3``, aux hidden states 0 and 1):
  its attention reads the embedding half of its ``[input_layernorm(emb) | hidden]`` input with the target's
  q/k/v weights, ``fc = 0`` (its residual has no embedding: ``target3`` makes that small), the target's
  o_proj, MLP, norms and ``lm_head``. A torch simulation of both (200 random tokens) agreed on 78 % of the
  next tokens (EAGLE-1 on ``target``: 94 %);
* ``draft``: a separate draft LM (speculative method ``draft_model``) computing exactly the target's
  function with **4 KV heads** (the target's 2 KV heads repeated for their query heads): its KV shape
  (4 x 64 per token) differs from the target's (2 x 64), so kvbridge moves it as a group of its own;
* ``mtp``: a target with its own MTP layer (speculative method ``mtp``, the draft is the target's
  checkpoint): the ERNIE-4.5 layout (``Ernie4_5_MoeForCausalLM`` without MoE layers, vLLM's ``ErnieMTP``)
  with the target's weights, and an MTP layer copying the target's layer (``mtp_linear_proj = [I | 0]``;
  q/k rows permuted from ERNIE's interleaved rotary pairs to the Llama layer's halves). vLLM names the MTP
  layer after the target's (``model.layers.1``), like an EAGLE head's.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 4, 2, 64, 512, 1
DRAFT_KV_HEADS = 4  # the separate draft model's KV heads (MHA copy of the target)
O_PROJ_SCALE = 16.0

_SCRIPT = r"""
import json, os, sys, torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
root = sys.argv[1]
H, NH, KVH, D, V = 256, 4, 2, 64, 512
torch.manual_seed(int(sys.argv[2]))
base = dict(hidden_size=H, intermediate_size=2 * H, num_attention_heads=NH, head_dim=D, vocab_size=V,
            bos_token_id=1, eos_token_id=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
cfg = LlamaConfig(num_hidden_layers=1, num_key_value_heads=KVH, **base)
m = LlamaForCausalLM(cfg)
with torch.no_grad():
    e = m.model.embed_tokens.weight
    e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())        # every row RMS 1
    m.model.layers[0].self_attn.o_proj.weight.mul_(16.0)  # attention dominates the residual
m = m.to(torch.bfloat16)
m.save_pretrained(os.path.join(root, "target"))
sd = {k: v.clone().contiguous() for k, v in m.state_dict().items()}
L = "model.layers.0."
eye = torch.eye(H, dtype=torch.bfloat16)
zero = torch.zeros(H, H, dtype=torch.bfloat16)

# EAGLE-1: plain 1-layer LlamaConfig (vLLM makes it EagleLlamaForCausalLM); fc over cat(embedding, hidden)
w = {"fc.weight": torch.cat([eye, zero], 1).contiguous()}
for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
    w[f"layers.0.{k}.weight"] = sd[L + k + ".weight"]
d = os.path.join(root, "eagle")
LlamaConfig(num_hidden_layers=1, num_key_value_heads=KVH, architectures=["LlamaForCausalLM"], **base).save_pretrained(d)
save_file(w, os.path.join(d, "model.safetensors"))

# EAGLE-3's target: embeddings scaled to RMS 0.01 (the draft's residual lacks them)
with torch.no_grad():
    m.model.embed_tokens.weight.mul_(0.01)
m.save_pretrained(os.path.join(root, "target3"))
# EAGLE-3: attention reads the embedding half of [emb | hidden_norm(fc(aux))]; fc = 0
w = {"fc.weight": torch.zeros(H, 2 * H, dtype=torch.bfloat16), "norm.weight": sd["model.norm.weight"],
     "lm_head.weight": sd["lm_head.weight"]}
for k in ("q_proj", "k_proj", "v_proj"):
    t = sd[L + "self_attn." + k + ".weight"]
    w[f"midlayer.self_attn.{k}.weight"] = torch.cat([t, torch.zeros_like(t)], 1).contiguous()
w["midlayer.self_attn.o_proj.weight"] = sd[L + "self_attn.o_proj.weight"]
for k in ("gate_proj", "up_proj", "down_proj"):
    w[f"midlayer.mlp.{k}.weight"] = sd[L + "mlp." + k + ".weight"]
w["midlayer.input_layernorm.weight"] = sd[L + "input_layernorm.weight"]
w["midlayer.hidden_norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
w["midlayer.post_attention_layernorm.weight"] = sd[L + "post_attention_layernorm.weight"]
d = os.path.join(root, "eagle3")
os.makedirs(d, exist_ok=True)
c3 = dict(base, architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
          num_key_value_heads=KVH, draft_vocab_size=V, torch_dtype="bfloat16",
          eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]})
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(c3, f, indent=1)
save_file(w, os.path.join(d, "model.safetensors"))

# draft_model: the target's function with 4 KV heads (each target KV head repeated for its 2 query heads)
cfg4 = LlamaConfig(num_hidden_layers=1, num_key_value_heads=4, **base)
m4 = LlamaForCausalLM(cfg4).to(torch.bfloat16)
sd4 = dict(sd)
for k in ("k_proj", "v_proj"):
    t = sd[L + "self_attn." + k + ".weight"].view(KVH, D, H)
    sd4[L + "self_attn." + k + ".weight"] = t.repeat_interleave(NH // KVH, 0).reshape(NH * D, H).contiguous()
m4.load_state_dict(sd4)
m4.save_pretrained(os.path.join(root, "draft"))

# MTP (ERNIE-4.5 layout, vLLM's ErnieMTP, no MoE layers): the target's weights (ERNIE's attention rotates
# interleaved pairs, vLLM's Llama layer in the MTP block rotates halves: the MTP block's q/k rows are
# permuted so that both compute the same scores) and one MTP layer copying the target's layer
d = os.path.join(root, "mtp")
os.makedirs(d, exist_ok=True)
perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
w = dict(sd)
w["model.mtp_emb_norm.0.weight"] = torch.ones(H, dtype=torch.bfloat16)
w["model.mtp_hidden_norm.0.weight"] = torch.ones(H, dtype=torch.bfloat16)
w["model.mtp_linear_proj.0.weight"] = torch.cat([eye, zero], 1).contiguous()
for k in ("q_proj", "k_proj"):
    t = sd[L + "self_attn." + k + ".weight"]
    w["model.mtp_block.0.self_attn." + k + ".weight"] = t.view(-1, D, H)[:, perm].reshape(-1, H).contiguous()
for k in ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
          "input_layernorm", "post_attention_layernorm"):
    w["model.mtp_block.0." + k + ".weight"] = sd[L + k + ".weight"].clone()
cm = dict(base, architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", num_hidden_layers=1,
          num_key_value_heads=KVH, use_bias=False, moe_num_experts=0, use_moe=False, moe_layer_start_index=1,
          moe_layer_end_index=0, num_nextn_predict_layers=1, rope_theta=10000.0, torch_dtype="bfloat16")
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(cm, f, indent=1)
save_file(w, os.path.join(d, "model.safetensors"))
print("ok")
"""


def make_spec_models(root: str | Path, seed: int = 0, python: str = sys.executable, timeout: float = 300) -> dict:
    """Write the targets and their drafts under ``root`` (once); returns {"target", "eagle", "target3",
    "eagle3", "draft", "mtp": directory}."""
    root = Path(root)
    dirs = {k: str(root / k) for k in ("target", "eagle", "target3", "eagle3", "draft", "mtp")}
    if not all((Path(d) / "config.json").exists() for d in dirs.values()):
        root.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([python, "-c", _SCRIPT, str(root), str(seed)], capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"cannot write the speculative-decoding test models (rc {r.returncode}):\n"
                               f"{r.stderr[-4000:]}")
    return dirs
