"""How eqx_train quotes a value in a message: its `repr`, cut short."""

from __future__ import annotations

from typing import Any


def short(value: Any, limit: int = 80, *, squeeze: bool = False) -> str:
    """`repr(value)`, cut to `limit` characters (the cut ends in `...`), so that a message
    never quotes a whole model.

    **Arguments:**

    - `value`: what to quote.
    - `limit`: the most characters returned.
    - `squeeze`: first turn each run of whitespace in the repr (the lines of an array's
      repr, say) into one space.

    **Returns:**

    The text.
    """
    text = repr(value)
    if squeeze:
        text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
