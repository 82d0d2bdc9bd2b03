#!/usr/bin/env python3
"""Beam search reference: Hugging Face transformers' generate(num_beams=B, do_sample=False) on
stories260K, for the GoogleTest tests/e2e/test_beam_search.cpp.

transformers loads the F32 GGUF itself (gguf_file=); the file's pad token id (2**32 - 1) lies
outside the 512-token vocabulary, so the config's pad_token_id is set to None first. Prompts are
token ids: the texts below tokenized by `kestrel tokenize` (transformers' GGUF tokenizer loader
fails on the same pad id), with BOS.

Stop ids: stories260K practically never ends a story within 24 tokens (llama2.c's models end one
with BOS, rarely this soon), so the 50 engine cases stop at "." (426) and the newline (13), which
the model emits every sentence: hypotheses then end by a stop id as well as by the length limit,
which is what length_penalty and early_stopping act on, and two stop ids make transformers keep 3B
candidates per step. The server cases (the server stops at the model's EOS, 2) use that alone.
Each case records the B returned sequences (generated ids,
EOS included), their sequences_scores (sum of log-probabilities / generated length **
length_penalty) and the sum of their tokens' log-probabilities recomputed from output_scores
(transformers' compute_transition_scores).

    python3 tests/reference/beam_reference.py --kestrel build/kestrel \
        --data ../shared/data/stories260K --out tests/data/beam_stories260k.json

Needs torch, transformers, gguf (pip install torch transformers gguf).
"""
import argparse
import json
import subprocess

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPTS = [
    "Once upon a time",
    "Lily wanted to play",
    "The little dog ran",
    "One day, Tom saw a big",
    "The sun was shining and",
    "Sam and his mom went to the",
    "There was a small bird who",
    "Mia had a red ball.",
    "The cat was sad because",
    "Ben found a box",
]
# (num_beams, length_penalty, early_stopping)
SETTINGS = [
    (2, 1.0, False),
    (4, 1.0, False),
    (2, 0.5, True),
    (4, 2.0, "never"),
    (4, -1.0, True),
]
MAX_NEW_TOKENS = 24
BOS = 1
STOP_IDS = [426, 13]  # "." and "\n"
SERVER_STOP_IDS = [2]  # the model's EOS
SERVER_CASES = [(0, (2, 1.0, False)), (3, (4, 1.0, "never")), (6, (4, 2.0, True))]  # (prompt, setting)


def tokenize(kestrel, model, text):
    """BOS (1) and the text's ids, as kestrel's completions and batch tokenize a text prompt."""
    out = subprocess.run([kestrel, "tokenize", "-m", model, text], check=True, capture_output=True, text=True).stdout
    return [BOS] + [int(t) for t in out.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    gguf = "stories260K.gguf"
    config = transformers.AutoConfig.from_pretrained(a.data, gguf_file=gguf)
    config.pad_token_id = None
    model = AutoModelForCausalLM.from_pretrained(a.data, gguf_file=gguf, config=config, torch_dtype=torch.float32)
    model.eval()
    model.generation_config.pad_token_id = None
    ids_of = {text: tokenize(a.kestrel, f"{a.data}/{gguf}", text) for text in PROMPTS}

    def case(text, setting, stop_ids):
        beams, lp, es = setting
        ids = ids_of[text]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), num_beams=beams, do_sample=False, length_penalty=lp,
                early_stopping=es, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=beams,
                output_scores=True, return_dict_in_generate=True, eos_token_id=stop_ids,
                pad_token_id=stop_ids[0], top_k=None, top_p=None, temperature=None)
            trans = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices,
                                                    normalize_logits=False)
        hyps = []
        for i in range(beams):
            n = int((out.beam_indices[i] >= 0).sum())  # generated length (the rest is padding)
            hyps.append({
                "tokens": out.sequences[i, len(ids):len(ids) + n].tolist(),
                "score": float(out.sequences_scores[i]),
                "sum_logprobs": float(trans[i, :n].double().sum()),
            })
        return {"prompt": text, "prompt_ids": ids, "stop_ids": stop_ids, "num_beams": beams, "length_penalty": lp,
                "early_stopping": es, "max_new_tokens": MAX_NEW_TOKENS, "beams": hyps}

    cases = [case(text, setting, STOP_IDS) for text in PROMPTS for setting in SETTINGS]
    server_cases = [case(PROMPTS[p], setting, SERVER_STOP_IDS) for p, setting in SERVER_CASES]
    doc = {
        "source": "transformers %s, torch %s: generate(num_beams, do_sample=False, length_penalty, early_stopping, "
                  "max_new_tokens, num_return_sequences=num_beams, eos_token_id=stop_ids) on stories260K.gguf (F32)" %
                  (transformers.__version__, torch.__version__),
        "cases": cases,
        "server_cases": server_cases,
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
