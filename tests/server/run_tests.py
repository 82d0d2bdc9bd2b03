"""CTest entry point for the server tests: pytest on this folder, or exit 77 (skipped) when pytest,
openai or requests is missing, unless KESTREL_REQUIRE_REFERENCE is set (scripts/test.sh installs them
into .venv and sets it)."""

import importlib.util
import os
import sys
from pathlib import Path

missing = [m for m in ("pytest", "openai", "requests") if importlib.util.find_spec(m) is None]
if missing:
    print(f"server tests need the Python packages {', '.join(missing)} (scripts/test.sh installs them into .venv)")
    sys.exit(1 if os.environ.get("KESTREL_REQUIRE_REFERENCE") else 77)

import pytest  # noqa: E402

sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", str(Path(__file__).parent), *sys.argv[1:]]))
