"""The local disk (`LocalStorage`): local paths and `file://` URLs keep the POSIX
protocol: a temporary file, fsync, a rename (or a hard link, which never clobbers), fsync of
the directory. Every capability but `stale_by_age` and `save_deadline` holds here.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Any

from .._errors import invalid
from ._base import Item, Source, Upload, Writer
from ._local_files import LocalSource, fsync_dir, rename_no_replace
from ._temp import temp_name


class LocalStorage:
    """A POSIX directory tree: the `Storage` of local paths and `file://` URLs.

    Writes go to a temporary file that is fsynced, then renamed (or hard-linked, which never
    clobbers) under its name, and the directory is fsynced. A file is read through one
    descriptor, so a rename over it meanwhile cannot mix two versions.
    """

    atomic_rename = True
    cheap_reads = True
    os_errors_mean_bad_media = True
    stale_by_age = False
    save_deadline = False

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def list(self, directory: str) -> list[Item]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        items = []
        for e in entries:
            try:
                items.append(Item(e.name, e.path, e.is_dir(follow_symlinks=False), e.is_file()))
            except OSError:
                continue
        return items

    def find(self, directory: str, prefix: str) -> list[Item]:
        """The files whose path relative to `directory` starts with `prefix` (names
        relative to `directory`), down to one subdirectory: all a checkpoint layout has."""
        found = []
        for item in self.list(directory):
            if not item.name.startswith(prefix):
                continue
            if item.is_dir:
                found += [
                    Item(f"{item.name}/{sub.name}", sub.path, False, True)
                    for sub in self.list(item.path)
                    if sub.is_file
                ]
            elif item.is_file:
                found.append(item)
        return found

    def is_file(self, path: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except OSError:
            return False

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def makedirs(self, path: str) -> None:
        """Creates `path` and its missing parents, then fsyncs the parent of each of them
        and of `path` itself (which a save that died may have left unsynced): a new entry
        survives a power loss on any POSIX file system, not only on those (ext4, XFS) that
        order a directory's entries with the data written into it."""
        here = os.path.abspath(path)
        new = [here]
        while not os.path.isdir(os.path.dirname(here)) and os.path.dirname(here) != here:
            here = os.path.dirname(here)
            new.append(here)
        os.makedirs(path, exist_ok=True)
        for directory in reversed(new):
            # The parent of a directory that existed before may be unreadable (only
            # searchable): it was made durable by whoever created it.
            with contextlib.suppress(PermissionError):
                fsync_dir(os.path.dirname(directory))

    def start_deadline(self) -> None:
        """Local writes have no deadline: a disk that stops answering is the kernel's."""

    def atomic_write(self, path: str, write: Writer, *, replace: bool = True) -> None:
        """Runs `write(fd)` on a temporary file, fsyncs it, moves it to `path`, fsyncs the
        directory. On any error the temporary file is removed and the previous files are
        untouched. With `replace=False` the move never clobbers: if `path` appeared meanwhile
        (a concurrent save of the same step), `FileExistsError` is raised and nothing is
        changed."""
        directory, name = os.path.split(path)
        temp_path = os.path.join(directory, temp_name(name))
        fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            if replace or not _link(temp_path, path):
                os.replace(temp_path, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp_path)
            raise
        fsync_dir(directory or ".")

    def open(self, path: str) -> Source:
        return LocalSource(path, invalid(path))

    def identity(self, path: str) -> Any:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return (info.st_dev, info.st_ino)

    def version(self, path: str) -> Any:
        """Like `identity`, with the time and size: an inode number alone may be reused
        once a file is deleted, and a rename keeps all four."""
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)

    def remove(self, path: str) -> None:
        # Best effort: a name we cannot remove (a directory, another user's file) is left,
        # and never stops a save.
        with contextlib.suppress(OSError):
            os.remove(path)

    def remove_dir_if_empty(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(path)

    def move(self, path: str, new_path: str) -> None:
        """Renames the file or directory `path` to `new_path`, which must not exist
        (`FileExistsError`), and on Linux never replaces one that appears meanwhile
        (`rename_no_replace`; elsewhere, or on a file system without `RENAME_NOREPLACE`,
        a check then a rename)."""
        rename_no_replace(path, new_path)
        fsync_dir(os.path.dirname(new_path) or ".")

    def unfinished_uploads(self, directory: str) -> list[Upload]:
        """Local writes leave temporary files instead (cleaned up by name)."""
        return []

    def abort_upload(self, directory: str, upload: Upload) -> None:
        raise AssertionError("local storage has no uploads")  # pragma: no cover


def _link(temp_path: str, final_path: str) -> bool:
    """Moves `temp_path` to `final_path` unless it exists (then FileExistsError); False
    where the file system has no hard links, to fall back on a rename."""
    try:
        os.link(temp_path, final_path)
    except FileExistsError:
        raise
    except OSError:
        return False
    os.remove(temp_path)
    return True
