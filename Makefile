PYTHON ?= python3
DEPS_STAMP := .deps.stamp

.PHONY: deps test test-slow test-avx2 test-all lint run bench-engine bench-serve clean

# Re-run the installer only when what it installs changed.
$(DEPS_STAMP): pyproject.toml scripts/install_deps.sh
	PYTHON=$(PYTHON) bash scripts/install_deps.sh
	touch $@

# The stamp says the installer ran, not that this interpreter still holds what it installed (a
# new virtual environment, a machine rebuilt under the same checkout): check, and install again.
deps:
	@$(PYTHON) -c "import splitserve, torch, redis, grpc, xdist" >/dev/null 2>&1 \
		&& command -v redis-server >/dev/null || rm -f $(DEPS_STAMP)
	@$(MAKE) --no-print-directory PYTHON=$(PYTHON) $(DEPS_STAMP)

lint: deps
	$(PYTHON) -m ruff check .
	$(PYTHON) scripts/typecheck.py

# The suites marked slow (see pyproject.toml) run in their own target. Two pytest workers by
# default (PYTEST_WORKERS=0: one process); each takes whole test files, so a file's module
# fixtures (stacks, models) start once.
PYTEST_WORKERS ?= 2
test: deps lint
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -m "not slow" -n $(PYTEST_WORKERS) --dist loadfile \
		--durations=15

test-slow: deps
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -m slow --durations=15

# The kernel, quantization and bfloat16 test files again with every CPU path forced down to AVX2
# (tests/test_forced_avx2.py: make test runs its quick subset, test-slow the whole files).
test-avx2: deps
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests/test_forced_avx2.py

test-all: test test-slow

run: deps
	$(PYTHON) -m splitserve.cli up

bench-engine: deps
	$(PYTHON) -m benchmarks.engine

# Disaggregated against colocated under the same open-loop load (~10-15 min; BENCH_ARGS=--quick
# for ~3-4).
bench-serve: deps
	$(PYTHON) -m benchmarks.serve $(BENCH_ARGS)

clean:
	rm -f $(DEPS_STAMP)
