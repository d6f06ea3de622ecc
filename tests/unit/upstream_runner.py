"""Upstream vllm-ascend 0.30.0rc2's KV-cache allocation code, run on CPU.

The functions that build every layer's KV cache on Ascend are executed from
the upstream sdist's own source text: each one is cut out of its file with
``ast`` (never re-typed here) and ``exec``-ed with its module globals
supplied. Importing the upstream modules instead is impossible in this venv:
they import ``torch_npu`` and some hundred other upstream modules, and their
package name ``vllm_ascend`` is this repository's.

What the code reads that only exists on an NPU host is replaced; every
replacement is in :data:`REPLACEMENTS` with the upstream file:line it stands
for and why. Inside the cut-out functions only one thing is changed: local
``from vllm_ascend... import X`` statements are dropped, and ``X`` is put in
the globals instead (each such ``X`` is itself upstream code loaded here).
``torch.zeros(..., device=self.device)`` allocates on ``self.device``, which
is the CPU here (upstream: the NPU).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

RUNNER = "vllm_ascend/worker/model_runner_v1.py"
# NPUModelRunner's methods that allocate and view the KV cache
# (initialize_kv_cache, model_runner_v1.py:4591, calls
# initialize_kv_cache_tensors and hands the result to the KV connector).
RUNNER_METHODS = tuple(
    "initialize_kv_cache_tensors _allocate_kv_cache_tensors"
    " _allocate_sparse_c8_indexer_tensors _allocate_int8_cache_tensor"
    " _align_memory _align_up _reshape_kv_cache_tensors _adjust_kv_layout"
    " _get_layer_kv_cache_specs _get_attention_kv_cache_dims"
    " _uses_page_strided_kv_layout _is_c8_mxfp_kv_cache"
    " _fill_c8_mxfp_v_scale_caches".split()
)
SPECS = "vllm_ascend/core/kv_cache_interface.py"  # imports vLLM only: loaded whole
MXFP = "vllm_ascend/attention/attention_c8_mxfp.py"
MXFP_NAMES = tuple(
    "MXFP_KV_SCALE_GROUP_SIZE MXFP_KV_SCALE_VALUES_PER_GROUP"
    " MXFP_KV_NZ_DIM_FRAG MXFP_K_SCALE_NZ_TOKEN_FRAG MXFP_V_SCALE_NZ_DIM_FRAG"
    " MXFP8_GROUP_SIZE MXFP_SCALE_DTYPE_SIZE validate_mxfp_k_scale_head_dim"
    " validate_mxfp_v_scale_block_size mxfp_kv_scale_groups"
    " mxfp_kv_block_scale_groups mxfp_k_scale_page_bytes mxfp_v_scale_page_bytes"
    " mxfp_k_scale_cache_shape mxfp_v_scale_cache_shape"
    " mxfp_packet_section_sizes mxfp_cache_spec mxfp_paged_cache_views"
    " mxfp_cache_views_for_spec fill_mxfp_v_scale_cache".split()
)
PROFILE = "vllm_ascend/device/hardware_profile.py"  # its HardwareCapability enum
UTILS = "vllm_ascend/utils.py"
UTILS_NAMES = tuple(
    "C8_MXFP_KV_CACHE_DTYPE is_c8_mxfp_kv_quant calc_split_factor"
    " get_kv_cache_tensor_layers is_hidden_state_cache_spec"
    " kv_cache_spec_uses_packed_sfa_main_cache kv_cache_spec_uses_sparse_sfa_c8".split()
)
QUANT = "vllm_ascend/quantization/configs/modelslim_config.py"
QUANT_METHODS = ("is_fa_quant_layer", "get_kv_quant_dtype", "get_kv_quant_split_factor")
ATTN_UTILS = "vllm_ascend/attention/utils.py"
ATTN_UTILS_NAMES = ("SFA_QSFA_TILE_SIZE", "get_sfa_qsfa_packed_head_dim")
# The backends' get_kv_cache_shape, as the runner calls it per group.
BACKENDS = {
    "AscendAttentionBackend": "vllm_ascend/attention/attention_v1.py",
    "AscendMLABackend": "vllm_ascend/attention/mla_v1.py",
    "AscendSFABackend": "vllm_ascend/attention/sfa_v1.py",
    "AscendSFAIndexerBackend": "vllm_ascend/attention/indexer.py",
}
SPARSE_BACKENDS = {"AscendSFABackend", "AscendSFAIndexerBackend"}
# What the cut-out code imports (in upstream, at the top of its files), under
# the names it uses; exec-ed into the namespace that code runs in.
IMPORTS = """
import math
import re
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from enum import Enum, auto
from typing import Any

import numpy as np
import torch
import vllm.envs as envs_vllm
from vllm.logger import logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.kv_cache_interface import (
    AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec,
    UniformTypeKVCacheSpecs,
)
"""


class Layer:
    """Stands for a model layer in the static forward context: vLLM's
    ``bind_kv_cache`` (called by initialize_kv_cache_tensors,
    model_runner_v1.py:4797) hands it its cache; ``attrs`` are what the
    runner reads of the layer besides its ``impl``."""

    def __init__(self, impl: Any = None, **attrs: Any):
        self.impl = impl
        self.kv_cache: Any = None
        vars(self).update(attrs)

    def bind_kv_cache(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache


class MLALayer(Layer):
    """Stands for vLLM's ``MLAAttention`` layer: the runner reads its
    ``kv_lora_rank`` and ``qk_rope_head_dim`` (model_runner_v1.py:4853)."""


class C8MXFPImpl:
    """Stands for ``AscendC8MXFPAttentionBackendImpl``
    (attention_c8_mxfp.py:472), an NPU attention impl: the runner only tests
    a layer's impl against it to find C8-MXFP layers
    (model_runner_v1.py:4721), whose static V scales (``v_cache_scale``)
    upstream's ``fill_mxfp_v_scale_cache`` writes into every page."""


class _NotOnCpu:
    """Stands for a name whose path no layout here takes; fails if reached."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"upstream {self.name} is not run on CPU")


# What stands in for upstream code or state that only exists on an NPU host,
# by the name the runner methods read. Per entry: "name: what it stands for in
# upstream (file:line)", then, indented, why it is replaced and by what.
REPLACEMENTS = dict(
    (name, f"{where.strip()}: {' '.join(why.split())}")
    for name, where, why in re.findall(
        r"^(\S+): (.+)\n((?:    .+\n)+)",
        """\
self.device: model_runner_v1.py:4882-4887,5184-5198 torch.zeros(..., device=self.device)
    the NPU; torch.device('cpu') here
get_layers_from_vllm_config: model_runner_v1.py:41 (vllm.config): attention layers
    no model is built: returns the scenario's layers
MLAAttention: model_runner_v1.py:267 (vLLM's MLA layer)
    a real layer needs a built model: MLALayer carries the two dims read
AscendC8MXFPAttentionBackendImpl: attention_c8_mxfp.py:472 (NPU attention impl)
    C8MXFPImpl marks the C8-MXFP layers
enable_fa_quant: quantization/utils.py:268
    asks the NPU's hardware profile (FP8_ATTENTION): scenario's answer
requires_contiguous_pa_kv_cache: attention/utils.py:215
    NPU paged-attention kernel eligibility: scenario's answer
get_current_hardware_profile: device/hardware_profile.py (reads the SoC)
    a profile that supports the scenario's capabilities
is_deepseek_v41_cache: models/deepseek_v41/cache_config.py:125
    DeepSeek V4.1 caches are not covered: False
is_glm5_next_cache_spec: models/glm5next/kv_cache.py
    GLM-Next caches are not covered: False
get_layerwise_reuse_config: kv_pool/ascend_store/layerwise_cache_layout.py:76
    its answer for an OffloadingConnector config: None
allocate_kvpp_cache: model_runner_v1.py:237, called at :4964
    not reached (KV pipeline parallelism off): fails if called
allocate_kv_cache_tensors_for_sparse_kv_offload: model_runner_v1.py:164
    not reached (sparse KV offload off): fails if called
reshape_kv_cache_tensors_for_sparse_kv_offload: model_runner_v1.py:168
    not reached (sparse KV offload off): fails if called
view_glm5_next_cache: model_runner_v1.py:179
    not reached (no GLM-Next cache): fails if called
v41_cache_layer_type: model_runner_v1.py:288 (DeepseekV41CacheLayer)
    a class no stand-in layer is an instance of
extract_dsv4_layer_index: utils.py, imported at model_runner_v1.py:4781
    not reached (no model of type deepseek_v4): fails if called
self.vllm_config: NPUModelRunner.__init__: the VllmConfig
    a namespace of the settings the code reads (KV transfer on, cache dtype,
    resolved layout, quant config, model config)
self.ascend_config: model_runner_v1.py:426 get_ascend_config()
    KV pipeline parallelism size 1, xlite graph off
self.compilation_config: vLLM's static forward context of the built model
    the scenario's stand-in layers (Layer, MLALayer)
is_sparse: vLLM AttentionBackend.is_sparse, read at model_runner_v1.py:5014
    True for upstream's SFA and indexer backends (BACKENDS)
self._kv_cache_spec_attn_group_iterator: vLLM GPUModelRunner's attention groups
    initialize_attn_backend builds them with NPU backends: the scenario's groups
    with upstream's get_kv_cache_shape (BACKENDS)
""",
        re.M,
    )
)
# Those the layouts here never reach: a stand-in that fails if called.
NOT_ON_CPU = [n for n, why in REPLACEMENTS.items() if why.endswith("fails if called")]


class _DropUpstreamImports(ast.NodeTransformer):
    """Removes function-local ``from vllm_ascend... import`` statements; the
    names they bound are supplied as globals (checked in :func:`_exec`)."""

    def __init__(self):
        self.names: set[str] = set()

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if (node.module or "").startswith("vllm_ascend"):
            self.names.update(a.asname or a.name for a in node.names)
            return None
        return node


def _defs(
    root: Path, rel: str, names: Sequence[str], cls: str | None = None
) -> list[ast.stmt]:
    """The definitions ``names`` at the top level of upstream's file ``rel``,
    or among the methods of its class ``cls``."""
    where, body = rel, ast.parse((root / rel).read_text()).body
    if cls is not None:
        where = f"{rel}:{cls}"
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls]
        if not classes:
            raise LookupError(f"upstream {rel} no longer defines class {cls}")
        body = classes[0].body
    found: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign) and cls is None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    found[t.id] = node
    missing = [n for n in names if n not in found]
    if missing:
        raise LookupError(f"upstream {where} no longer defines {missing}")
    return [found[n] for n in names]


def _exec(nodes: list[ast.stmt], namespace: dict[str, Any], origin: str) -> None:
    dropper = _DropUpstreamImports()
    module = ast.fix_missing_locations(dropper.visit(ast.Module(nodes, [])))
    unsupplied = sorted(n for n in dropper.names if n not in namespace)
    if unsupplied:
        raise LookupError(f"{origin} imports {unsupplied}, not supplied")
    exec(compile(module, origin, "exec"), namespace)


def _class(name: str, body: list[ast.stmt], namespace: dict, origin: str) -> type:
    """A class ``name`` of upstream's methods ``body``, exec-ed in ``namespace``."""
    _exec([ast.ClassDef(name, [], [], body, [])], namespace, origin)
    return namespace[name]


def _load_module(root: Path, rel: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, root / rel)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def load(root: Path) -> SimpleNamespace:
    """Upstream's specs, C8-MXFP helpers, backends' shapes and a runner class
    whose KV-cache methods are upstream's, from the unpacked sdist ``root``."""
    specs = _load_module(root, SPECS, "upstream_vllm_ascend_kv_cache_interface")
    ns: dict[str, Any] = {
        "__name__": "upstream_vllm_ascend",
        "VllmConfig": object,  # annotations only
        **{
            n: getattr(specs, n)
            for n in "AscendMLAAttentionSpec AscendSFAIndexerCacheSpec "
            "AscendIndexerKPoolTailSpec AscendSlidingWindowMLASpec "
            "requires_padded_page_layout get_kv_cache_compression_ratio "
            "get_storage_block_size".split()
        },
        # Replacements (REPLACEMENTS says what each stands for); the ones a
        # scenario answers are read from the runner instance (see Runner).
        "MLAAttention": MLALayer,
        "AscendC8MXFPAttentionBackendImpl": C8MXFPImpl,
        "is_deepseek_v41_cache": lambda specs: False,
        "is_glm5_next_cache_spec": lambda spec: False,
        "get_layerwise_reuse_config": lambda kv_transfer_config: None,
        "v41_cache_layer_type": type("NoV41Layer", (), {}),
        **{n: _NotOnCpu(n) for n in NOT_ON_CPU},
    }
    exec(IMPORTS, ns)
    for rel, names in (
        (PROFILE, ("HardwareCapability",)),
        (UTILS, UTILS_NAMES),
        (ATTN_UTILS, ATTN_UTILS_NAMES),
        (MXFP, MXFP_NAMES),
    ):
        _exec(_defs(root, rel, names), ns, rel)
    backends = {}
    for name, rel in BACKENDS.items():
        (shape_fn,) = _defs(root, rel, ["get_kv_cache_shape"], name)
        is_sparse = ast.parse(f"def is_sparse():\n    return {name in SPARSE_BACKENDS}")
        backends[name] = _class(name, [shape_fn, *is_sparse.body], ns, rel)
    quant = _defs(root, QUANT, QUANT_METHODS, "AscendModelSlimConfig")
    kv_quant = _class("ModelSlimKVQuant", quant, ns, QUANT)
    runner = _defs(root, RUNNER, RUNNER_METHODS, "NPUModelRunner")
    return SimpleNamespace(
        specs=specs,
        backends=backends,
        runner_methods=_class("UpstreamRunnerMethods", runner, ns, RUNNER),
        kv_quant=kv_quant,
        ns=ns,
    )
