#!/usr/bin/env bash
# Wheels benchmarks/gpu_checks.sh needs on a device machine that lacks them (its image has
# torch, numpy, numba, xxhash, grpcio, prometheus-client, ... but not these), for its Python
# (3.12 on the H200 image): run here, where pip reaches PyPI, then name .whl in the device
# call's carry. .whl/ is kept out of git (.git/info/exclude).
set -euo pipefail
PY=${PY:-3.12}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
mkdir -p .whl
for name in blake3 zstandard msgspec redis hiredis cryptography cffi pycparser pyzmq; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$name" || echo "no wheel for $name" >&2
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp --platform any -d .whl aetcd || echo "no wheel for aetcd" >&2
ls -la .whl
