"""The demo application: the `asyncroll` command (`cli`), `asyncroll demo` (GRPO on the
tiny local model with real vLLM rollouts) and its tasks, and the tiny model itself
(`models`). It uses asyncroll as any user would; nothing in the library imports it."""
