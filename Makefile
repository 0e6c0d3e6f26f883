# The two commands of the README: `make main` and `make test` (both do all set-up first).
PY := .venv/bin/python

.PHONY: setup main test test-fast test-fla-cpu approx

setup:
	./scripts/setup.sh

main: setup
	$(PY) conversion/main_job.py $(ARGS)

test: setup
	$(PY) -m pytest tests -q -ra

test-fast: setup
	$(PY) -m pytest tests -q -m "not slow"

#: the fla backend's twin tests on a CPU under Triton's interpreter (tests/ops/test_fla_interpreter.py):
#: Triton and fla-core go into a folder of their own (about 1 GB), not into the environment
FLA_SITE := .fla-site
FLA_PINS := triton==3.9.0 fla-core==0.6.0 einops==0.8.2

test-fla-cpu: setup
	@if [ "$$(cat $(FLA_SITE)/pins 2>/dev/null)" != "$(FLA_PINS)" ]; then \
		rm -rf $(FLA_SITE) && $(PY) -m pip install --quiet --no-deps --target $(FLA_SITE) $(FLA_PINS) && echo "$(FLA_PINS)" > $(FLA_SITE)/pins; fi
	TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR)/$(FLA_SITE) $(PY) -m pytest tests/ops/test_fla_interpreter.py -q -ra

approx: setup
	$(PY) benchmarks/approximation.py --out benchmarks/results/approximation.md
