"""The names a storage gives what it writes before a write is visible: a temporary file
next to its final name (local disk), or the empty marker naming the writer of a multipart
upload (an object store). `format._names` re-exports them beside every other name the
library puts on disk, so that cleanup and listing read them as the writer builds them.

`.{final}.tmp-{writer}-{random}`, where `{writer}` is `{host}-{pid}` of the process that
may clean the name up if it dies.
"""

from __future__ import annotations

import os
import re
import socket
import zlib

TEMP_MARK = ".tmp-"
WRITER = r"(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)"
_TEMP = re.compile(rf"\.(?P<final>.+){re.escape(TEMP_MARK)}{WRITER}-[0-9a-f]{{16}}")
# Earlier versions named temporaries without the host: `.{final}.tmp-{pid}-{32 hex}`.
_OLD_TEMP = re.compile(rf"\.(?P<final>.+){re.escape(TEMP_MARK)}(?P<pid>[0-9]+)-[0-9a-f]{{32}}")


def host_id() -> str:
    """This machine, as 8 hex digits (names carry it so cleanup knows whose pid it is)."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def writer_id() -> str:
    return f"{host_id()}-{os.getpid()}"


def temp_name(final_name: str) -> str:
    """A hidden name next to `final_name` that never matches a checkpoint name."""
    return f".{final_name}{TEMP_MARK}{writer_id()}-{os.urandom(8).hex()}"


def parse_temp(name: str) -> tuple[str, str, int] | None:
    """`(final name, host, pid)` of a `temp_name`, or None for any other name."""
    match = _TEMP.fullmatch(name)
    if match is not None:
        return match["final"], match["host"], int(match["pid"])
    match = _OLD_TEMP.fullmatch(name)
    return None if match is None else (match["final"], host_id(), int(match["pid"]))
