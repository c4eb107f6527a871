"""A storage backend as a user writes one, outside fsspec: files as bytes in a dict. The
storage tests register it under schemes of their own."""

import itertools

from eqx_train.checkpoints.storage import Item, StorageBase

_VERSIONS = itertools.count()


class DictStorage(StorageBase):
    """Files in a dict, keyed by URL: (a version number, the bytes); directories are
    implicit."""

    def __init__(self, files: dict[str, tuple[int, bytes]]):
        self.files = files

    def info(self, path):
        if path in self.files:
            version, data = self.files[path]
            name = path.rsplit("/", 1)[-1]
            return Item(name, path, is_dir=False, is_file=True, identity=version, size=len(data))
        if any(key.startswith(path.rstrip("/") + "/") for key in self.files):
            return Item(path.rsplit("/", 1)[-1], path, True, False)
        return None

    def list(self, directory):
        base = directory.rstrip("/") + "/"
        names = {key[len(base) :].split("/", 1)[0] for key in self.files if key.startswith(base)}
        return [item for name in sorted(names) if (item := self.info(base + name)) is not None]

    def read(self, path, offset, size):
        return self.files[path][1][offset : offset + size]

    def put(self, path, data):
        self.files[path] = (next(_VERSIONS), bytes(data))

    def delete(self, path):
        del self.files[path]
