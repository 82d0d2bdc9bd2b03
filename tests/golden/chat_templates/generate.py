#!/usr/bin/env python3
"""Writes expected.json: the chat templates below rendered by Python jinja2 the way Hugging Face
transformers renders chat templates, for kestrel's C++ Jinja engine to match byte for byte
(tests/golden/test_chat_templates.cpp).

The environment mirrors transformers' apply_chat_template: an ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loopcontrols extension and a {% generation %} block that just
renders its body; a tojson filter that is json.dumps(ensure_ascii=False) keeping key order; the
globals raise_exception(message) and strftime_now(format). Variables: messages, tools (None
unless the case has tools), documents (None), add_generation_prompt, bos_token, eos_token.
kestrel reads an attribute or item of an undefined value as undefined (jinja2's
ChainableUndefined) where jinja2's default Undefined fails: when a case fails with an
UndefinedError, it is rendered again with ChainableUndefined and that output is stored too
("lenient_output"), which is what kestrel must give.
strftime_now formats the fixed time NOW in UTC (noon, so the date is the same in every time zone
from UTC-11 to UTC+11, which is what the C++ test can rely on).

Usage (from the repository root; needs jinja2 and the gguf package):
    python3 -m pip install --user jinja2==3.1.6 gguf
    python3 tests/golden/chat_templates/generate.py [--data ../shared/data] [--models models]
"""
import argparse
import json
import os
import time
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = 1699963200  # 2023-11-14 12:00:00 UTC
BOS = "<s>"
EOS = "</s>"
HERE = Path(__file__).resolve().parent


class GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %}: renders the body (transformers tracks its spans)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def make_env(undefined=jinja2.Undefined):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=undefined,
                                       extensions=[GenerationBlock, loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.fromtimestamp(NOW).strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def gguf_template(path):
    import gguf
    field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--models", default="models")
    args = ap.parse_args()
    os.environ["TZ"] = "UTC"
    time.tzset()
    data, models = Path(args.data), Path(args.models)

    # name -> (where the C++ test finds it, template text)
    templates = {
        "qwen2": ("data:qwen2-bpe-vocab/tokenizer_config.json",
                  json.loads((data / "qwen2-bpe-vocab/tokenizer_config.json").read_text())["chat_template"]),
        "phi3": ("data:tokenizer-vectors/ggml-vocab-phi-3.gguf",
                 gguf_template(data / "tokenizer-vectors/ggml-vocab-phi-3.gguf")),
        "smollm2": ("models:SmolLM2-135M-Instruct.Q4_1.gguf",
                    gguf_template(models / "SmolLM2-135M-Instruct.Q4_1.gguf")),
    }
    for f in sorted(HERE.glob("*.jinja")):
        templates[f.stem] = ("golden:" + f.name, f.read_text())

    conversations = json.loads((HERE / "conversations.json").read_text())
    tools = json.loads((HERE / "tools.json").read_text())
    env = make_env()
    lenient_env = make_env(jinja2.ChainableUndefined)
    cases = []
    for name, (_, text) in templates.items():
        tmpl = env.from_string(text)
        lenient = lenient_env.from_string(text)
        for conv_name, messages in conversations.items():
            for with_tools in ([False, True] if conv_name in ("tool_calls", "system_user_assistant") else [False]):
                for agp in (False, True):
                    case = {"template": name, "conversation": conv_name, "tools": with_tools,
                            "add_generation_prompt": agp}
                    variables = dict(messages=messages, tools=tools if with_tools else None, documents=None,
                                     add_generation_prompt=agp, bos_token=BOS, eos_token=EOS)
                    try:
                        case["output"] = tmpl.render(**variables)
                    except Exception as e:  # the C++ engine must fail too (TemplateError)
                        case["error"] = "%s: %s" % (type(e).__name__, e)
                        if isinstance(e, jinja2.exceptions.UndefinedError):
                            try:
                                case["lenient_output"] = lenient.render(**variables)
                            except Exception:
                                pass
                    cases.append(case)
    out = {
        "generator": "tests/golden/chat_templates/generate.py",
        "jinja2_version": jinja2.__version__,
        "now": NOW,
        "bos_token": BOS,
        "eos_token": EOS,
        "templates": {name: where for name, (where, _) in templates.items()},
        "cases": cases,
    }
    (HERE / "expected.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print("wrote %d cases (%d errors) for %d templates" % (len(cases), sum("error" in c for c in cases), len(templates)))


if __name__ == "__main__":
    main()
