"""What a checkpoint URL may be: a scheme, then a plain location that no store would
rewrite (checked before any storage is built, whichever backend serves the scheme)."""

from __future__ import annotations

from ..._calls import call


def is_url(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").isalnum()


def plain_location(url: str, rest: str) -> str:
    """`rest` (what follows "://" in `url`) without trailing `/`, once it is known to be a
    plain location that no store would rewrite."""
    if "?" in rest or "#" in rest:
        raise ValueError(
            f"{call()}: {url!r} has a query or fragment ('?' or '#'); checkpoint URLs are "
            "plain locations such as s3://bucket/run (options go in storage_options=)."
        )
    rest = rest.rstrip("/")
    if rest:  # not the root of a memory store
        check_key(url, rest[1:] if url.lower().startswith("memory:") and rest[0] == "/" else rest)
    return rest


def check_key(url: str, rest: str) -> None:
    """Refuses a location that an object store would not keep as written. Stores rewrite
    some keys (SeaweedFS turns `a//b` and `a\\b` into `a/b`; S3 clients and servers treat
    `.` and `..` segments differently; some stores drop a trailing `.`): a save would then
    land under another key, a listing would find nothing, and two such URLs could collide."""
    segments = rest.split("/")
    problems = [
        ("a backslash", "\\" in rest),
        ("an empty path segment ('//')", any(not part for part in segments)),
        ("a '.' or '..' segment", any(part in (".", "..") for part in segments)),
        ("a segment ending in '.'", any(part.endswith(".") for part in segments)),
        ("a control character", any(ord(c) < 32 or ord(c) == 127 for c in rest)),
    ]
    found = [what for what, present in problems if present]
    if found:
        raise ValueError(
            f"{call()}: {url!r} has {found[0]}; object stores rewrite such keys, so the "
            "checkpoints would land under another name and a resume would not find them. "
            "Use plain segments separated by single '/'."
        )
