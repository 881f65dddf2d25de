"""The run report: `build_report(run_dir)` turns a run's record into a static HTML page that
opens from disk (no server, no network): the curves of the step metrics, the steps and their
groups, and any sample token by token, coloured by loss mask, policy version or the gap between
the trainer's and the sampler's logprobs (`asyncroll report RUN_DIR` on the command line)."""

from asyncroll.report.build import build_report
from asyncroll.report.data import STEPS_PER_CHUNK, decode_floats, encode_floats

__all__ = ["STEPS_PER_CHUNK", "build_report", "decode_floats", "encode_floats"]
