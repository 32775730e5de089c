#!/usr/bin/env bash
# Download the server's pure-Python dependencies into .whl/ (git-ignored via .git/info/exclude), for a GPU
# machine whose image lacks them and has no package index: bring .whl/ along, and the stages of
# scripts/gpu.sh that need them install them from there.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
grep -qsx "/.whl/" "$exclude" || echo "/.whl/" >> "$exclude"
for pkg in fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection uvicorn \
           opentelemetry-api xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py; do
  # pinned to the version installed here; with pipefail a missing package would otherwise end the script silently
  if ! version=$(python3 -m pip show "$pkg" 2>/dev/null | sed -n 's/^Version: //p'); then
    echo "fetch_server_wheels.sh: $pkg is not installed in $(python3 -c 'import sys; print(sys.prefix)');" \
         "install kestrel with its server dependencies here first (pip install -e .), so the wheels match them" >&2
    exit 1
  fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$pkg${version:+==$version}"
done
ls .whl
