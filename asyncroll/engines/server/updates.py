"""The weight updates of `VLLMServerEngine`: how new weights (a folder, or tensors over NCCL),
a new version label or a LoRA adapter reach every replica in the rotation, and when the
engine starts serving them.

Why a module of its own. An update is the one long multi-step path the engine runs (freeze,
load on every replica, label, commit, clean up), and the one that decides what the replicas
serve; requests, routing and pauses only read that. It changes nothing but what it is given
to change: `ControlState`'s weights and version (what a supervisor re-syncs a replica to),
the folders it writes (`WeightFolders`), the adapters' commit (`ServerAdapters`) and the
NCCL group. What it needs of the engine's control plane comes in as `Fleet`, a few typed
calls (the freeze frame, a call on every replica, taking one out of the rotation): it never
reads the engine's requests or admission, and the engine reads nothing back from it but
the loads that its supervisors re-sync with (`load_on`, `resync_load`, `own_model`).

The rules it keeps (see `vllm_server`'s docstring): no request straddles an update (each runs
inside `Fleet.frozen`); an update commits only once every replica in the rotation loaded it,
and one cut off part-way sends the replicas that may carry its weights or label out of the
rotation until re-synced (`resync_if_interrupted`); new full weights end the requests sent
with an adapter first; a label is put only on the process that loaded the weights it names
(`label`: vLLM has no compare-and-set, so the replica's process identity is read before the
load and again after the label).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from asyncroll.engines.base import EngineDeadError, Weights
from asyncroll.engines.server import lora as server_lora
from asyncroll.engines.server import nccl_transfer, replica_load
from asyncroll.engines.server import supervisor as sup
from asyncroll.engines.server import weights as server_weights
from asyncroll.engines.server.client import ReplicaClient
from asyncroll.engines.server.nccl import NcclGroup, OnEvery
from asyncroll.engines.server.replicas import (
    Replica,
    ReplicaError,
    ReplicaState,
    UnsyncedReplicaError,
)
from asyncroll.engines.vllm import weights_file
from asyncroll.lora import LoraAdapter


@dataclasses.dataclass(frozen=True)
class Fleet:
    """What an update asks of the engine: its control plane, and one step of its request
    path. `frozen`: the update's frame (under the control lock, admission held; afterwards
    every replica resumed and admission released, unless the caller had paused);
    `pause_up`: pause every UP replica; `on_every` / `on_every_up`: a call on several (every
    UP) replica at once, one that fails leaving the rotation (every one refusing the
    weights after `on_every_up`: `WeightMismatchError`; none up is no error); `down`: take
    one out of the rotation; `end_adapter_requests`: abort the requests sent with an
    adapter; `states`: every replica described, for an error."""

    frozen: Callable[[], contextlib.AbstractAsyncContextManager[None]]
    pause_up: Callable[[], Awaitable[None]]
    on_every: OnEvery
    on_every_up: Callable[[Callable[[Replica], Awaitable[object]]], Awaitable[list[Replica]]]
    down: Callable[[Replica, BaseException], None]
    end_adapter_requests: Callable[[], Awaitable[None]]
    states: Callable[[], str]


class WeightUpdates:
    """The update path of one engine (see the module docstring). `weights_dir`,
    `weight_transfer` and `verify_weights` are the engine's arguments of those names;
    `pause_timeout_s` and `health_timeout_s` bound the calls that revive a replica for a
    broadcast."""

    def __init__(
        self,
        replicas: list[Replica],
        state: sup.ControlState,
        client: ReplicaClient,
        folders: server_weights.WeightFolders,
        lora: server_lora.ServerAdapters,
        group: NcclGroup,
        fleet: Fleet,
        *,
        weights_dir: Path | None,
        weight_transfer: nccl_transfer.WeightSender | None,
        verify_weights: bool,
        pause_timeout_s: float,
        health_timeout_s: float,
    ) -> None:
        self._replicas = replicas
        self._state = state
        self._client = client
        self._folders = folders
        self._lora = lora
        self._group = group
        self._fleet = fleet
        self.weights_dir = weights_dir
        self.weight_transfer = weight_transfer
        self.verify_weights = verify_weights
        self._pause_timeout_s = pause_timeout_s
        self._health_timeout_s = health_timeout_s
        self._layout: server_weights.ServedLayout | object | None = _UNREAD
        self._served = ""  # where the layout was read, for its errors

    async def weights(self, weights: Weights | LoraAdapter | None, version: int) -> None:
        """`VLLMServerEngine.update_weights`: a `LoraAdapter` becomes the policy; None
        relabels; tensors go over NCCL (`weight_transfer`) or into a new folder under
        `weights_dir`, deleted once no replica can be reading it (`WeightFolders`)."""
        if isinstance(weights, LoraAdapter):
            await self._update_lora(weights, version)
            return
        if weights is None:
            await self.folder(None, version)
            return
        if self.weight_transfer is None and self.weights_dir is None:
            raise ValueError(
                "update_weights with tensors needs weights_dir (a folder every replica reads);"
                " or write the checkpoint yourself and call update_weights_from_path"
            )
        named = await asyncio.to_thread(weights_file.detached, weights)
        await self._refuse_misfits(named)
        if self.weight_transfer is not None:
            await self._update_nccl(self.weight_transfer, named, version)
            return
        assert self.weights_dir is not None  # checked above
        folder = self.weights_dir / f"asyncroll-v{version}-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        self._folders.add(folder)
        try:
            digests = await asyncio.to_thread(
                server_weights.write, named, folder, self.verify_weights
            )
            sealed = server_weights.Checkpoint.seal(folder, digests)
            await self.folder(sealed, version)
        finally:
            served = self._state.weights
            if isinstance(served, server_weights.Checkpoint) and served.path == folder:
                self._folders.collect(served)  # committed (even if cut off at its resume after)

    async def _refuse_misfits(self, named: list[tuple[str, Any]]) -> None:
        """Refuse tensors the served model cannot take before anything is written or sent
        (`ServedLayout.refuse_misfits`), as `VLLMEngine` does: the engine once wrote the
        folder and learnt it from every replica's refusal. The layout is read once, from the
        model folder a replica was started from (`own_model`; all serve one model); none
        when that is no local folder (the replicas' own checks remain)."""
        if self._layout is _UNREAD:
            for replica in self._replicas:
                if replica.state is not ReplicaState.UP:
                    continue
                try:
                    model = await self.own_model(replica)
                except ReplicaError:
                    continue  # another replica may tell; else the next update asks again
                except ValueError:  # a hub id, or a folder this process cannot read
                    self._layout = None
                    break
                self._layout = await asyncio.to_thread(server_weights.ServedLayout.read, model)
                self._served = f"the model the replicas serve ({model}, as {replica.url} names it)"
                break
        if isinstance(self._layout, server_weights.ServedLayout):
            self._layout.refuse_misfits(named, self._served)

    async def from_path(self, path: Path, version: int) -> None:
        """`VLLMServerEngine.update_weights_from_path`: the folder sealed as it is now (with
        `verify_weights`, the digests of its tensors read now), then loaded (`folder`)."""
        digests = None
        if self.verify_weights:
            digests = await asyncio.to_thread(replica_load.folder_digests, path)
        await self.folder(server_weights.Checkpoint.seal(path, digests), version)

    async def folder(self, folder: server_weights.Checkpoint | None, version: int) -> None:
        """Hold admission, freeze every replica, load `folder` (None: keep the weights),
        recompute running requests' KV cache, label `version`, resume (unless the caller
        paused), release admission."""
        if folder is None and version == self._state.version:
            return
        async with self._fleet.frozen():
            if not self._state.paused:
                await self._fleet.pause_up()
            weights = folder if folder is not None else self._state.weights
            if folder is not None:
                await self._fleet.end_adapter_requests()
            loading = [r for r in self._replicas if r.state is ReplicaState.UP]
            with resync_if_interrupted(loading):
                if folder is None:
                    await self._fleet.on_every_up(lambda r: self._relabel_on(r, version))
                else:
                    await self._fleet.on_every_up(lambda r: self.load_on(r, folder, version))
            if folder is not None:
                self._lora.commit(None, self._state.version)  # full weights are the policy again
                self._state.adapter = None
            else:
                self._lora.relabelled(version)
            self._state.weights = weights
            self._state.version = version

    async def _update_nccl(
        self, sender: nccl_transfer.WeightSender, named: list[tuple[str, Any]], version: int
    ) -> None:
        """`folder` with the tensors broadcast over NCCL: the members (the UP replicas and
        the STALE ones that answer) are frozen, the group is (re)built when they changed,
        then every member receives while the trainer sends, finishes, and takes the label."""
        async with self._fleet.frozen():
            await self._revive_for_broadcast()
            members = [
                r for r in self._replicas if r.state in (ReplicaState.UP, ReplicaState.STALE)
            ]
            members = await self._fleet.on_every(
                members,
                lambda r: self._client.call(r, "POST", sup.PAUSE, timeout_s=self._pause_timeout_s),
            )
            version_now = self._state.version
            members = await self._fleet.on_every(members, lambda r: self._member(r, version_now))
            if not members:
                raise EngineDeadError(f"no replica is up: {self._fleet.states()}")
            if self._group.members != tuple(members):
                members = await self._group.form(sender, members)
            await self._fleet.end_adapter_requests()
            self._state.weights = server_weights.Broadcast.SENT  # the old ones go everywhere
            await self._group.transfer(sender, members, named, version)
            with resync_if_interrupted(members):
                members = await self._fleet.on_every(
                    members, lambda r: self.load_on(r, None, version)
                )
            if not members:
                raise EngineDeadError(f"no replica is up: {self._fleet.states()}")
            for replica in members:
                replica.state = ReplicaState.UP
            self._lora.commit(None, self._state.version)  # full weights are the policy again
            self._state.adapter = None
            self._state.version = version

    async def _member(self, replica: Replica, version: int) -> None:
        """Before a broadcast: note the process that will receive it (the label after it is
        put on that process only), then leave the group if it restarted since the last
        update (`NcclGroup.leave_if_restarted`). In that order: a restart between the two
        is seen by the second, and the group is rebuilt with the new process."""
        replica.process = await self.process(replica)
        await self._group.leave_if_restarted(replica, version)

    async def _revive_for_broadcast(self) -> None:
        """Before an NCCL update (under the control lock): new and stale replicas that answer
        become members (their weights come with the broadcast, paused first like every
        member); down ones wait for the next request's probe."""
        for replica in self._replicas:
            if replica.state not in (ReplicaState.UNSYNCED, ReplicaState.STALE):
                continue
            if replica.syncing.locked():  # its own sync runs: it takes the next broadcast
                continue
            async with replica.syncing:
                try:
                    await self._client.call(
                        replica, "GET", "/health", timeout_s=self._health_timeout_s
                    )
                    await self._client.call(
                        replica, "POST", sup.PAUSE, timeout_s=self._pause_timeout_s
                    )
                    replica.state = await sup.catch_up(
                        replica,
                        self._state.weights,
                        self._state.version,
                        self.resync_load,
                        self.own_model,
                    )
                except (ReplicaError, ValueError) as exc:
                    self._fleet.down(replica, exc)

    async def _update_lora(self, adapter: LoraAdapter, version: int) -> None:
        """Make `adapter` the policy (`server_lora`): write it once, then, frozen like a
        weight update, load it on every replica (a refusal of the adapter raises `LoraError`
        before any label changes), label `version`, and commit: later requests carry it."""
        self._lora.check(adapter)
        if self.weights_dir is None:
            raise ValueError(
                "update_weights with a LoraAdapter needs weights_dir (a folder every replica"
                " reads, where the adapter is written)"
            )
        record = await self._lora.write(adapter, self.weights_dir, version)
        try:
            async with self._fleet.frozen():
                if not self._state.paused:
                    await self._fleet.pause_up()
                loading = [r for r in self._replicas if r.state is ReplicaState.UP]
                await self._fleet.on_every_up(lambda r: self._lora.load(r, record))
                with resync_if_interrupted(loading):
                    await self._fleet.on_every_up(lambda r: self.label(r, version))
                self._lora.commit(record, self._state.version)
                self._state.adapter = record
                self._state.version = version
        finally:
            if self._lora.current is not record:
                self._lora.retire(record)  # unloaded wherever it loaded

    async def load_on(
        self, replica: Replica, folder: server_weights.Checkpoint | None, version: int
    ) -> None:
        """Reload `folder` on one (paused or idle) replica, drop its KV cache (running requests
        are recomputed under the new weights), and set its label to `version`. A folder that
        changed since it was sealed is refused (`ChangedCheckpointError`, a `ValueError`)
        before anything is sent; so is a missing one, whose reload kills a vLLM engine."""
        if folder is not None:
            path = folder.check()
            replica.process = await self.process(replica)  # the process the label must find
            replica.loaded = path  # before it is sent: a cut-off call may still land
            sent = None if folder.digests is None else dict(folder.digests)
            await replica_load.load(
                functools.partial(self._client.call, replica),
                replica.url,
                path,
                self.verify_weights,
                sent,
            )
            folder.check()  # rewritten while the replica read it: what it loaded is unknown
        reply = await self._client.call(
            replica, "POST", "/reset_prefix_cache?reset_running_requests=true"
        )
        if not (isinstance(reply, dict) and reply.get("success")):
            raise ReplicaError(replica.url, f"could not reset its prefix cache: {reply}")
        await self.label(replica, version)

    async def _relabel_on(self, replica: Replica, version: int) -> None:
        """A relabel (`update_weights(None, ...)`) on one paused replica: `load_on` without a
        folder, whose label is put only on the process that loaded the weights (`label`): one
        that restarted since (between probes, or just now) serves its own weights under
        vLLM's initial label, and the control-plane simulation found them labelled with the
        next version."""
        await self.load_on(replica, None, version)

    async def own_model(self, replica: Replica) -> Path:
        """The model folder `replica` was started from (`replica_load.own_model`)."""
        return await replica_load.own_model(
            functools.partial(self._client.call, replica), replica.url
        )

    async def resync_load(
        self, replica: Replica, folder: server_weights.Checkpoint | None, version: int
    ) -> None:
        """A re-sync's load (`Supervisor`, `catch_up`): the weights and label, then the
        current LoRA adapter, which a replica that restarted lacks. Without a folder (no
        update committed yet: each replica serves its own weights) whatever process answers
        serves the engine's weights: it is the one the label must find."""
        if folder is None:
            replica.process = await self.process(replica)
        await self.load_on(replica, folder, version)
        await self._lora.catch_up(replica)

    async def label(self, replica: Replica, version: int) -> None:
        """Set `replica`'s version label to `version`, on the process that took the weights
        it names (`replica.process`, noted before their load). vLLM sets a label
        unconditionally, so the process is read again once the label is set: a replica that
        restarted in between (before the label call, or during it: the call, tried again on
        a fresh connection, reached the new process) serves its own weights under the label.
        It is `UnsyncedReplicaError` then, out of the rotation until synced again; nothing
        was sent to it meanwhile (an update holds admission, a sync is not in the rotation),
        and a restart after the read leaves vLLM's initial label, which no request accepts.
        (The control-plane simulation found tokens of weights 0 labelled 3 this way.)"""
        await self._client.call(
            replica, "POST", "/update_weight_version", {"new_version": str(version)}
        )
        now = await self.process(replica)
        if now != replica.process:
            raise UnsyncedReplicaError(
                replica.url,
                f"took the label {version} in a process that did not load the weights it"
                " names (restarted since)",
            )

    async def process(self, replica: Replica) -> str:
        """The identity of `replica`'s serving processes now (`replica_load.process`)."""
        return await replica_load.process(
            functools.partial(self._client.call, replica), replica.url
        )


_UNREAD = object()  # the served layout, before a replica named its model folder


@contextlib.contextmanager
def resync_if_interrupted(replicas: list[Replica]) -> Iterator[None]:
    """Around an update's loads and labels: if it ends by an exception other than a
    replica's failure (a cancellation at the caller's deadline, above all), any of
    `replicas` may already carry the new weights or label while the engine keeps the old
    ones, and a roll back to the old version would be a no-op (`WeightUpdates.folder` skips
    an unchanged one). Those still up leave the rotation until synced again with the
    engine's weights and label (at once: the update's own resume syncs them)."""
    try:
        yield
    except BaseException as exc:
        for replica in replicas:
            if replica.state is ReplicaState.UP:
                replica.mark_unsynced(f"an update was interrupted: {exc!r}")
        raise
