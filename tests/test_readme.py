"""The README's shell and Python examples, and those of the docs pages it sends readers to, run as
written, in order, in one fresh folder.

Every ```bash and ```python block of README.md, then of each page of PAGES in that order, runs (bash
with -euo pipefail, Python with this interpreter), with the farm's command line on PATH and no
FARM_DB, so `farm` commands and `Client()` use the embedded default database of that folder, as a
new user's would. The pages' examples run after the README's and see what they wrote (docs/export.md
reads the first session's `best.json` and `msdb/`). A block preceded by a line `<!-- not run ...: why
-->` is skipped (the set-up commands, which CI runs itself; deployment commands that need GPU hosts).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The pages whose examples moved out of the README, in the order the README had them.
PAGES = [ROOT / "docs" / name
         for name in ("cli.md", "running.md", "deploy.md", "search.md", "export.md", "tir.md", "models.md")]
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```(?P<lang>[a-z]*)\n(?P<code>.*?)\n```", re.DOTALL)


def blocks(path: Path = README) -> list[tuple[str, str, bool]]:
    """(language, code, run) of every fenced block of `path`, in order."""
    return [(m["lang"], m["code"], not m["before"].startswith("<!-- not run"))
            for m in BLOCK.finditer(path.read_text())]


def all_blocks() -> list[tuple[str, str, str, bool]]:
    """(page, language, code, run) of every fenced block of README.md, then of each page of PAGES."""
    return [(path.relative_to(ROOT).as_posix(), *block) for path in (README, *PAGES) for block in blocks(path)]


def test_every_block_has_a_language_and_skipped_ones_say_why() -> None:
    assert blocks(), "no code blocks found in README.md"
    for page, lang, code, _ in all_blocks():
        assert lang in ("bash", "python", "text"), f"{page}: block without a known language: {code[:80]!r}"


def test_the_readme_links_every_page_whose_examples_run() -> None:
    text = README.read_text()
    for path in PAGES:
        assert f"]({path.relative_to(ROOT).as_posix()})" in text, f"README.md does not link {path.name}"


INDEX = ROOT / "docs" / "benchmarks" / "README.md"
# A figure as the Results table writes it: 13.95 µs, 7.66x, 79%, 1,000, 302.1 s.
FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?(?:x|%)?")


def results_rows() -> list[list[str]]:
    """The cells of each row of the README's Results table (header and rule left out)."""
    section = README.read_text().split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]


def test_every_results_figure_is_in_the_benchmarks_index_and_its_report_exists() -> None:
    """Each headline figure is stated once in the README, and docs/benchmarks/README.md, the index,
    holds it with the same value; each row links a report that exists."""
    index = INDEX.read_text()
    rows = results_rows()
    assert len(rows) >= 5, rows
    for metric, value, _device, report in rows:
        missing = [figure for figure in FIGURE.findall(value) if figure not in index]
        assert not missing, f"Results row {metric[:60]!r}: {missing} not in {INDEX.relative_to(ROOT)}"
        link = re.search(r"\]\(([^)]+)\)", report)
        assert link and (ROOT / link[1]).is_file(), f"Results row {metric[:60]!r} links no report: {report}"


@pytest.mark.slow
def test_readme_examples_run_as_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FARM_DB"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    ran: dict[str, int] = {}
    for number, (page, lang, code, run) in enumerate(all_blocks(), 1):
        if not run or lang == "text":
            continue
        command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{page}, block {number} ({lang}) failed:\n{code}\n{proc.stderr[-3000:]}"
        ran[page] = ran.get(page, 0) + 1
    # The first session and the Python client; the search spec's shell example; applying an export.
    assert ran.get("README.md", 0) >= 2 and ran.get("docs/search.md") == 1 and ran.get("docs/export.md") == 1, ran
    assert (tmp_path / "kernel.so").exists() and (tmp_path / "msdb" / "database_tuning_record.json").exists()
