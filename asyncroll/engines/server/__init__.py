"""`VLLMServerEngine`: the `Engine` protocol over `vllm serve` replicas, over HTTP (the
`server` extra; vLLM itself is not needed in this process). `launch` starts and stops
`vllm serve` processes; `replicas`, `supervisor`, `client` are the control plane.

Import the engine as `from asyncroll.engines import VLLMServerEngine`."""
