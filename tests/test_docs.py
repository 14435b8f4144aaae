"""The docs cannot rot: every ```python block of the README and docs/ runs (blocks of one file
in order, sharing a namespace), and the API reference matches the docstrings."""

import pathlib
import re
import subprocess
import sys

import matplotlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("page", [p for p in PAGES if BLOCK.search(p.read_text())], ids=lambda p: p.name)
def test_code_blocks_run(page):
    matplotlib.use("Agg")
    namespace = {"__name__": "__doc_example__"}
    for block in BLOCK.findall(page.read_text()):
        exec(compile(block, str(page), "exec"), namespace)


def test_api_reference_is_in_sync():
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"])
    assert out.returncode == 0, "docs/api.md is out of date: run python docs/make_api.py"
