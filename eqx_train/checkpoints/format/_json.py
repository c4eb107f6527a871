"""JSON read from a checkpoint, parsed without trusting it: duplicate keys and nesting past
`MAX_JSON_DEPTH` are refused (the tree description, a `.shards` index, an Orbax
`_METADATA`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..._text import short


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a JSON object repeats a key")
    return result


# JSON nested deeper than this is refused: Python's own parser runs out of stack somewhere
# below 1000 levels on 3.11 and not at all on 3.13, and the code walking a parsed header
# recurses, so one bound makes every Python give the same answer.
MAX_JSON_DEPTH = 500


def parse_json(raw: bytes | str, what: str, bad: Callable[[str], Exception]) -> Any:
    try:
        parsed = json.loads(raw, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise bad(f"{what} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise bad(f"{what} is not valid JSON ({short(str(error), 120)})") from None
    stack = [(parsed, 1)]
    while stack:  # without recursion: the depth is what is being bounded
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise bad(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
            stack.extend((child, depth + 1) for child in children)
    return parsed
