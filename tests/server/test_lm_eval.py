"""EleutherAI's lm-evaluation-harness (PyPI `lm_eval`, model `local-completions`, unchanged) against
the real server on the default model, and every loglikelihood it logged against an independent
float64 scoring of the same token ids (tests/reference/llama_ref.py).

lm_eval scores a multiple-choice answer with one `echo` + `logprobs` + `max_tokens: 1` completion
on the token ids of context + answer and sums `token_logprobs[ctxlen:-1]`: it relies on the one
generated token being the last entry of the arrays, also when that token is the end of the turn.
The task (lm_eval_task/) has chat-format questions whose answers end the assistant's turn, so the
greedy token after several answers is <|im_end|>; the test checks that this happened.
Requests go as batches of four token-id prompts (--batch_size 4) and the tokenizer is the
server's (/tokenizer_info, /tokenize, /detokenize).
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from conftest import REPO, Server, kestrel_binary, require, smollm2_model

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "kestrel_stories_mc"
N_DOCS, N_CHOICES = 20, 4
STOP_TOKENS = {"<|im_end|>", "<|endoftext|>"}  # SmolLM2's end-of-turn and end-of-text tokens

# |lm_eval's loglikelihood - float64 reference| for one answer (a sum over its 1-4 tokens), in nats.
# The server runs its default f16 KV cache on the Q4_1 weights that the reference dequantizes
# exactly; measured 2026-12-01 over the 80 answers (AVX2): max 0.0037, median 0.0012 nats. A
# dropped or shifted token costs its own log-probability: 5-12 nats for most answers here.
TOLERANCE = 0.02


def _need(module):
    try:
        __import__(module)
    except ImportError:
        if os.environ.get("KESTREL_REQUIRE_REFERENCE"):
            pytest.fail(f"missing the Python package {module}")
        pytest.skip(f"missing the Python package {module}")


@pytest.fixture(scope="module")
def smollm2_server():
    require(kestrel_binary())
    require(smollm2_model())
    s = Server(smollm2_model(), "--max-model-len", "2048", name="smollm2")
    yield s
    rc, out = s.stop()
    assert rc == 0, out


def tokenize(server, text):
    r = requests.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def encode_pair(server, context, continuation):
    """lm_eval's TemplateLM._encode_pair for a causal model: trailing spaces of the context move to
    the continuation; the continuation's ids are those of context + continuation after the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenize(server, context + continuation)
    ctx = tokenize(server, context)
    return ctx, whole[len(ctx):]


def reference_scores(model_path, pairs):
    """[(sum of log-softmax over the continuation, the last continuation token's log-softmax, the
    argmax token after it)] for [(context ids, continuation ids)], from the float64 forward pass in
    a child process (one BLAS thread: OpenBLAS's spinning threads make it 20x slower on a busy
    machine) that computes each context's KV once for its answers."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _REFERENCE_CHILD, str(model_path), str(REPO / "tests" / "reference")],
                          input=json.dumps(pairs), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [tuple(x) for x in json.loads(proc.stdout)]


# The child process of reference_scores: argv = [model path, tests/reference], stdin = JSON [[context ids,
# continuation ids], ...], stdout = JSON [[sum, last token's log-softmax, argmax piece], ...].
_REFERENCE_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from llama_ref import LlamaRef

pairs = [(tuple(c), tuple(t)) for c, t in json.load(sys.stdin)]
ref = LlamaRef(sys.argv[1])
scores = {}
for ctx in dict.fromkeys(c for c, _ in pairs):
    ref.reset()
    last_ctx = ref.forward(list(ctx))[-1]
    k_saved, v_saved = list(ref.k_cache), list(ref.v_cache)
    for cont in dict.fromkeys(t for c, t in pairs if c == ctx):
        ref.k_cache, ref.v_cache = list(k_saved), list(v_saved)
        logits = np.vstack([last_ctx[None, :], ref.forward(list(cont))])  # row i predicts cont[i]
        top = logits.max(axis=1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        per_token = [float(logp[i, t]) for i, t in enumerate(cont)]
        scores[(ctx, cont)] = (sum(per_token), per_token[-1], ref.piece(int(np.argmax(logits[-1]))))
json.dump([scores[p] for p in pairs], sys.stdout)
"""


def run_lm_eval(server, out_dir):
    model_args = ",".join([
        f"base_url={server.url}/v1/completions", f"model={server.name}", "tokenizer_backend=remote",
        "num_concurrent=1", "max_retries=1", "tokenized_requests=True"])
    env = dict(os.environ, HF_HOME=str(out_dir / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    # Run in the task folder: the task's data_files path is relative to the working directory.
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", "4", "--log_samples",
         "--output_path", str(out_dir / "out")],
        cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    samples = glob.glob(str(out_dir / "out" / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    results = glob.glob(str(out_dir / "out" / "**" / "results_*.json"), recursive=True)
    assert len(samples) == 1 and len(results) == 1, (samples, results, proc.stderr[-4000:])
    docs = [json.loads(line) for line in Path(samples[0]).read_text().splitlines() if line.strip()]
    return docs, json.loads(Path(results[0]).read_text())


def test_lm_eval_loglikelihoods_match_reference(smollm2_server, tmp_path):
    _need("lm_eval")
    _need("numpy")
    _need("gguf")
    docs, results = run_lm_eval(smollm2_server, tmp_path)
    assert len(docs) == N_DOCS
    acc = results["results"][TASK]["acc,none"]

    # lm_eval's scores and the token ids it scored (the server's tokenizer, lm_eval's split).
    scored = []
    for d in docs:
        args = [d["arguments"][f"gen_args_{i}"] for i in range(N_CHOICES)]
        assert len(d["resps"]) == N_CHOICES
        for a, resp in zip(args, d["resps"]):
            ll = float(resp[0][0])
            ctx, cont = encode_pair(smollm2_server, a["arg_0"], a["arg_1"])
            assert cont, a
            scored.append((d["doc_id"], a["arg_1"], tuple(ctx), tuple(cont), ll))
    ref = dict(zip([(c, t) for _, _, c, t, _ in scored],
                   reference_scores(smollm2_server.model, [(c, t) for _, _, c, t, _ in scored])))

    diffs = []
    for doc_id, answer, ctx, cont, ll in scored:
        ref_ll = ref[(ctx, cont)][0]
        diffs.append((abs(ll - ref_ll), doc_id, answer, ll, ref_ll, len(cont)))
    diffs.sort(reverse=True)
    print(f"accuracy {acc:.2f}; |lm_eval - reference| over {len(diffs)} answers: max {diffs[0][0]:.4f} nats, "
          f"median {diffs[len(diffs) // 2][0]:.4f}")
    for d in diffs[:5]:
        print(f"  doc {d[1]} {d[2]!r}: lm_eval {d[3]:.4f}, reference {d[4]:.4f} ({d[5]} tokens)")
    bad = [d for d in diffs if d[0] > TOLERANCE]
    assert not bad, f"{len(bad)} answers off by more than {TOLERANCE} nats: {bad[:5]}"

    # The answers really differ in score (a constant would also match a constant reference).
    assert len({round(ll, 3) for *_, ll in scored}) > len(scored) // 2

    # The end-of-turn case: after some answers the greedy next token (the one token lm_eval has the
    # server generate) is a stop token, by the server's word (finish_reason "stop" at max_tokens 1)
    # and by the reference's argmax. Were that token left out of the logprobs arrays, lm_eval would
    # drop the answer's last token instead, off by that token's log-probability: at least one such
    # answer has a last token below -1 nat, far outside the tolerance.
    stops = []
    for doc_id, answer, ctx, cont, _ in scored:
        r = smollm2_server.post("/v1/completions", {"model": smollm2_server.name, "prompt": list(ctx + cont),
                                                    "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["finish_reason"] == "stop":
            _, last_logp, argmax = ref[(ctx, cont)]
            stops.append((doc_id, answer, round(last_logp, 2)))
            assert argmax in STOP_TOKENS, (doc_id, answer, argmax)
    print(f"{len(stops)} answers end with a stop token as the greedy next token "
          f"(doc, answer, last token's log-probability): {stops}")
    assert len(stops) >= 3, stops
    assert min(logp for *_, logp in stops) < -1.0, stops
