"""`VLLMServerEngine`: the `Engine` protocol over `vllm serve` replicas, over HTTP (the
`server` extra; vLLM itself is not needed in this process). `launch` starts and stops
`vllm serve` processes.

The engine (`engine`) is a facade that checks its arguments and composes rooms of one job
each: `request_path` the requests (admission, routing, streaming, aborts); `control` pauses,
resumes, the frame every update runs in and the calls on every replica that they share;
`updates` the weight updates (a folder, NCCL, a LoRA adapter: freeze, load, label, commit);
`supervisor` each replica's owner, the one that probes and re-syncs it. Beneath them:
`client` HTTP to the replicas (control calls on connections of their own); `samples` what a
request carries and brings back, parsed strictly; `lora` the LoRA adapters; `replica_load`
how one replica loads a folder; `weights` which weights the replicas serve; `nccl` and
`nccl_transfer` the NCCL group and its broadcast; `replicas` a replica's state and the wire
format.

Import the engine as `from asyncroll.engines import VLLMServerEngine`."""
