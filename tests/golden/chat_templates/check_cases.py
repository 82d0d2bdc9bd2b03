#!/usr/bin/env python3
"""Checks the expected strings of tests/unit/test_jinja.cpp against Python's jinja2.

    KESTREL_JINJA_DUMP_CASES=/tmp/cases.jsonl build/tests/kestrel_tests --gtest_filter='Jinja.*'
    python3 tests/golden/chat_templates/check_cases.py /tmp/cases.jsonl

Each line of the dump is {"template", "context", "expected"}; the template is rendered with the
environment generate.py uses (transformers' settings), with ChainableUndefined as kestrel reads
attributes of undefined values. Exits 1 when an expectation differs.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate  # noqa: E402  (the environment and the fixed clock)
import jinja2  # noqa: E402


def main():
    import os
    import time
    os.environ["TZ"] = "UTC"
    time.tzset()
    env = generate.make_env(jinja2.ChainableUndefined)
    bad = total = 0
    for line in Path(sys.argv[1]).read_text().split("\n"):
        if not line:
            continue
        case = json.loads(line)
        total += 1
        try:
            got = env.from_string(case["template"]).render(**case["context"])
        except Exception as e:  # noqa: BLE001
            got = "<%s: %s>" % (type(e).__name__, e)
        if got != case["expected"]:
            bad += 1
            print("MISMATCH %r\n  jinja2:   %r\n  expected: %r" % (case["template"], got, case["expected"]))
    print("%d cases, %d mismatches" % (total, bad))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
