"""Saves a Llama-3.1-8B-shaped model with random bf16 weights (transformers' own init, seed 0) to
the folder given, with the Llama 2 tokenizer.model carried in devbin/ (ids past its 32k vocabulary
decode to no text). Usage: make_llama8b.py DIR  (runs on the device: needs torch, transformers, a GPU)."""
import json, os, shutil, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
d = sys.argv[1]
cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
t = time.time()
torch.manual_seed(0)
with torch.device("cuda"):
    m = LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
m.save_pretrained(d, safe_serialization=True, max_shard_size="5GB")
shutil.copy("/tmp/kestrel/devbin/tokenizer.model", os.path.join(d, "tokenizer.model"))
json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, open(os.path.join(d, "tokenizer_config.json"), "w"))
print(f"saved {sum(p.numel() for p in m.parameters())/1e9:.2f}B params in {time.time()-t:.1f} s")
