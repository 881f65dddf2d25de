"""asyncroll's internals: the producer's machinery (admission, flights, attempts, control,
checkpoints, counters) and the small concurrency helpers the engines share.

Nothing here is API: import from `asyncroll` (which re-exports the public names) or from
the public packages. Names and modules here change without notice."""
