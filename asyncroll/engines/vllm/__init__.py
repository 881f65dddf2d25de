"""vLLM as a library: `VLLMEngine` (vLLM's `AsyncLLM` in this process) and what both vLLM
backends share: how a group runs as vLLM requests (`groups`), requests a paused vLLM
refuses (`refusals`), the weights file
(`weights_file`), the weight check (`weight_check`) and the worker extension
(`in_worker`), which runs inside vLLM's worker processes, never in the trainer's.

Import the engine as `from asyncroll.engines import VLLMEngine`; this package imports
nothing on its own, so the server backend can use its shared modules without vLLM."""
