#!/usr/bin/env python3
"""Which side is off: a float64 numpy Llama (textbook HF semantics: rotate-half RoPE, GQA, causal
softmax) on a checkpoint saved by transformers, against transformers' own float64 forward and
kestrel's CPU backend. Usage: hf_semantics.py --kestrel BIN --tokenizer-model PATH."""
import argparse, json, os, shutil, subprocess, tempfile
import numpy as np, torch
from safetensors.torch import load_file as _load_torch


def load_file(path):  # bf16 tensors through torch (numpy has no bfloat16)
    return {k: v.double().numpy() for k, v in _load_torch(path).items()}
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser(); ap.add_argument("--kestrel"); ap.add_argument("--tokenizer-model"); a = ap.parse_args()
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
m = LlamaForCausalLM(cfg)
with torch.no_grad():
    for p in m.parameters():
        if p.dim() == 2: p.normal_(0, 0.05)
m = m.to(torch.bfloat16).eval()
d = tempfile.mkdtemp(); m.save_pretrained(d, safe_serialization=True)
shutil.copy(a.tokenizer_model, d + "/tokenizer.model")
json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, open(d + "/tokenizer_config.json", "w"))
print("attn implementation:", m.config._attn_implementation, "| files:", os.listdir(d))
prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories. " * 6
out = subprocess.run([a.kestrel, "generate", "-m", d, "-p", prompt, "-n", "1", "--temperature", "0", "--json", "--dump-logits",
                      d + "/k.npy", "--kv-dtype", "f32", "--device", "cpu"], capture_output=True, text=True, check=True)
ids = json.loads(out.stdout)["prompt_ids"]; n = len(ids)
with torch.no_grad():
    hf = m.double()(torch.tensor([ids])).logits[0].numpy()
    hf_eager = None
    try:
        m.config._attn_implementation = "eager"
        hf_eager = m(torch.tensor([ids])).logits[0].numpy()
    except Exception as e:
        print("eager failed:", e)
T = {k: v.astype(np.float64) for k, v in load_file(d + "/model.safetensors").items()} if os.path.exists(d + "/model.safetensors") else None
if T is None:
    import glob; T = {}
    for f in glob.glob(d + "/*.safetensors"): T.update({k: v.astype(np.float64) for k, v in load_file(f).items()})
print("tensors:", len(T), sorted(T)[:3], "lm_head" in " ".join(T))
H, L, NH, NKV, HD = 1024, 4, 16, 4, 64
x = T["model.embed_tokens.weight"][ids]; pos = np.arange(n)
inv = 1.0 / (10000.0 ** (np.arange(0, HD, 2) / HD)); ang = pos[:, None] * inv[None, :]
cos = np.cos(np.concatenate([ang, ang], 1)); sin = np.sin(np.concatenate([ang, ang], 1))
rms = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
def rope(q): return q * cos[:, None] + np.concatenate([-q[..., HD//2:], q[..., :HD//2]], -1) * sin[:, None]
for l in range(L):
    p = f"model.layers.{l}."; h = rms(x, T[p+"input_layernorm.weight"])
    q = rope((h @ T[p+"self_attn.q_proj.weight"].T).reshape(n, NH, HD)); k = rope((h @ T[p+"self_attn.k_proj.weight"].T).reshape(n, NKV, HD))
    v = (h @ T[p+"self_attn.v_proj.weight"].T).reshape(n, NKV, HD); o = np.zeros((n, NH, HD))
    for hh in range(NH):
        kv = hh // (NH // NKV); s = q[:, hh] @ k[:, kv].T / 8.0; s[np.triu_indices(n, 1)] = -np.inf
        s = np.exp(s - s.max(1, keepdims=True)); s /= s.sum(1, keepdims=True); o[:, hh] = s @ v[:, kv]
    x = x + o.reshape(n, -1) @ T[p+"self_attn.o_proj.weight"].T; h = rms(x, T[p+"post_attention_layernorm.weight"])
    g = h @ T[p+"mlp.gate_proj.weight"].T; x = x + (g / (1 + np.exp(-g)) * (h @ T[p+"mlp.up_proj.weight"].T)) @ T[p+"mlp.down_proj.weight"].T
head = T.get("lm_head.weight", T["model.embed_tokens.weight"])
ref = rms(x, T["model.norm.weight"]) @ head.T
ours = np.load(d + "/k.npy").astype(np.float64)
e = lambda a, b: " ".join(f"{v:.1e}" for v in (np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1))[::24])
print("numpy ref vs transformers f64 (sdpa):", e(ref, hf))
if hf_eager is not None: print("numpy ref vs transformers f64 (eager):", e(ref, hf_eager))
print("kestrel cpu vs numpy ref:           ", e(ours, ref))
print("kestrel cpu vs transformers f64:    ", e(ours, hf))
# Does the checkpoint on disk hold the in-memory weights? (transformers 5 converts some weights on save/load.)
sd = _load_torch(d + "/model.safetensors")
for name, prm in m.named_parameters():
    disk = sd.get(name)
    if disk is None:
        print("not on disk:", name)
    elif not torch.equal(disk.double(), prm.detach().double().cpu()):
        print("differs on disk:", name, float((disk.double() - prm.detach().double().cpu()).abs().max()))
m2 = LlamaForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
with torch.no_grad():
    hf2 = m2(torch.tensor([ids])).logits[0].numpy()
print("transformers reloaded vs in-memory:  ", e(hf2, hf))
print("numpy ref vs transformers reloaded:  ", e(ref, hf2))
ks = [k for k in m.state_dict().keys() if "rotary" in k]
print("rotary buffers:", ks, [m.state_dict()[k][:4].tolist() for k in ks])
