#!/usr/bin/env bash
# The checks that need a GPU, as one script for a short lease of a CUDA machine (under ~8
# minutes on an H200 even when every step runs into its timeout, so a rerun fits a 15-minute
# lease): the gpu-marked tests, benchmarks.gpu (quick, then full: the block store's device
# paths and the connector's staging pipelines against pinned copies), then, where a CUDA build
# of vLLM is installed, restore vs recompute TTFT with the connector inside it
# (benchmarks.gpu_vllm). Each step is guarded: one failing still leaves the others' results.
# Results go to $OUT (default ./bench-results/gpu). It uses the machine's own python3 with
# torch; packages it lacks travel as wheels in .whl/ (benchmarks/gpu_wheels.sh fetches them).
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
python3 -c "import vllm; print('vllm', vllm.__version__)" >> "$OUT/versions.txt" 2>&1 || true
# what the project imports on this machine (a missing wheel shows here first)
python3 -c "import kvstore.store, kvstore.tiers.memory.hbm, connectors.vllm.loader, benchmarks.gpu" \
    >> "$OUT/versions.txt" 2>&1 && echo "kvkeep imports: ok" >> "$OUT/versions.txt"
status=0
step() {  # step NAME SECONDS COMMAND...: run it under a timeout, log it, note its status
    local name=$1 seconds=$2
    shift 2
    local started=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - started))s" | tee -a "$OUT/steps.txt"
    tail -n 25 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}
step gpu-tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
    tests/test_staging_gpu.py tests/test_codecs_batch.py tests/test_codecs.py tests/test_block.py \
    tests/test_hbm_tier.py tests/test_connector_layouts.py tests/test_router_gpu_nvml.py
step gpu-bench-quick 75 python3 -m benchmarks.gpu --quick --device cuda --json "$OUT/gpu-quick.json"
step gpu-bench 135 python3 -m benchmarks.gpu --device cuda --json "$OUT/gpu.json"
step gpu-vllm 170 python3 -m benchmarks.gpu_vllm --json "$OUT/gpu-vllm.json"
exit $status
