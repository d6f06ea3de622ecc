"""What the packaging tests' scratch venv has, as one JSON line on stdout.

Run by file path with ``python -P`` (nothing of the checkout on ``sys.path``;
``merged``: ``-S``, in the main venv), never imported by the tests:

* ``state UPSTREAM OURS [--metadata-only]``: both distributions (RECORD
  checked against the files on disk), vLLM's plugin groups (each entry point
  resolved, not called) and what the imports give;
* ``plugins NAME...``: calls each named general plugin as vLLM would; which
  fail and why, and every general plugin's name;
* ``merged TREE SITE_DIR...``: the imports from a grafted source tree;
* ``selection ORDER``: upstream's real connector registration and our plugin,
  in ORDER ("upstream,ours" or "ours,upstream"); which class serves
  OffloadingConnector and what the fallback class is.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import traceback
from importlib import metadata
from pathlib import Path


def dist(name: str) -> dict | None:
    try:
        d = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    files, bad = [], []
    for f in d.files or []:
        files.append(f.as_posix())
        path = Path(d.locate_file(f))
        if f.hash is None:
            continue
        if not path.is_file():
            bad.append(f"missing {f}")
            continue
        h = hashlib.new(f.hash.mode, path.read_bytes()).digest()
        if base64.urlsafe_b64encode(h).rstrip(b"=").decode() != f.hash.value:
            bad.append(f"changed {f}")
    direct = json.loads(d.read_text("direct_url.json") or "{}")
    return {
        "version": d.version,
        "files": files,
        "bad": bad,
        "entry_points": sorted([e.group, e.name, e.value] for e in d.entry_points),
        "editable": bool(direct.get("dir_info", {}).get("editable")),
        "site": str(Path(d.locate_file("")).resolve()),
    }


def state(upstream: str, ours: str, *flags: str) -> dict:
    out: dict = {"dists": {n: dist(n) for n in (upstream, ours)}}
    if "--metadata-only" in flags:
        return out
    out["groups"] = {}
    for group in ("vllm.general_plugins", "vllm.platform_plugins"):
        eps = {}
        for e in metadata.entry_points(group=group):
            try:
                e.load()  # resolves module:attr, does not call it
                eps[e.name] = [e.value, None]
            except Exception as exc:
                eps[e.name] = [e.value, repr(exc)]
        out["groups"][group] = eps
    return {**out, **imports()}


def imports() -> dict:
    """What ``import vllm_ascend`` gives, and where our modules come from."""
    out = {}
    try:
        import vllm_ascend

        out["package"] = {
            "file": getattr(vllm_ascend, "__file__", None),
            "path": [str(p) for p in vllm_ascend.__path__],
        }
    except Exception:
        out["package"] = {"error": traceback.format_exc()}
    try:
        import vllm_ascend.kv_offload.npu as npu
        from vllm_ascend.kv_offload import ops

        # Read first: ops loads the native library on first use.
        has_native_op = ops.HAS_NATIVE_OP
        native = sys.modules.get("vllm_ascend.kv_offload._C_kv_offload")
        out["ours"] = {
            "npu": npu.__file__,
            "spec": npu.NPUOffloadingSpec.__module__,
            "has_native_op": has_native_op,
            "backends": list(ops.native_backends()),
            "native": getattr(native, "__file__", None),
        }
    except Exception as exc:
        out["ours"] = {"error": traceback.format_exc(), "type": type(exc).__name__}
    out["modules"] = {
        name: getattr(mod, "__file__", None)
        for name, mod in sys.modules.items()
        if name == "vllm_ascend" or name.startswith("vllm_ascend.")
    }
    return out


def _missing_module(exc: BaseException | None) -> str | None:
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError):
            return exc.name
        exc = exc.__cause__ or exc.__context__
    return None


def plugins(*names: str) -> dict:
    eps = {e.name: e for e in metadata.entry_points(group="vllm.general_plugins")}
    out = {}
    for name in names:
        try:
            eps[name].load()()
            out[name] = None
        except Exception as exc:
            out[name] = {"error": repr(exc), "missing": _missing_module(exc)}
    return {"general": sorted(eps), "failures": out}


def merged(tree: str, *site_dirs: str) -> dict:
    """``imports`` from a grafted source ``tree`` first on ``sys.path``, with
    ``site_dirs`` (vllm, torch) appended; run with ``-S``."""
    sys.path[:0] = [tree]
    sys.path += site_dirs
    return imports()


def selection(order: str) -> dict:
    import vllm_ascend.distributed.kv_transfer as upstream
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_ascend.kv_offload import plugin

    for who in order.split(","):
        upstream.register_connector() if who == "upstream" else plugin.register()
    cls = KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
    try:
        fallback = plugin.fallback_connector_class()
        fallback = {"class": f"{fallback.__module__}.{fallback.__name__}"}
    except ModuleNotFoundError as exc:  # upstream's class imports torch_npu
        frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
        fallback = {"missing": exc.name, "frames": frames}
    return {"served_by": f"{cls.__module__}.{cls.__name__}", "fallback": fallback}


if __name__ == "__main__":
    commands = (state, plugins, merged, selection)
    command = {c.__name__: c for c in commands}
    print(json.dumps(command[sys.argv[1]](*sys.argv[2:])))
