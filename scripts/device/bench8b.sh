#!/usr/bin/env bash
# Llama-3.1-8B-shaped random bf16 model (saved with transformers), then kestrel --device cuda:
# load time, batch-1 decode, batched decode. Run on the GPU machine after issue4_run.sh's setup
# (devbin/ carried: kestrel, tokenizer.model).
set -uo pipefail
OUT="${OUT:-/tmp/kestrel_out}"
mkdir -p "$OUT"
cublas_dir=$(python3 -c 'import nvidia.cublas as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
export LD_LIBRARY_PATH="$PWD/devbin:/usr/local/cuda/lib64:${cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
chmod +x devbin/kestrel
dir=/tmp/llama8b
if [ ! -f "$dir/config.json" ]; then
  PYTHONUNBUFFERED=1 python3 - "$dir" <<'PY'
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
shutil.copy("devbin/tokenizer.model", os.path.join(d, "tokenizer.model"))
json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, open(os.path.join(d, "tokenizer_config.json"), "w"))
print(f"saved {sum(p.numel() for p in m.parameters())/1e9:.2f}B params in {time.time()-t:.1f} s")
PY
fi
du -sh "$dir"
echo "== load: kestrel generate --device cuda -n 1 (weights upload time on the 'ready in' line)"
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
timeout 120 devbin/kestrel generate -m "$dir" --device cuda -p "Hello" -n 1 2>&1 >/dev/null | grep -E "ready in|loaded"
timeout 120 devbin/kestrel generate -m "$dir" --device cuda -p "Hello" -n 1 2>&1 >/dev/null | grep -E "ready in"
echo "== batch-1: kestrel bench --device cuda -p 128 -n 256"
timeout 240 devbin/kestrel bench -m "$dir" --device cuda -p 128 -n 256 -r 3 2>&1 | tail -4
echo "== batched: --parallel 1,16,64 -p 512 -n 128"
timeout 240 devbin/kestrel bench -m "$dir" --device cuda --parallel 1,16,64 -p 512 -n 128 -r 1 2>&1 | tail -6
