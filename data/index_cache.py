"""On-disk cache of index arrays: ``{directory}/{key}-{name}.npy``, loaded memory-mapped and without pickle.

Every file is written under a temporary name and renamed, so a reader sees either a complete array or none, and
several processes building the same key at once only repeat work. The key is a hash of everything that affects the
arrays; a ``{key}-description.json`` beside them says, for people, what that was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import numpy as np


class IndexCache:
    """A directory of cached index arrays."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)

    def path(self, key: str, name: str) -> str:
        return os.path.join(self.directory, f"{key}-{name}.npy")

    def load(self, key: str, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The arrays of a key, memory-mapped read-only, or None unless every one of them is present."""
        paths = {name: self.path(key, name) for name in names}
        if not all(os.path.isfile(path) for path in paths.values()):
            return None
        return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}

    def save(self, key: str, arrays: Mapping[str, np.ndarray], description: Mapping) -> None:
        os.makedirs(self.directory, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        for name, array in arrays.items():
            temporary = self.path(key, name) + suffix
            with open(temporary, "wb") as stream:
                np.save(stream, np.ascontiguousarray(array), allow_pickle=False)
            os.replace(temporary, self.path(key, name))
        description_path = os.path.join(self.directory, f"{key}-description.json")
        with open(description_path + suffix, "w") as stream:
            json.dump(description, stream, indent=2, sort_keys=True)
        os.replace(description_path + suffix, description_path)
