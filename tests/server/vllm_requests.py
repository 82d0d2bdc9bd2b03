"""Helpers of the vLLM request-field tests (test_vllm_fields.py, test_vllm_output_fields.py): the
endpoints, the stories260K prompt, a greedy completion and its reference ids from `kestrel generate`."""

import json
import subprocess

from conftest import kestrel_binary, stories_model

C = "/v1/completions"
CH = "/v1/chat/completions"
PROMPT = "Once upon a time"


def complete(server, **body):
    """A completion of PROMPT (unless body gives one), greedy unless body says otherwise; must be a 200."""
    body.setdefault("prompt", PROMPT)
    body.setdefault("temperature", 0)
    r = server.post(C, body)
    assert r.status_code == 200, r.text
    return r.json()


def choice(r):
    return r["choices"][0]


def greedy_ids(n, prompt=PROMPT):
    """The prompt's ids and its greedy continuation's, from `kestrel generate` (the same engine)."""
    out = subprocess.run([str(kestrel_binary()), "generate", "-m", str(stories_model()), "-p", prompt, "-n", str(n),
                          "--temperature", "0", "--json"], capture_output=True, text=True, check=True).stdout
    j = json.loads(out)
    return j["prompt_ids"], j["output_ids"]
