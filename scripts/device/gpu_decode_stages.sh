#!/usr/bin/env bash
# batch-1, batch-64 and offline decode of the 8B-shaped model and the
# decode-attention op benchmark under environment configurations, in one call. Stages (STAGES, default
# "tests b1 attn b64"): the GPU op tests and stories260K CPU vs GPU ("stories": the latter alone); batch-1 decode of the
# 8B-shaped model under each of B1_CONFIGS; the decode-attention op benchmark under ATTN_CONFIGS;
# batch-64 decode under B64_CONFIGS; "profile1": an op profile of batch-1 decode (eager, CUDA
# events); "decodecheck": greedy decode through the streaming GEMV against the CPU backend
# (e2e_check.py on a random n_embd-2048 Llama, under DECODE_CONFIGS); "load": the 8B's start-up time from a cold page cache under LOAD_CONFIGS and warm, and
# the disk's read rate; "logits": the
# 8B-shaped model's logits against transformers (logits_check.py); "nsys1": Nsight Systems over
# batch-1 decode, kernel time per step and launch gaps (kernel_trace.py; needs nsys, which the
# device machine lacked); "skinny": the projection benchmark (cuBLASLt against skinny_gemm);
# "offline": the 1,000 x (1,000 + 1,000) batch run under OFFLINE_CONFIGS; "sass": where the
# one-token stream_gemv's loads sit against griddepcontrol.wait in carried cubins; "pdlaudit": the
# loads before the wait in every kernel of the kestrel binary, listed (pdl_audit.py; the "tests"
# stage runs its pass/fail check too); "mutant": the PDL input test on a test binary built with the
# old one-token stream_gemv (devbin/kestrel_tests_mutant), which must fail.
# A configuration is environment settings joined by commas ("KESTREL_DEFAULTS=1" sets nothing).
# Carry: devbin (kestrel, kestrel_tests, kestrel_cuda_bench, the .so files kestrel needs,
# stories260K.gguf, tokenizer.model).
set -uo pipefail
source scripts/device/device_env.sh
STAGES="${STAGES:-tests b1 attn b64}"
begin_run
[[ $STAGES == *tests* ]] && op_tests
[[ $STAGES == *stories* && $STAGES != *tests* ]] && stories_check
if [[ $STAGES == *b1* || $STAGES == *b64* || $STAGES == *profile1* || $STAGES == *offline* || $STAGES == *logits* || $STAGES == *load* || $STAGES == *nsys1* ]]; then
  [ -f "$M8/config.json" ] || python3 scripts/device/make_llama8b.py "$M8"
fi
if [[ $STAGES == *b1* ]]; then
  # This machine's copy rate (H200s differ by a few percent): the roofline for the figures below.
  note "copy rate: $(timeout 60 $BIN/kestrel_cuda_bench copy 2>&1 | grep '^copy' | tr -s ' ')"
  for cfg in ${B1_CONFIGS:-defaults --cuda-fused-norm=off}; do
    echo "== batch-1 decode: $cfg"
    timeout 200 "$K" bench -m "$M8" --device cuda -p 128 -n 256 -r 3 $(cfg_flags "$cfg") 2>&1 | tail -1 | tee /tmp/kestrel/b1.txt
    note "batch-1 [$cfg]: $(tail -1 /tmp/kestrel/b1.txt)"
  done
fi
if [[ $STAGES == *attn* ]]; then
  for cfg in ${ATTN_CONFIGS:-defaults --attn-decode-stages=2 --attn-decode-stages=3}; do
    echo "== decode attention: $cfg"
    timeout 120 $BIN/kestrel_cuda_bench $(cfg_flags "$cfg") "attention decode" 2>&1 | grep "^attention" | grep -v SIMT
  done
fi
if [[ $STAGES == *b64* ]]; then
  for cfg in ${B64_CONFIGS:-defaults --cuda-attn-decode-stages=2}; do
    echo "== batch-64 decode at 512: $cfg"
    timeout 200 "$K" bench -m "$M8" --device cuda --parallel 64 -p 512 -n 128 -r 2 \
      --max-num-batched-tokens 8192 $(cfg_flags "$cfg") 2>&1 | tail -1 | tee /tmp/kestrel/b64.txt
    note "batch-64 [$cfg]: $(tail -1 /tmp/kestrel/b64.txt)"
  done
fi
if [[ $STAGES == *profile1* ]]; then
  echo "== op profile (eager, CUDA events): batch-1 decode"
  timeout 200 "$K" bench -m "$M8" --device cuda -p 128 -n 64 -r 1 --cuda-profile-ops 2>&1 | grep -A24 "op profile"
fi
if [[ $STAGES == *load* ]]; then
  # Start-up of the 8B: the `ready in` line of generate with the model's files first evicted from
  # the page cache (fsync, then posix_fadvise DONTNEED on every file: no root needed), under each
  # of LOAD_CONFIGS, then warm; and the disk's own rate: the shards read cold by cat, one after
  # another and all at once.
  evict() {
    python3 - "$M8" <<'PY'
import os, sys
for name in os.listdir(sys.argv[1]):
    fd = os.open(os.path.join(sys.argv[1], name), os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
PY
  }
  for cfg in ${LOAD_CONFIGS:-defaults} warm; do
    flags=$(cfg_flags "${cfg/#warm/defaults}")
    [ "$cfg" = warm ] || evict
    timeout 120 "$K" generate -m "$M8" --device cuda -p "Hello" -n 1 $flags 2>&1 >/dev/null \
      | grep -E "ready in" > /tmp/kestrel/load.txt
    note "load 8B [$cfg]: $(grep -oE 'ready in [0-9.]+ s' /tmp/kestrel/load.txt)"
  done
  evict
  t0=$(date +%s.%N); cat "$M8"/*.safetensors > /dev/null; t1=$(date +%s.%N)
  note "disk: cat of the shards one after another, cold: $(python3 -c "print(round($t1 - $t0, 2))") s"
  evict
  t0=$(date +%s.%N); for f in "$M8"/*.safetensors; do cat "$f" > /dev/null & done; wait; t1=$(date +%s.%N)
  note "disk: the shards read at once, cold: $(python3 -c "print(round($t1 - $t0, 2))") s ($(du -sb "$M8" | cut -f1) bytes)"
fi
if [[ $STAGES == *logits* ]]; then
  # Logits of the 8B-shaped model against transformers (f32 reference, bf16 for scale), 256+ positions.
  echo "== 8B-shaped random model vs transformers"
  # LOGITS_CHUNKS: kestrel's --prefill-chunk values (1: every position through one-token steps).
  for chunk in ${LOGITS_CHUNKS:-256}; do
    timeout 300 python3 scripts/device/logits_check.py --kestrel "$K" -m "$M8" --name llama8b --prefill-chunk $chunk \
      2>&1 | tail -6 | tee /tmp/kestrel/l8.log
    note "logits, prefill chunk $chunk: $(grep -E 'argmax agreement|vs transformers f32|top-2|RESULT' /tmp/kestrel/l8.log | tr '\n' ' ')"
  done
fi
if [[ $STAGES == *decodecheck* ]]; then
  # Decode through the streaming GEMV (and its fused norm) against kestrel's CPU backend and the
  # float64 reference: a random Llama with n_embd 2048 and n_ff 4096 (e2e_check.py), under each of
  # DECODE_CONFIGS; the greedy line says how many of 32 tokens agree.
  # --prefill-chunk=1 makes kestrel cuda's logits of every prompt position come from one-token
  # decode steps (decode graph and attention): a teacher-forced check, free of greedy near-ties;
  # =2 from two-token steps (the two-row GEMVs and fused norm, with prefill attention).
  # --cuda-stream-gemv-min-mb=20 streams (and fuses the norm into) gate/up alone: one residual swap per layer.
  for cfg in ${DECODE_CONFIGS:---prefill-chunk=1,--cuda-stream-gemv=off --prefill-chunk=1,--cuda-stream-gemv-min-mb=0 --prefill-chunk=1,--cuda-stream-gemv-min-mb=0,--cuda-fused-norm=off --prefill-chunk=1,--cuda-stream-gemv-min-mb=20 --prefill-chunk=2,--cuda-stream-gemv-min-mb=0}; do
    echo "== decode check: $cfg"
    timeout 300 python3 scripts/device/e2e_check.py --kestrel "$K" --tokenizer-model $BIN/tokenizer.model \
      --hidden 2048 --intermediate 4096 --layers 4 $(cfg_flags "$cfg") 2>&1 | grep -E "greedy|argmax agreement|rel L2 error|vs kestrel cpu|check:|RESULT|Error|error" | tee /tmp/kestrel/dc.txt
    note "decode check [$cfg]: $(grep -E 'vs kestrel cpu|RESULT' /tmp/kestrel/dc.txt | tr '\n' ' ')"
  done
fi
if [[ $STAGES == *nsys1* ]]; then
  # Nsight Systems over batch-1 decode (graphs traced per node): kernel time per step and gaps.
  echo "== nsys: batch-1 decode"
  NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$NSYS" ]; then
    timeout 300 "$NSYS" profile --cuda-graph-trace=node --trace=cuda -o /tmp/kestrel/b1trace --force-overwrite true \
      "$K" bench -m "$M8" --device cuda -p 128 -n 64 -r 1 > /tmp/kestrel/nsys.log 2>&1 || tail -5 /tmp/kestrel/nsys.log
    "$NSYS" stats --report cuda_gpu_trace --format csv -o /tmp/kestrel/b1trace /tmp/kestrel/b1trace.nsys-rep >/dev/null 2>&1
    python3 scripts/device/kernel_trace.py /tmp/kestrel/b1trace_cuda_gpu_trace.csv --skip 8 2>&1 | tee -a "$SUMMARY"
  else
    echo "nsys not found"
  fi
fi
if [[ $STAGES == *skinny* ]]; then
  echo "== projections: cuBLASLt vs skinny_gemm"
  timeout 300 $BIN/kestrel_cuda_bench skinny 2>&1 | grep -E "^(cublaslt|skinny u0|skinny u4 w8|stream)" \
    | grep -E "M=(1|2|8) "
fi
if [[ $STAGES == *offline* ]]; then
  for cfg in ${OFFLINE_CONFIGS:-defaults}; do
    echo "== offline 1000 x (1000 + 1000): $cfg"
    KESTREL_FLAGS="$(cfg_flags "$cfg")" MAX_SEQS="${MAX_SEQS:-400}" bash scripts/device/gpu_offline_batch.sh 2>&1 | tail -4 | tee /tmp/kestrel/off.txt
    note "offline [$cfg]: $(grep -i "tok/s" /tmp/kestrel/off.txt | tail -1)"
  done
fi
if [[ $STAGES == *sass* ]]; then
  # Where the one-token stream_gemv's loads of x sit against griddepcontrol.wait in the SASS of
  # each carried cubin (devbin/sg_*.cubin: built from stream_gemv.cu before and after a change).
  CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
  for cubin in $BIN/sg_*.cubin; do
    [ -f "$cubin" ] && [ -n "$CUOBJDUMP" ] || { echo "no cubin or no cuobjdump"; break; }
    "$CUOBJDUMP" -sass "$cubin" | awk '/Function : .*stream_gemv_kernelILi1ELi4ELb0ELb0ELb0E/{p=1} p&&/Function : /&&!/ILi1ELi4ELb0ELb0ELb0E/{p=0} p' \
      > /tmp/kestrel/sass.txt
    echo "== $(basename "$cubin"): $(wc -l < /tmp/kestrel/sass.txt) lines; loads and the grid-dependency wait, in order:"
    # The opcodes in order up to the first FFMA (the main loop), repeats collapsed.
    python3 - /tmp/kestrel/sass.txt <<'PY'
import re, sys
ops = []
for line in open(sys.argv[1]):
    m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if not m:
        continue
    op = m.group(2)
    if op.startswith("FFMA"):
        break
    if ops and ops[-1][0] == op:
        ops[-1][1] += 1
    else:
        ops.append([op, 1])
print(" ".join(f"{o}x{n}" if n > 1 else o for o, n in ops))
PY
  done
fi
if [[ $STAGES == *mutant* ]]; then
  # The PDL input test against a kestrel_tests built with the old stream_gemv.cuh (commit 9093bda:
  # x read through the read-only path), carried as devbin/kestrel_tests_mutant: it must fail.
  echo "== PDL input test on the old stream_gemv (must fail)"
  chmod +x $BIN/kestrel_tests_mutant
  timeout 300 $BIN/kestrel_tests_mutant --gtest_filter='CudaPdlInputs.*' 2>&1 | grep -E "Failure|mode|trace:|tokens|FAILED|PASSED" | head -12
  note "mutant (old stream_gemv): $(timeout 300 $BIN/kestrel_tests_mutant --gtest_filter='CudaPdlInputs.*' --gtest_brief=1 2>&1 | grep -E '^\[  (PASSED|FAILED) ' | tr '\n' ' ')"
fi
if [[ $STAGES == *pdlaudit* ]]; then
  echo "== PDL audit: every kernel's global loads before griddepcontrol.wait (list in \$OUT/pdl_audit.txt)"
  python3 scripts/device/pdl_audit.py $BIN/kestrel ${PDL_AUDIT_EXTRA:-} --list > "$OUT/pdl_audit.txt" 2>&1
  note "$(grep -E '^PDL' "$OUT/pdl_audit.txt" | tr '\n' ' ')"
fi
echo "== summary"
cat "$SUMMARY"
