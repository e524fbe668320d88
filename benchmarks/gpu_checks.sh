#!/usr/bin/env bash
# The checks that need a GPU, as one script for a short lease of a CUDA machine:
# the gpu-marked tests, then benchmarks.gpu (quick, then full). Results go to $OUT (default
# ./bench-results/gpu). It uses the machine's own python3 with torch; packages it lacks travel as
# wheels in .whl/ (see README, "GPU checks").
set -uo pipefail
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvkeep-site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/kvkeep-site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, numpy, numba; print('torch', torch.__version__, 'numpy', numpy.__version__,
'numba', numba.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee "$OUT/versions.txt"
status=0
timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
    tests/test_codecs.py tests/test_block.py tests/test_hbm_tier.py tests/test_connector_layouts.py \
    tests/test_router_gpu_nvml.py 2>&1 | tee "$OUT/gpu-tests.log" || status=1
timeout 60 python3 -m benchmarks.gpu --quick --json "$OUT/gpu-quick.json" \
    2>&1 | tee "$OUT/gpu-bench-quick.log" || status=1
timeout 120 python3 -m benchmarks.gpu --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu-bench.log" \
    || status=1
exit $status
