"""`python -m asyncroll`: the `asyncroll` command (asyncroll.app.cli) without the installed script.
The guard matters: vLLM's engine process is spawned and re-imports the main module."""

from asyncroll.app.cli import main

if __name__ == "__main__":
    main()
