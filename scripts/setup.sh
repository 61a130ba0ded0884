#!/usr/bin/env bash
# Create .venv and install egraph-did with its test and models extras. Idempotent: a second run installs nothing new.
# torch goes in first, pinned to 2.13.0, whose CPU wheel lies on local disk; pyproject's torch>=2.11 is
# then satisfied and pip never reaches for a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install --quiet "torch==2.13.0"
fi
# the models extra (transformers) lets the tests run the Hugging Face models; egraph_did never needs it
.venv/bin/pip install --quiet -c scripts/constraints.txt -e '.[test,models]' 2>&1 | grep -v "^WARNING: Location" || true
# torchtitan's Llama3 model and its parallelize code, for tests/face/test_torchtitan.py and bench/compare_tp.py.
# --no-deps: torchtitan declares its trainer's dependencies (datasets, wandb, tensorboard, ...), which the model
# and parallelize modules never import; these four are all that `import torchtitan.models.llama3` needs
.venv/bin/pip install --quiet --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser 2>&1 \
    | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, egglog, triton, egraph_did; print('egraph-did env: torch', torch.__version__, '| triton', triton.__version__, '| egglog ok')"
