"""Sizes that keep the package readable: no module over 500 lines, no class over 300 lines
of code, no function over 100 (docstrings, comments and blank lines not counted)."""

from __future__ import annotations

import ast
import pathlib
import textwrap

import eqx_train

PACKAGE = pathlib.Path(eqx_train.__file__).parent
MAX_MODULE_LINES = 500
MAX_CLASS_CODE = 300
MAX_FUNCTION_CODE = 100


def _docstring_lines(node: ast.AST) -> set[int]:
    body = getattr(node, "body", None)
    if (
        isinstance(body, list)
        and body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        first = body[0]
        return set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return set()


def _code_lines(
    node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]
) -> int:
    counted = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for inner in ast.walk(node):
        counted -= _docstring_lines(inner)
    return sum(
        1 for i in counted if lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")
    )


def _too_big(source: str, where: str) -> list[str]:
    lines = source.splitlines()
    found = []
    if len(lines) > MAX_MODULE_LINES:
        found.append(f"{where}: {len(lines)} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            limit = MAX_CLASS_CODE if isinstance(node, ast.ClassDef) else MAX_FUNCTION_CODE
            size = _code_lines(node, lines)
            if size > limit:
                found.append(f"{where}:{node.lineno} {node.name}: {size} lines of code")
    return found


def test_no_module_class_or_function_of_the_package_is_too_big():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _too_big(path.read_text(), str(path.relative_to(PACKAGE)))
    assert found == []


def test_the_size_check_counts_code_not_docstrings():
    body = "\n".join(f"    x{i} = {i}" for i in range(101))
    long_function = f'def f():\n    """Doc.\n\n    More doc.\n    """\n{body}\n'
    assert _too_big(long_function, "m.py") == ["m.py:1 f: 102 lines of code"]
    documented = 'def g():\n    """' + "\n".join(["line"] * 300) + '"""\n    return 1\n'
    assert _too_big(documented, "m.py") == []  # 302 lines, of which 2 are code
    assert _too_big(textwrap.dedent("x = 1\n") * 501, "m.py") == ["m.py: 501 lines"]
