"""The weights `VLLMServerEngine` gives its replicas: which ones every replica serves, and
which folders it wrote may be deleted.

A version's weights are immutable: a `Checkpoint` is a folder as it was when a label was put
on it (each file's name, size, times and inode), with the digests of the tensors as sent
when they are known (the trainer's, for weights this engine wrote). Every load checks the
folder still is that checkpoint and refuses one that changed (`ChangedCheckpointError`): a
trainer that rewrote one "latest" folder each step once had a replica re-synced in between
load the new weights under the old label. Two checkpoints of one folder are different
weights, so a re-sync that loaded the first loads again when the second is committed.

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
import dataclasses
import enum
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncroll.engines.base import Weights
from asyncroll.engines.vllm import weight_check, weights_file


class Broadcast(enum.Enum):
    """Weights the replicas received over NCCL: unlike a folder, not there to load again."""

    SENT = "sent"


class ChangedCheckpointError(ValueError):
    """A checkpoint folder changed since its version label was put on it."""


Files = tuple[tuple[str, int, int, int, int], ...]
"""A folder's safetensors files: (name, size, mtime_ns, ctime_ns, inode) each."""


def _files(folder: Path) -> Files:
    out = []
    for file in sorted(folder.glob("*.safetensors")):
        st = file.stat()
        out.append((file.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder as it was when sealed (see the module docstring); `digests`: of
    the tensors as sent (None: not taken)."""

    path: Path
    files: Files
    digests: tuple[tuple[str, str], ...] | None = None

    @classmethod
    def seal(
        cls, path: str | os.PathLike[str], digests: dict[str, str] | None = None
    ) -> Checkpoint:
        folder = checkpoint(path)
        sent = None if digests is None else tuple(sorted(digests.items()))
        return cls(folder, _files(folder), sent)

    def check(self) -> Path:
        """Its folder, once checked unchanged; else `ChangedCheckpointError`."""
        checkpoint(self.path)
        if _files(self.path) != self.files:
            raise ChangedCheckpointError(
                f"{self.path}: its files changed since its version label was put on them (a"
                " checkpoint given to update_weights_from_path must stay as it is while it is"
                " served: write each step to a new folder)"
            )
        return self.path


Served = Checkpoint | Broadcast | None
"""What every replica in the rotation serves: a checkpoint, a broadcast, or (None) its own."""


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
        if not isinstance(weights, Checkpoint):
            yield
            return
        folder = weights.path
        self._pinned[folder] += 1
        try:
            yield
        finally:
            self._pinned[folder] -= 1
            if not self._pinned[folder]:
                del self._pinned[folder]

    def collect(self, served: Served) -> None:
        """Once an update committed `served`: delete every folder written before but the one
        served and those a re-sync is loading."""
        path = served.path if isinstance(served, Checkpoint) else None
        keep = [f for f in self.written if f == path or f in self._pinned]
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


def write(weights: Weights, folder: Path, digest: bool) -> dict[str, str] | None:
    """One `model.safetensors` in `folder`, the only file vLLM's `reload_weights` needs;
    with `digest`, the digests of the tensors as given (what `verify_weights` compares a
    replica's with: not the folder read back, which would pass a bit flipped on disk)."""
    named = weights_file.detached(weights)
    weights_file.write_safetensors(named, folder / "model.safetensors")
    return weight_check.digests(named) if digest else None


@dataclasses.dataclass(frozen=True)
class ServedLayout:
    """The tensors of the checkpoint the replicas were started from (headers only): each
    one's shape and dtype, and those an update must carry (less what vLLM computes)."""

    layout: dict[str, weight_check.Layout]
    required: frozenset[str]

    @classmethod
    def read(cls, model: Path) -> ServedLayout | None:
        """`model`'s layout; None when it holds no safetensors files (nothing to check)."""
        layout = weight_check.checkpoint_layout(str(model))
        names = weight_check.checkpoint_names(str(model))
        if layout is None or names is None:
            return None
        return cls(layout, frozenset(names))

    def refuse_misfits(self, named: list[tuple[str, Any]], where: str) -> None:
        """Refuse, before anything is written, tensors the served model cannot take: a shape
        or dtype (`WeightLayoutError`, as `VLLMEngine` refuses them before it sends anything),
        a tensor the model lacks or one it needs that the update lacks (`WeightMismatchError`,
        what every replica's load would raise, after a folder written for nothing; an
        unknown name failed the reload itself, and took every replica out of the rotation).
        An output head is neither: a tied model's checkpoint may lack it while a trainer's
        state dict lists it, or the reverse (the replica's own check catches an untied head
        left out)."""
        weight_check.check_layout(named, self.layout, where)
        given = {name for name, _ in named}
        missing = sorted(self.required - given - {_HEAD})
        extra = sorted(given - self.layout.keys() - {_HEAD})
        problems = []
        if missing:
            problems.append(f"the update lacks {_names(missing)}")
        if extra:
            problems.append(f"the served model has no {_names(extra)}")
        if problems:
            raise weight_check.WeightMismatchError(
                f"{where}: {'; '.join(problems)}. Refused: nothing was written or loaded"
            )


_HEAD = "lm_head.weight"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:8])
    return shown if len(names) <= 8 else f"{shown} and {len(names) - 8} more"
