"""`KVKeepConnector` against vLLM's `KVConnectorBase_V1`: 0.33's (its source, parsed, never
imported: `tests/data/vllm_0_33/`) and the installed 0.32's.

For each: every method the base declares and the connector overrides keeps the base's
signature as vLLM calls it (the same kind, the same positional names in the same order, the same
defaults, `*args`/`**kwargs` where the base has them; any extra parameter has a default); every
abstract method is implemented; and every other hook is in `RELIED_ON_DEFAULTS`, with why the
base's default is right for this connector, so a hook a new vLLM adds fails here until someone
decides.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

import connectors.vllm.connector as connector_module

BASE_0_33 = Path(__file__).parent / "data" / "vllm_0_33" / "kv_connector_v1_base.py.txt"
BASE_CLASS = "KVConnectorBase_V1"

RELIED_ON_DEFAULTS: dict[str, str] = {
    "supports_divergent_local_hybrid_hits":
        "False: it concerns recurrent (SSM) state to complete, and groups of SSM state are "
        "refused at start-up (connectors/vllm/groups.py)",
    "role": "the base's property over the role __init__ passes on",
    "get_mem_pool_context":
        "None: the caches live in vLLM's own pool, which sleep mode's allocator tags "
        "'kv_cache' (what restore_kv_caches relies on being remapped in place)",
    "clear_connector_metadata": "the base's bookkeeping of the bound step metadata",
    "_get_connector_metadata": "the base's bookkeeping; start_load_kv and wait_for_save read it",
    "has_connector_metadata": "the base's bookkeeping",
    "set_host_xfer_buffer_ops":
        "no host transfer buffer handed to vLLM: the layouts copy blocks themselves",
    "finish_forward":
        "a no-op is right: save_kv_layer gathers each layer's blocks into a copy during the "
        "forward pass, so nothing reads the step's paged KV once it ends",
    "reset_capture_state":
        "capture's dummy forwards bind no step of ours (no loads, no saves planned), so they "
        "leave no worker state to undo",
    "handle_preemptions":
        "saves read gathered copies, never a preempted request's paged blocks afterwards; a "
        "finished request's flush is gathered before its blocks are released",
    "get_kv_connector_kv_cache_events":
        "None: the store's KV events come from the scheduler half's take_events",
    "get_handshake_metadata": "None: no peer handshake, the store is the rendezvous",
    "set_xfer_handshake_metadata": "no peer handshake",
    "set_xfer_handshake_metadata_pp_aware":
        "no peer handshake (and pipeline parallelism is refused at start-up)",
    "bind_gpu_block_pool": "no block-pool refcounts taken: blocks are copied, not pinned",
    "get_loaded_kv_cache_group_ids":
        "the prefix-cacheable groups: the one group a hash-addressed store holds",
    "get_external_cache_hit_sources":
        "every restored token under _cache_hit_source (EXTERNAL_UNSPECIFIED): one restore may "
        "mix host, nvme and remote tiers",
    "on_new_request": "a request is tracked from its first lookup on",
    "register_finished_partial_tail":
        "False: only full blocks are stored (keys are vLLM's full-block hashes)",
    "has_pending_block_frees":
        "False: a finished request's blocks are released in the step that flushes them",
    "get_required_kvcache_layout": "None: the layouts follow the backend's own",
    "get_finished_count": "None (the world size): every tensor-parallel rank reports",
    "reset_cache":
        "None (success) without dropping anything: the store holds KV keyed by this engine's "
        "fingerprint, which a prefix-cache reset (sleep level 1 and 2 do one) does not change. "
        "Weights changed in place while asleep are not seen: see the README's sleep-mode row",
}


@dataclass(frozen=True, slots=True)
class Signature:
    kind: str
    """'method', 'classmethod', 'staticmethod' or 'property'."""
    abstract: bool
    positional: tuple[str, ...]
    """Positional parameters after self/cls."""
    defaults: dict[str, str]
    keyword_only: tuple[str, ...]
    varargs: bool
    varkw: bool


def _signature(node: ast.FunctionDef) -> Signature:
    decorators = {ast.unparse(d) for d in node.decorator_list}
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators),
                "method")
    args = node.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    defaults = {name: ast.unparse(value) for name, value in
                zip(positional[len(positional) - len(args.defaults):], args.defaults,
                    strict=True)}
    defaults.update({a.arg: ast.unparse(d) for a, d in zip(args.kwonlyargs, args.kw_defaults,
                                                           strict=True) if d is not None})
    if kind != "staticmethod":
        positional = positional[1:]
    return Signature(kind, "abstractmethod" in decorators, tuple(positional), defaults,
                     tuple(a.arg for a in args.kwonlyargs), args.vararg is not None,
                     args.kwarg is not None)


def _methods(source: str, class_name: str) -> dict[str, Signature]:
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.name: _signature(n) for n in cls.body if isinstance(n, ast.FunctionDef)}


def _incompatibilities(name: str, base: Signature, ours: Signature) -> list[str]:
    problems = []
    if ours.kind != base.kind:
        problems.append(f"{name}: a {ours.kind}, the base's is a {base.kind}")
    if ours.positional[:len(base.positional)] != base.positional:
        problems.append(f"{name}: positional {ours.positional}, the base's {base.positional}")
    for extra in ours.positional[len(base.positional):] + ours.keyword_only:
        if extra not in base.positional + base.keyword_only and extra not in ours.defaults:
            problems.append(f"{name}: {extra} has no default, and vLLM does not pass it")
    for param in base.keyword_only:
        if param not in ours.positional + ours.keyword_only and not ours.varkw:
            problems.append(f"{name}: takes no keyword {param}")
    for param, default in base.defaults.items():
        if ours.defaults.get(param) != default:
            problems.append(f"{name}: {param} defaults to {ours.defaults.get(param)}, the "
                            f"base's to {default}")
    if base.varargs and not ours.varargs:
        problems.append(f"{name}: no *args, the base has them")
    if base.varkw and not ours.varkw:
        problems.append(f"{name}: no **kwargs, the base has them")
    return problems


def _installed_base_source() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return inspect.getsource(base)


BASES = {"0.33": BASE_0_33.read_text, "0.32-installed": _installed_base_source}


@pytest.fixture(scope="module")
def ours() -> dict[str, Signature]:
    return _methods(inspect.getsource(connector_module), "KVKeepConnector")


@pytest.mark.parametrize("version", list(BASES))
def test_overrides_keep_the_base_signatures(version: str, ours: dict[str, Signature]) -> None:
    base = _methods(BASES[version](), BASE_CLASS)
    overridden = sorted(set(base) & set(ours))
    assert "get_num_new_matched_tokens" in overridden  # the parse found both classes
    problems = [p for name in overridden for p in _incompatibilities(name, base[name],
                                                                     ours[name])]
    assert problems == []


@pytest.mark.parametrize("version", list(BASES))
def test_every_abstract_method_is_implemented(version: str,
                                              ours: dict[str, Signature]) -> None:
    base = _methods(BASES[version](), BASE_CLASS)
    abstract = {name for name, sig in base.items() if sig.abstract}
    assert abstract >= {"start_load_kv", "wait_for_save", "build_connector_meta"}
    assert abstract - set(ours) == set()


@pytest.mark.parametrize("version", list(BASES))
def test_every_hook_left_to_the_base_is_a_decision(version: str,
                                                   ours: dict[str, Signature]) -> None:
    base = _methods(BASES[version](), BASE_CLASS)
    left = set(base) - set(ours)
    assert left - set(RELIED_ON_DEFAULTS) == set(), "new hooks: decide, and list them"
    # A name listed here but overridden, or gone from the base, is a stale entry.
    assert set(RELIED_ON_DEFAULTS) - left == set()


@pytest.mark.parametrize("version", list(BASES))
def test_the_hybrid_kv_cache_manager_hook_keeps_its_signature(
        version: str, ours: dict[str, Signature]) -> None:
    """`SupportsHMA` (vLLM keeps its hybrid KV cache manager on only for connectors that
    subclass it) and its one abstract method, as each vLLM declares it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from connectors.vllm import KVKeepConnector

    assert issubclass(KVKeepConnector, SupportsHMA)
    base = _methods(BASES[version](), "SupportsHMA")
    assert set(base) == {"request_finished_all_groups"}
    name = "request_finished_all_groups"
    assert _incompatibilities(name, base[name], ours[name]) == []


def test_the_0_33_sleep_hooks_are_implemented(ours: dict[str, Signature]) -> None:
    base = _methods(BASE_0_33.read_text(), BASE_CLASS)
    for hook in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
        assert hook in base and hook in ours, hook


def test_the_stored_0_33_file_is_the_release_file() -> None:
    assert BASE_0_33.read_text().startswith("# SPDX-License-Identifier: Apache-2.0\n")
    assert hashlib.sha256(BASE_0_33.read_bytes()).hexdigest() == (
        "3af87e036c13ac36132471e4253cc10847be323891e3c18ce20b30c03aaac8f7")


def test_the_installed_class_has_no_abstract_methods_left() -> None:
    from connectors.vllm import KVKeepConnector

    assert KVKeepConnector.__abstractmethods__ == frozenset()


def test_the_check_catches_a_changed_signature() -> None:
    """The comparison itself can fail: a reordered, renamed or defaulted parameter shows."""
    base = _methods("class B:\n def f(self, a, b=1, **kw): ...\n", "B")["f"]
    good = _methods("class C:\n def f(self, a, b=1, c=2, **kw): ...\n", "C")["f"]
    assert _incompatibilities("f", base, good) == []
    for bad in ("def f(self, b, a=1, **kw): ...", "def f(self, a, b=2, **kw): ...",
                "def f(self, a, b=1): ...", "def f(self, a, b=1, *, c, **kw): ...",
                "@classmethod\n def f(cls, a, b=1, **kw): ..."):
        sig = _methods(f"class C:\n {bad}\n", "C")["f"]
        assert _incompatibilities("f", base, sig) != [], bad
