# All set-up lives here: a fresh machine needs only `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build from this machine class's local disk; a loose `torch` pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
# pytest workers for `make test`: most tests wait on daemons, disks and sockets more than they compute (the suite
# kept about 1.3 of the 2 CI cores busy, ranks not counted), so three workers on the 2-core CI machine took 912 s
# where two had taken 1,024 s (that run lacked two changes worth ~20 s); four gained nothing over three (983 s
# against 981 s, one fresh clone, one after the other); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 3

.PHONY: install demo test docs lint bench bench-gpu device-wheels clean systemd-analyze sshfs

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[test,docs]"
	# torchtitan 0.3.0 for tests/test_integrations.py; without its dependencies (datasets, wandb,
	# tensorboard...), which its CheckpointManager does not import: those it does are in the test extras
	$(BIN)/pip install -q --no-deps "torchtitan==0.3.0"
	touch $(STAMP)

install: $(STAMP)

# tests/test_systemd.py verifies the unit with systemd-analyze: install it where it is missing and we
# may (root with apt); otherwise that one test skips, saying why
systemd-analyze:
	@command -v systemd-analyze >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null) ; } || \
		echo "systemd-analyze not installed: tests/test_systemd.py::test_unit_passes_systemd_analyze_verify will skip"

# tests/test_shared_dir.py and tests/test_posix_store.py run their multi-node cases on a real network file system too:
# sshfs mounts of one directory over a loopback sshd (tests/sshfs.py). Installed where we may (root with apt);
# otherwise those cases skip, saying why
sshfs:
	@{ command -v sshfs >/dev/null 2>&1 && [ -x /usr/sbin/sshd ]; } || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends sshfs openssh-server >/dev/null) ; } || \
		echo "sshfs or sshd not installed: the network file system cases of tests/test_shared_dir.py will skip"

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# the documentation site (Sphinx + MyST: the pages are Markdown, the API reference comes from the docstrings);
# warnings are errors, so a broken link or a stale reference fails `make test` too
docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

test: $(STAMP) systemd-analyze sshfs docs
	$(BIN)/ruff check ckptd tests benchmarks examples
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check ckptd tests benchmarks examples
	$(BIN)/ruff format --check ckptd tests benchmarks examples

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[test,bench]"
	$(BIN)/python benchmarks/stall.py
	$(BIN)/python benchmarks/many_tensors.py
	$(BIN)/python benchmarks/training_loop.py
	$(BIN)/python benchmarks/dcp_writer.py
	$(BIN)/python benchmarks/persist_restore.py
	$(BIN)/python benchmarks/hot_restore.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/gpu_copy.py
	$(BIN)/python benchmarks/plot.py

# on a machine with a GPU (the default state is 6 GB; see the script's docstring); on CPU: --device cpu --params 5e6
bench-gpu: $(STAMP)
	$(BIN)/pip install -q -e ".[test,bench]"
	$(BIN)/python benchmarks/gpu_loop.py

# the packages the lent GPU machine lacks (it has torch; it cannot download), as wheels for its Python 3.12,
# into .whl/ for the device tool to carry: see benchmarks/on_device.sh
DEVICE_WHEELS = pyzmq boto3 botocore s3transfer jmespath
device-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(DEVICE_WHEELS)
	ls .whl

clean:
	rm -rf $(VENV) build *.egg-info docs/_build
