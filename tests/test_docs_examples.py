"""Every Python code block in the docs pages and in eqx_train's docstrings runs as written.

- Pages: every `docs/**/*.md` is collected (a new page needs no edit here). Its ```python
  blocks run in order, in one namespace, in a fresh working directory, as a user pasting
  them into one script would run them.
- Docstrings: every ```python block in the docstring of a module, class, function or method
  of eqx_train (private modules included) runs in a copy of its module's namespace.

A block that cannot run in one process (it needs several hosts) is marked by the line
`<!-- docs-test: not-run; runs in tests/test_x.py -->` just before it. The named test must
exist and name the page: that is where the block's content runs instead.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
import textwrap
import types

import pytest

import eqx_train

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# A fenced ```python block at any indentation (docstrings nest them in lists and notes),
# optionally preceded by a docs-test marker at the same indentation.
_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)(?:<!--[ \t]*docs-test:[ \t]*(?P<marker>.*?)[ \t]*-->[ \t]*\n"
    r"(?P=indent))?```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
    flags=re.M | re.S,
)
_NOT_RUN = re.compile(r"not-run; runs in (?P<test>tests/[\w/]+\.py)")


def _blocks(text: str, where: str) -> list[tuple[int, str | None, str]]:
    """(line of the first code line, marker or None, dedented code) for each block."""
    blocks = [
        (text.count("\n", 0, m.start("code")) + 1, m["marker"], textwrap.dedent(m["code"]))
        for m in _BLOCK.finditer(text)
    ]
    openers = len(re.findall(r"^[ \t]*```python[ \t]*$", text, flags=re.M))
    assert openers == len(blocks), f"{where}: a ```python block is not closed at its indent"
    return blocks


def _run(code: str, line: int, where: str, namespace: dict) -> None:
    # Pad with newlines so that tracebacks show the line numbers of the page or file.
    exec(compile("\n" * (line - 1) + code, where, "exec"), namespace)


def _pages() -> list[pathlib.Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = str(page.relative_to(ROOT))
    namespace: dict = {"__name__": "__main__"}
    for line, marker, code in _blocks(page.read_text(), name):
        if marker is None:
            _run(code, line, name, namespace)
            continue
        not_run = _NOT_RUN.fullmatch(marker)
        assert not_run, f"{name}:{line}: unknown docs-test marker {marker!r}"
        test = ROOT / not_run["test"]
        assert test.is_file(), f"{name}:{line}: {not_run['test']} does not exist"
        assert page.name in test.read_text(), f"{not_run['test']} does not mention {page.name}"


def _documented(module: types.ModuleType):
    """The module and every class, function and method defined in it."""
    yield module.__name__, module
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj
            for attr, member in vars(obj).items():
                member = getattr(member, "__func__", getattr(member, "fget", member))
                if callable(member) and getattr(member, "__doc__", None):
                    yield f"{module.__name__}.{name}.{attr}", member
        elif callable(obj):
            yield f"{module.__name__}.{name}", obj


def _docstring_examples() -> list:
    modules = [eqx_train] + [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(eqx_train.__path__, "eqx_train.")
    ]
    examples, seen = [], set()
    for module in modules:
        for qualname, obj in _documented(module):
            doc = obj.__doc__
            if not isinstance(doc, str) or id(obj) in seen:
                continue
            seen.add(id(obj))
            for i, (line, marker, code) in enumerate(_blocks(inspect.cleandoc(doc), qualname)):
                assert marker is None, f"{qualname}: docstring examples cannot be marked"
                examples.append(pytest.param(module, code, line, id=f"{qualname}[{i}]"))
    return examples


@pytest.mark.parametrize(("module", "code", "line"), _docstring_examples())
def test_docstring_example_runs(module, code, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(code, line, f"<docstring example in {module.__name__}>", dict(vars(module)))


def test_every_page_with_python_is_collected():
    # The collector must find the pages this suite has always run, and docstring examples.
    pages = {p.name for p in _pages()}
    assert {"index.md", "data_parallel.md", "checkpointing_recipes.md"} <= pages
    assert any("EarlyStopping" in p.id for p in _docstring_examples())
