"""The code blocks of the docs pages run as written (in order, in one namespace)."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("page", ["data_parallel.md", "index.md", "checkpointing_recipes.md"])
def test_python_blocks_run(page):
    text = (DOCS / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{page} has no python blocks"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, f"{page}", "exec"), namespace)
