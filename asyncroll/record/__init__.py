"""The run record: every handed-out group token by token, what the trainer attached to it, and
the step metrics, as JSON Lines in the run's folder (`format` says what each line holds)."""

from asyncroll.record.format import (
    FORMAT,
    GroupLine,
    Line,
    RecordError,
    RunLine,
    SampleLine,
    StepLine,
    TrainLine,
    read_record,
    record_files,
)
from asyncroll.record.writer import Record, RecordConfig, RecordOption, RecordStats

__all__ = [
    "FORMAT",
    "GroupLine",
    "Line",
    "Record",
    "RecordConfig",
    "RecordError",
    "RecordOption",
    "RecordStats",
    "RunLine",
    "SampleLine",
    "StepLine",
    "TrainLine",
    "read_record",
    "record_files",
]
