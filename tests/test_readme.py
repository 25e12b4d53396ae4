"""The README's shell and Python examples, run as written, in order, in one fresh folder.

Every ```bash and ```python block of README.md runs (bash with -euo pipefail, Python with this
interpreter), with the farm's command line on PATH and no FARM_DB, so `farm` commands and
`Client()` use the embedded default database of that folder, as a new user's would. A block
preceded by a line `<!-- not run ...: why -->` is skipped (the set-up commands, which CI runs
itself; deployment commands that need GPU hosts).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```(?P<lang>[a-z]*)\n(?P<code>.*?)\n```", re.DOTALL)


def blocks() -> list[tuple[str, str, bool]]:
    """(language, code, run) of every fenced block, in README order."""
    return [(m["lang"], m["code"], not m["before"].startswith("<!-- not run"))
            for m in BLOCK.finditer(README.read_text())]


def test_every_block_has_a_language_and_skipped_ones_say_why() -> None:
    assert blocks(), "no code blocks found in README.md"
    for lang, code, _ in blocks():
        assert lang in ("bash", "python", "text"), f"block without a known language: {code[:80]!r}"


@pytest.mark.slow
def test_readme_examples_run_as_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FARM_DB"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    ran = 0
    for number, (lang, code, run) in enumerate(blocks(), 1):
        if not run or lang == "text":
            continue
        command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README block {number} ({lang}) failed:\n{code}\n{proc.stderr[-3000:]}"
        ran += 1
    assert ran >= 3
    assert (tmp_path / "kernel.so").exists() and (tmp_path / "msdb" / "database_tuning_record.json").exists()
