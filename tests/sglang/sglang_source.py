"""SGLang code the tests need but cannot import on CPU torch, run from SGLang's own source.

The interface module (``sglang.srt.mem_cache.hicache_storage``) and the key helpers
(``sglang.srt.mem_cache.utils``) import on CPU and the tests import them normally. SGLang's
host KV pools (``pool_host/mha.py``, ``mla.py``) and its cache controller
(``managers/cache_controller.py``) do not: their modules import ``memory_pool``, which imports
``sglang.srt.configs``, whose model configs import ``torchvision`` (PyPI's torchvision is a CUDA
build that does not load next to torch 2.13.0+cpu; the import chain also reaches MoE and
DeepGEMM modules). So the tests take the *methods* they need from those files, unchanged:
each named ``def`` / ``class`` is parsed from the installed package's source and executed in a
namespace holding only the names it uses. A host pool built this way has SGLang's own
``init_kv_buffer``, ``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page``,
``alloc`` and ``free``; the controller driver has SGLang's own page get/set/backup and hit-query
functions. If a future SGLang renames one of them, :func:`definitions` raises ``KeyError``.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import threading
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any, List, Optional

import torch


def sglang_file(relpath: str) -> Path:
    """Path of ``relpath`` inside the installed ``sglang`` package."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    return Path(list(spec.submodule_search_locations)[0]) / relpath


def definitions(relpath: str, names: list[str], namespace: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
    """Execute top-level definitions ``names`` of SGLang file ``relpath`` (or, with ``owner``,
    methods of class ``owner``) in ``namespace``; returns them by name."""
    tree = ast.parse(sglang_file(relpath).read_text())
    body = tree.body
    if owner is not None:
        body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner).body
    found = {node.name: node for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names}
    out: dict[str, Any] = {}
    for name in names:
        module = ast.Module(body=[found[name]], type_ignores=[])
        exec(compile(module, f"<sglang {relpath}:{name}>", "exec"), namespace)
        out[name] = namespace[name]
    return out


def _synchronized(func):
    @wraps(func)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return func(self, *args, **kwargs)

    return wrapper


def _alloc_cpu(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    # SGLang's alloc_with_pin_memory (pool_host/common.py), without pinning: no CUDA here.
    return torch.empty(dims, dtype=dtype, device=device)


_POOL_GLOBALS = {
    "torch": torch, "Optional": Optional, "synchronized": _synchronized, "ALLOC_MEMORY_FUNCS": {"cpu": _alloc_cpu},
    "logger": logging.getLogger("sglang-source"),
}
_BASE_METHODS = ["clear", "available_size", "_merge_release_slots", "logical_size", "logical_page_size", "alloc", "free"]
_PAGE_METHODS = ["init_kv_buffer", "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page"]


def _pool_class(name: str, relpath: str, owner: str, extra: list[str]) -> type:
    members = definitions("srt/mem_cache/pool_host/base.py", _BASE_METHODS, dict(_POOL_GLOBALS), owner="HostKVCache")
    members.update(definitions(relpath, _PAGE_METHODS + extra, dict(_POOL_GLOBALS), owner=owner))
    return type(name, (), members)


_classes: dict[str, type] = {}


def host_pool(kind: str, layout: str, *, num_pages: int, page_size: int, num_layers: int, dtype: torch.dtype,
              num_heads: int = 2, head_dim: int = 8, kv_dim: int = 24) -> Any:
    """A host KV pool of ``num_pages`` pages with SGLang's own buffer layout and page methods.

    Args:
        kind: ``"MHA"`` (``MHATokenToKVPoolHost``) or ``"MLA"`` (``MLATokenToKVPoolHost``).
        layout: SGLang's ``--hicache-mem-layout``.
        num_heads, head_dim: MHA geometry; kv_dim: MLA ``kv_lora_rank + qk_rope_head_dim``.
    """
    if kind not in _classes:
        if kind == "MHA":
            _classes[kind] = _pool_class("MHAHostPool", "srt/mem_cache/pool_host/mha.py", "MHATokenToKVPoolHost", [])
        else:
            _classes[kind] = _pool_class("MLAHostPool", "srt/mem_cache/pool_host/mla.py", "MLATokenToKVPoolHost",
                                         ["_storage_page_index"])
    pool = _classes[kind].__new__(_classes[kind])
    pool.layout, pool.page_size, pool.page_num, pool.size = layout, page_size, num_pages, num_pages * page_size
    pool.dtype, pool.layer_num, pool.dcp_size, pool.lock = dtype, num_layers, 1, threading.RLock()
    pool.device, pool.pin_memory, pool.allocator, pool._transfer_device = "cpu", False, None, torch.device("cpu")
    if kind == "MHA":
        pool.head_num, pool.head_dim, pool.v_head_dim = num_heads, head_dim, head_dim
    else:
        pool.kv_cache_dim, pool.kv_lora_rank, pool.qk_rope_head_dim = kv_dim, kv_dim - 8, 8
        pool.dsa_kv_cache_store_fp8 = False
    pool.kv_buffer = pool.init_kv_buffer()
    pool.clear()
    return pool


# -- the cache controller's page functions -----------------------------------------------------
_CONTROLLER = "srt/managers/cache_controller.py"
_CONTROLLER_METHODS = ["_page_get_zero_copy", "_generic_page_get", "_page_transfer_kv_batch", "_storage_hit_query",
                       "_generic_page_set", "_page_set_zero_copy", "_page_backup"]


def controller(backend: Any, host: Any, zero_copy: bool) -> Any:
    """An object with SGLang's own ``HiCacheController`` storage functions bound to
    ``backend`` and host pool ``host`` (``zero_copy``: the ``interface_v1`` path), and SGLang's
    ``PrefetchOperation`` / ``StorageOperation`` classes as attributes."""
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    namespace = {
        "torch": torch, "List": List, "Optional": Optional, "threading": threading, "dataclass": dataclass,
        "time": __import__("time"), "logger": logging.getLogger("sglang-source"),
        "get_storage_hash_str": get_storage_hash_str, "STORAGE_BATCH_SIZE": hicache_storage.STORAGE_BATCH_SIZE,
        "HiCacheStorageExtraInfo": hicache_storage.HiCacheStorageExtraInfo,
        "PoolTransfer": hicache_storage.PoolTransfer, "PoolName": hicache_storage.PoolName,
        "count_pool_hits": hicache_storage.count_pool_hits,
    }
    classes = definitions(_CONTROLLER, ["StorageOperation", "PrefetchOperation"], namespace)
    namespace.update(classes)
    methods = definitions(_CONTROLLER, _CONTROLLER_METHODS, namespace, owner="HiCacheController")
    ctrl = type("Controller", (), methods)()
    ctrl.storage_backend, ctrl.storage_host_pool, ctrl.mem_pool_host = backend, host, host
    ctrl.page_size = host.page_size
    ctrl.page_get_func = ctrl._page_get_zero_copy if zero_copy else ctrl._generic_page_get
    ctrl.page_set_func = ctrl._page_set_zero_copy if zero_copy else ctrl._generic_page_set
    ctrl.StorageOperation, ctrl.PrefetchOperation = classes["StorageOperation"], classes["PrefetchOperation"]
    return ctrl
