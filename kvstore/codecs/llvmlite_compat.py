"""Work around a crash of vLLM's CPU worker start-up when numba has been imported.

It lives beside the kernels because importing them (numba, llvmlite) is what triggers it.

vLLM 0.32's CPU platform rebinds Triton kernels by scanning every attribute of every module in
`sys.modules` and calling `vars(value).get("kernel")` on anything that has a `__dict__`
(`vllm/triton_utils/dispatcher.py`, `_rebind_kernels`). llvmlite, which numba (and so
`kvstore.codecs`) imports, keeps a module-level `lib` object whose `__getattr__` answers *any*
name, `__dict__` included, with a wrapped C function: `vars(lib)` is then not a mapping and the
worker dies with "'_lib_fn_wrapper' object has no attribute 'get'". It happens whenever a CPU
engine starts in a process that imported kvstore's codecs first: a second in-process engine, or
an engine process forked from one that had loaded the connector.

The fix seeds llvmlite's lazy function table with an empty `__dict__` entry, so `vars(lib)` is
an empty dict. The table only caches C symbols (all named `LLVMPY_*`); no real lookup can ever
ask for `__dict__`, so nothing else changes.
"""

from __future__ import annotations

import sys

__all__ = ["patch_llvmlite_for_vllm"]


def patch_llvmlite_for_vllm() -> None:
    """Idempotent; does nothing unless llvmlite's binding layer is loaded."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    table = getattr(lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
