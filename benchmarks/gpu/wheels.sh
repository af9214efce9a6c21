#!/usr/bin/env bash
# Downloads the wheels the GPU machine lacks into .whl/ (run where PyPI is reachable; the GPU machine
# has no network). The GPU image has PyTorch, numpy, tokenizers, safetensors, grpcio, scipy and pytest
# but not pydantic, and its transformers is older than the one this project pins: these travel; so do
# grpcio and protobuf, whose versions there are unknown (specdec/v1's stubs need grpcio >= 1.85.1 and
# protobuf 7 >= 7.35.1: the benchmark's transport section). About 24 MB in all.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  transformers==5.24.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 regex==2026.11.19 grpcio==1.85.3 protobuf==7.36.2
du -sh .whl
