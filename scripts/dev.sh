#!/usr/bin/env bash
# One entry point for set-up, the main job and the tests; safe to run on a fresh machine.
#   bash scripts/dev.sh setup        create or reuse .venv and install the pinned dependencies
#   bash scripts/dev.sh run [ARGS]   set up, then run the main job
#   bash scripts/dev.sh test [ARGS]  set up, then run the test suite (ARGS go to pytest)
#   bash scripts/dev.sh test fast [ARGS]  the inner loop: no meshes, nothing marked slow
#   bash scripts/dev.sh engines      set up, then add the real engines (vLLM CPU, torchtitan)
#   bash scripts/dev.sh engines-test [ARGS]  set up with engines, run tests/engines
#   bash scripts/dev.sh grpo [ARGS]  set up with engines, then the GRPO example (examples/grpo)
#   bash scripts/dev.sh gpu-check [ARGS]     set up, then the GPU check (one GPU, under 8 min;
#                                            says so and exits 0 without CUDA)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WB_VENV:-.venv}
PY=$VENV/bin/python

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  # The stamp skips the pip round trip when pyproject.toml has not changed since the last set-up.
  local stamp=$VENV/.wb-setup-$(sha1sum pyproject.toml | cut -c1-12)
  if [ ! -f "$stamp" ]; then
    "$PY" -m pip install -q --upgrade pip
    # torch==2.13.0 first and alone: the pin resolves to the CPU build on this machine's disk
    # instead of a multi-GB CUDA download that a looser requirement would pull.
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q -e ".[test,bench]"
    rm -f "$VENV"/.wb-setup-*
    touch "$stamp"
  fi
}

engines() {
  setup
  # The engines' own dependency trees pull a serving stack and a CUDA torchvision that breaks
  # transformers on a CPU torch; the lock holds only what model building and loading import,
  # installed without resolution (about 1.9 GB; see docs/engines.md).
  local stamp=$VENV/.wb-engines-$(sha1sum requirements/engines.txt | cut -c1-12)
  if [ ! -f "$stamp" ]; then
    "$PY" -m pip install -q --no-deps -r requirements/engines.txt
    rm -f "$VENV"/.wb-engines-*
    touch "$stamp"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  run)   setup; exec "$PY" -m controller "$@" ;;
  # Tests run on WB_TEST_WORKERS pytest-xdist workers (default 2; -n 0 in ARGS runs them in
  # this process). Much of a mesh test's time is waiting (procs starting, the timeouts it
  # provokes), so two workers help even on two cores (README, "The two commands").
  test)  setup
          xdist=(-n "${WB_TEST_WORKERS:-2}" --dist worksteal)
          if [ "${1:-}" = fast ]; then
            shift
            exec "$PY" -m pytest "${xdist[@]}" -m "not mesh and not slow" "$@"
          fi
          exec "$PY" -m pytest "${xdist[@]}" "$@" ;;
  engines) engines ;;
  engines-test) engines; exec "$PY" -m pytest -m engines tests/engines "$@" ;;
  grpo) engines; exec "$PY" -m examples.grpo "$@" ;;
  gpu-check) setup; exec "$PY" benchmarks/gpu_check.py "$@" ;;
  *) echo "usage: bash scripts/dev.sh {setup|run|test|engines|engines-test|grpo|gpu-check} [ARGS]" >&2
     exit 2 ;;
esac
