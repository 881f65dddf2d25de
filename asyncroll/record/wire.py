"""What the producer's process and the record's writer process say to each other.

Messages go one way, to the writer, as msgspec msgpack over a pipe (one `Connection` frame
each); the groups inside them are the codec's bytes (`asyncroll.codec.encode`), the trainer's
arrays `encode_value`'s. Acknowledgements come back on a second pipe: the last message written
and flushed, with the writer's counters. Every message but `Opening` carries the producer's
own counters (`Counts`) as they were when it was sent, so that step lines hold both sides'.
"""

from __future__ import annotations

import msgspec

STEP_SHARE = 16  # 1/16 of max_bytes is kept for step lines once groups reach the budget
STEPS_KEPT = 8  # the producer's metrics of a step wait this many batches for the trainer's


class Counts(msgspec.Struct, kw_only=True):
    """The producer's counters of the record (`RecordStats` has their meaning)."""

    drops_seen: int = 0
    drops_sampled: int = 0
    dropped_pending: int = 0
    dropped_closed: int = 0


class WriterStats(msgspec.Struct, kw_only=True):
    """The writer's counters of the record (`RecordStats` has their meaning)."""

    groups: int = 0
    skipped_budget: int = 0
    bytes: int = 0
    files: int = 0


class Opening(msgspec.Struct, tag="start", kw_only=True):
    """The first message: where and how to write, and the run's first line (encoded)."""

    seq: int
    path: list[str]  # the producer's sys.path, so that the tokenizer's classes import
    folder: str
    next_file: int
    bytes_before: int  # of earlier runs' files in the folder, counted against max_bytes
    started: float
    max_bytes: int
    step_bytes: int | None
    file_bytes: int
    tokenizer: bytes | None  # pickled
    run: bytes  # the RunLine, msgpack


class Batch(msgspec.Struct, tag="batch", kw_only=True):
    seq: int
    counts: Counts
    step: int
    version: int
    at: float
    metrics: dict[str, float]
    groups: list[bytes]


class Drop(msgspec.Struct, tag="drop", kw_only=True):
    seq: int
    counts: Counts
    version: int
    reason: str
    group: bytes


class Train(msgspec.Struct, tag="train", kw_only=True):
    seq: int
    counts: Counts
    step: int
    groups: list[bytes]
    rows: bytes  # encode_value({"logprobs": ..., "advantages": ..., "extra": {...}})


class Step(msgspec.Struct, tag="step", kw_only=True):
    seq: int
    counts: Counts
    step: int
    at: float
    numbers: dict[str, float]


Message = Opening | Batch | Drop | Train | Step


class Ack(msgspec.Struct, kw_only=True):
    """Everything up to `seq` is written and flushed to the OS (`error`: the writer failed
    and writes no more; its last word)."""

    seq: int
    stats: WriterStats
    error: str | None = None


MESSAGES: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
ACKS = msgspec.msgpack.Decoder(Ack)
