#!/usr/bin/env bash
# The plugin's tests inside LMCache (`make bench-lmcache`, after benchmarks/lmcache_env.sh):
#
#   bash benchmarks/lmcache_tests.sh [VENV] [KVKEEP_PYTHON]
#
# 1. LMCache's own fs and RESP adapter tests against LMCache's own adapters, from its source
#    package: proof that the CPU build works before anything is compared with it;
# 2. tests/test_lmcache_adapter.py (the plugin inside LMCache: factory, tensors, failures, etcd)
#    and tests/test_lmcache_suite.py (LMCache's adapter tests pointed at the plugin), in the
#    LMCache venv, with kvkeep's daemons started from kvkeep's own venv (KVKEEP_PYTHON).
# A redis-server on a free loopback port serves the RESP tests; it is stopped by pid at exit.
# `--noconftest`: kvkeep's tests/conftest.py needs kvkeep's test environment, not this one.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-lmcache}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
KVKEEP_PYTHON="${2:-$ROOT/.venv/bin/python}"
case "$KVKEEP_PYTHON" in /*) ;; *) KVKEEP_PYTHON="$ROOT/$KVKEEP_PYTHON" ;; esac
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"
SRC="$VENV/src/lmcache-$LMCACHE_VERSION"
test -d "$SRC/tests" || { echo "no LMCache source at $SRC: run benchmarks/lmcache_env.sh" >&2; exit 1; }

TMP="$(mktemp -d)"
REDIS_PORT="$("$KVKEEP_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no --dir "$TMP" \
    >/dev/null 2>&1 &
REDIS_PID=$!
cleanup() { kill "$REDIS_PID" 2>/dev/null || true; wait "$REDIS_PID" 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done

export REDIS_HOST=127.0.0.1 REDIS_PORT LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1
export KVKEEP_DAEMON_PYTHON="$KVKEEP_PYTHON" KVKEEP_LMCACHE_SRC="$SRC"

echo "== LMCache's own fs and RESP adapter tests, on its own adapters"
(cd "$SRC" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/v1/distributed/test_fs_l2_adapter_delete.py \
    tests/v1/distributed/test_fs_l2_adapter_keys.py \
    tests/v1/distributed/test_resp_l2_adapter_integration.py \
    examples/lmc_external_l2_adapter/tests/test_plugin.py)

echo "== the kvkeep plugin inside LMCache, and LMCache's adapter tests pointed at it"
cd "$ROOT"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    --noconftest -ra tests/test_lmcache_adapter.py tests/test_lmcache_suite.py
