"""The NCCL group that `VLLMServerEngine` broadcasts weights through (GPUs): the trainer at
rank 0 and every member replica's workers after it, and the three steps of one broadcast.

A broadcast cannot be given again to a replica that missed it, and a second join or
receive waits for a rendezvous that never comes: so no step here is ever retried
(`idempotent=False`), a replica that fails to join leaves the rotation, and a failure once
weights move leaves every member with partial weights (all leave the rotation, the error
names the replica and the step). The update around it (pause, label, resume) is the
engine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from asyncroll.engines.base import EngineDeadError
from asyncroll.engines.server import nccl_transfer
from asyncroll.engines.server.client import ReplicaClient
from asyncroll.engines.server.replicas import Replica, ReplicaError
from asyncroll.engines.vllm import groups as vllm_groups

NOT_CONFIGURED = "Weight transfer not configured"  # vLLM without --weight-transfer-config

OnEvery = Callable[
    [Sequence[Replica], Callable[[Replica], Awaitable[object]]], Awaitable[list[Replica]]
]
"""A call on each replica at once; those that fail leave the rotation; those that succeeded."""


class NcclGroup:
    """The group's members in rank order (None: no group; the next update forms one).
    `on_every`, `down` and `states` are the engine's: running a call on several replicas,
    taking one out of the rotation, and describing them all for an error."""

    def __init__(
        self,
        client: ReplicaClient,
        on_every: OnEvery,
        down: Callable[[Replica, BaseException], None],
        states: Callable[[], str],
    ) -> None:
        self.members: tuple[Replica, ...] | None = None
        self._client = client
        self._on_every = on_every
        self._down = down
        self._states = states

    def leave(self, replica: Replica) -> None:
        """`replica` is no member any more: its workers may be new processes when it answers
        again, so the next update rebuilds the group with it."""
        if self.members is not None and replica in self.members:
            self.members = tuple(r for r in self.members if r is not replica)

    async def leave_if_restarted(self, replica: Replica, version: int) -> None:
        """Take `replica` out of the group if it does not carry the engine's label `version`
        (vLLM's initial one: it restarted between probes, and its new workers are in no
        group), so that the group is rebuilt with it instead of broadcasting to ranks that
        are not there (a broadcast that would hang until its timeout)."""
        reply = await self._client.call(replica, "GET", "/weight_info")
        if not isinstance(reply, dict) or reply.get("weight_version") != str(version):
            self.leave(replica)

    async def form(
        self, sender: nccl_transfer.WeightSender, members: list[Replica]
    ) -> list[Replica]:
        """Leave the old group (members still in it shut their end), and join a new one of
        `members`: the trainer at rank 0, each replica's workers (`/get_world_size`, data
        parallel included) after the previous replica's. No weights move here, so a failure
        leaves every replica serving what it had; a replica started without
        `--weight-transfer-config` fails the update with a `ValueError` saying so, and one
        that fails to join leaves the rotation (else every later update would fail on it
        again). The members that joined."""
        old, self.members = self.members or (), None
        staying = [r for r in members if r in old]
        shut = await self._on_every(
            staying, lambda r: self._client.call(r, "POST", "/shutdown_weight_transfer_engine")
        )
        members = [r for r in members if r not in staying or r in shut]
        sizes: dict[Replica, int] = {}

        async def world_size(replica: Replica) -> None:
            reply = await self._client.call(replica, "GET", "/get_world_size")
            size = reply.get("world_size") if isinstance(reply, dict) else None
            if not isinstance(size, int) or size < 1:
                raise ReplicaError(replica.url, f"GET /get_world_size -> {reply!r}")
            sizes[replica] = size

        members = await self._on_every(members, world_size)
        if not members:
            raise EngineDeadError(f"no replica is up: {self._states()}")
        offsets = np.cumsum([1] + [sizes[r] for r in members]).tolist()
        init_info = sender.new_group(offsets[-1])

        async def init(replica: Replica, offset: int) -> None:
            body = {"init_info": {**init_info, "rank_offset": offset}}
            await self._client.call(
                replica,
                "POST",
                "/init_weight_transfer_engine",
                body,
                timeout_s=sender.timeout_s,
                idempotent=False,  # a second join waits for a rendezvous that never comes
            )

        joins = [sender.join(), *map(init, members, offsets[:-1])]
        error = await vllm_groups.first_error([asyncio.ensure_future(j) for j in joins])
        if error is not None:
            sender.leave()
            if NOT_CONFIGURED in str(error):
                raise ValueError(
                    f"{error}: start every replica with"
                    """ --weight-transfer-config '{"backend":"nccl"}' to use weight_transfer"""
                ) from None
            for replica in members:  # it leaves: the next update forms the group without it
                if isinstance(error, ReplicaError) and error.url == replica.url:
                    self._down(replica, error)
            raise error
        self.members = tuple(members)
        return members

    async def transfer(
        self,
        sender: nccl_transfer.WeightSender,
        members: list[Replica],
        named: list[tuple[str, Any]],
        version: int,
    ) -> None:
        """Start an update on every member, receive on every member while the trainer sends
        (a broadcast needs every rank), finish. Any failure here leaves every member with
        partial weights: the group is dropped, every member leaves the rotation, the error is
        raised (it names the replica and the step)."""
        body = {"update_info": nccl_transfer.update_info(named)}

        def calls(path: str, json: Any = None) -> list[Awaitable[Any]]:
            # never sent twice: a second receive waits for a broadcast that never comes
            return [
                self._client.call(
                    r, "POST", path, json, timeout_s=sender.timeout_s, idempotent=False
                )
                for r in members
            ]

        steps: list[Callable[[], list[Awaitable[Any]]]] = [
            lambda: calls("/start_weight_update"),
            lambda: [sender.send(named), *calls("/update_weights", body)],
            lambda: calls("/finish_weight_update"),
        ]
        try:
            for step in steps:
                error = await vllm_groups.first_error([asyncio.ensure_future(c) for c in step()])
                if error is not None:
                    raise error
        except BaseException as exc:
            self.members = None
            sender.leave()
            if isinstance(exc, Exception):  # not when cancelled: the caller stops waiting now
                await self._finish_open(members, sender.timeout_s)
            partial = RuntimeError(
                f"left with partial weights: the update to version {version} failed: {exc}"
            )
            for replica in members:
                mine = isinstance(exc, ReplicaError) and exc.url == replica.url
                self._down(replica, exc if mine else partial)
            raise

    async def _finish_open(self, members: Sequence[Replica], timeout_s: float) -> None:
        """After a failed round, finish the open update on every member: a vLLM worker whose
        `/start_weight_update` succeeded and whose update was never finished refuses every
        later start ("already active") and every `/shutdown_weight_transfer_engine`, so the
        replica could take no NCCL update again until it restarts. A member with no open
        update answers an error, which changes nothing; every answer is ignored (the round's
        own error is what the caller gets), each within `timeout_s`."""
        await asyncio.gather(
            *(
                self._client.call(
                    r, "POST", "/finish_weight_update", None, timeout_s=timeout_s, idempotent=False
                )
                for r in members
            ),
            return_exceptions=True,
        )
