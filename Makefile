# The two commands of the README: `make main` and `make test` (both do all set-up first).
PY := .venv/bin/python

.PHONY: setup main test test-fast approx

setup:
	./scripts/setup.sh

main: setup
	$(PY) conversion/main_job.py $(ARGS)

test: setup
	$(PY) -m pytest tests -q -ra

test-fast: setup
	$(PY) -m pytest tests -q -m "not slow"

approx: setup
	$(PY) benchmarks/approximation.py --out benchmarks/results/approximation.md
