# The two entry points of the README. Each does all set-up first (idempotent).
.PHONY: chat test setup bench clean

setup:
	./scripts/setup.sh

chat: setup
	.venv/bin/localrun chat

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python benchmarks/speed_vs_llamacpp.py

clean:
	rm -rf .venv .pytest_cache .hypothesis
