"""Fixtures for the server tests: the real `kestrel serve` binary on a free port.

The binary is $KESTREL_BINARY (CTest sets it), else build/kestrel. Models: stories260K from the
shared data ($KESTREL_DATA_DIR, else ../shared/data) for most tests (tiny and fast); the default
SmolLM2 model ($KESTREL_MODEL_DIR, else models/) for the chat tests, skipped when it is absent.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]


def kestrel_binary():
    return Path(os.environ.get("KESTREL_BINARY", REPO / "build" / "kestrel"))


def sanitized():
    """True when the binary is a sanitizer build: clang links the ASan runtime in (its name is in
    the binary), gcc links libasan.so (the binary imports __asan_init)."""
    image = kestrel_binary().read_bytes()
    return b"AddressSanitizer" in image or b"__asan_init" in image


def time_limit(seconds):
    """A wall-clock bound for a test, scaled by 4 for a sanitizer build (ASan and UBSan make CPU
    work 2-3x slower and check for leaks at exit). The bounds catch regressions of 10x or more
    (a request queued behind others for a minute); the Release run keeps them strict."""
    return seconds * 4 if sanitized() else seconds


def stories_model():
    return Path(os.environ.get("KESTREL_DATA_DIR", REPO.parent / "shared" / "data")) / "stories260K" / "stories260K.gguf"


def smollm2_model():
    return Path(os.environ.get("KESTREL_MODEL_DIR", REPO / "models")) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def require(path):
    if not path.exists():
        if os.environ.get("KESTREL_REQUIRE_REFERENCE"):
            pytest.fail(f"missing {path}")
        pytest.skip(f"missing {path}")


class Server:
    """One running `kestrel serve` process."""

    def __init__(self, model, *args, name=None):
        self.model = Path(model)
        self.log = tempfile.NamedTemporaryFile(prefix="kestrel-serve-", suffix=".log", delete=False)
        cmd = [str(kestrel_binary()), "serve", "-m", str(model), "--port", "0", *args]
        self.name = name or Path(model).name
        if name:
            cmd += ["--served-model-name", name]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = self._wait_for_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _wait_for_port(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = Path(self.log.name).read_text(errors="replace")
            m = re.search(r"on http://[^:]+:(\d+)", text)
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"kestrel serve exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise RuntimeError("kestrel serve did not start:\n" + Path(self.log.name).read_text(errors="replace"))

    def output(self):
        return Path(self.log.name).read_text(errors="replace")

    def post(self, path, body=None, *, data=None, headers=None, **kw):
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        return requests.post(self.url + path, json=body if data is None else None, data=data, headers=h,
                             timeout=kw.pop("timeout", 120), **kw)

    def metrics(self):
        """The /metrics samples as {name{labels}: value}."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def openai(self, api_key="unused"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        """Stops the server; returns its exit status and its output (the log file is removed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        out = self.output()
        self.log.close()
        os.unlink(self.log.name)
        return self.proc.returncode, out


# stories260K: 512-token vocabulary, context 2048, about 1,500 tokens/s on one stream here.
STORIES_CTX = 2048


@pytest.fixture(scope="session")
def server():
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--max-model-len", str(STORIES_CTX), name="stories")
    yield s
    rc, out = s.stop()
    assert rc == 0, out


@pytest.fixture(scope="session")
def chat_server():
    require(kestrel_binary())
    model = smollm2_model()
    if not model.exists():
        pytest.skip(f"missing {model} (scripts/fetch_model.sh)")
    s = Server(model, "--max-model-len", "2048")
    yield s
    rc, out = s.stop()
    assert rc == 0, out


# A chat template that refuses system messages, for the template-error test. It writes the BOS text
# itself (the server must not add a second BOS).
REFUSING_TEMPLATE = """{%- for m in messages -%}
{%- if m['role'] == 'system' -%}{{ raise_exception('This model does not take a system message') }}{%- endif -%}
{{ bos_token if loop.first else '' }}{{ m['role'] }}: {{ m['content'] }}
{% endfor -%}
{%- if add_generation_prompt %}assistant:{% endif -%}"""


def stories_hf_server(tmp_path_factory, template, name):
    """stories260K as a Hugging Face folder (tests/reference/gguf_to_hf.py) with `template` as its
    chat_template.jinja, served as `name`. A generator: a fixture yields from it, and the server
    stops (exit status 0) when the fixture ends."""
    require(kestrel_binary())
    require(stories_model())
    for module in ("numpy", "gguf", "safetensors"):
        try:
            __import__(module)
        except ImportError:
            if os.environ.get("KESTREL_REQUIRE_REFERENCE"):
                pytest.fail(f"missing the Python package {module}")
            pytest.skip(f"missing the Python package {module}")
    folder = tmp_path_factory.mktemp(name)
    subprocess.run([sys.executable, str(REPO / "tests" / "reference" / "gguf_to_hf.py"), "--gguf", str(stories_model()),
                    "--out", str(folder), "--tie"], check=True, capture_output=True)
    (folder / "chat_template.jinja").write_text(template)
    s = Server(folder, "--max-model-len", "256", name=name)
    yield s
    rc, out = s.stop()
    assert rc == 0, out


@pytest.fixture(scope="module")
def templated_server(tmp_path_factory):
    """stories260K as a Hugging Face folder with REFUSING_TEMPLATE."""
    yield from stories_hf_server(tmp_path_factory, REFUSING_TEMPLATE, "stories-hf")
