"""The weights `VLLMServerEngine` gives its replicas: which ones every replica serves, and
which folders it wrote may be deleted.

A folder is deleted only when no replica can be reading it: not the one the engine serves
(a replica that comes back reloads it), not one a re-sync is loading (`pin`), and not a
failed update's before the next update commits (a reload cut off on this side may still be
reading it on the replica's). A reload of a missing path kills a vLLM engine, and an update
cut off at its final resume once deleted the folder it had just committed, after which every
re-sync failed.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from asyncroll.engines import weights_file
from asyncroll.engines.base import Weights


class Broadcast(enum.Enum):
    """Weights the replicas received over NCCL: unlike a folder, not there to load again."""

    SENT = "sent"


Served = Path | Broadcast | None
"""What every replica in the rotation serves: a folder, a broadcast, or (None) its own."""


class WeightFolders:
    """The folders an engine wrote under its `weights_dir`, and when each may go."""

    def __init__(self) -> None:
        self.written: list[Path] = []
        self._pinned: collections.Counter[Path] = collections.Counter()

    def add(self, folder: Path) -> None:
        self.written.append(folder)

    @contextlib.contextmanager
    def pin(self, weights: Served) -> Iterator[None]:
        """While a re-sync loads `weights`, their folder is not deleted under it."""
        if not isinstance(weights, Path):
            yield
            return
        self._pinned[weights] += 1
        try:
            yield
        finally:
            self._pinned[weights] -= 1
            if not self._pinned[weights]:
                del self._pinned[weights]

    def collect(self, served: Served) -> None:
        """Once an update committed `served`: delete every folder written before but the one
        served and those a re-sync is loading."""
        keep = [f for f in self.written if f == served or f in self._pinned]
        for folder in self.written:
            if folder not in keep:
                shutil.rmtree(folder, ignore_errors=True)
        self.written = keep

    def remove_all(self) -> None:
        """At close: the replicas keep what they loaded; nothing of this engine reloads."""
        for folder in self.written:
            shutil.rmtree(folder, ignore_errors=True)
        self.written.clear()


def checkpoint(path: str | os.PathLike[str]) -> Path:
    """`path` resolved, once checked to be a folder with safetensors files: vLLM treats a
    missing path as a Hugging Face repo id, fails, and its engine dies on the next request."""
    folder = Path(path)
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder}: not a folder with *.safetensors files")
    return folder.resolve()


def write(weights: Weights, folder: Path) -> None:
    """One `model.safetensors` in `folder`, the only file vLLM's `reload_weights` needs."""
    weights_file.write_safetensors(weights_file.detached(weights), folder / "model.safetensors")
