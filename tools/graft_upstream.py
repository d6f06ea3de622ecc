#!/usr/bin/env python3
"""Overlay this subtree onto an unpacked upstream vllm-ascend source tree.

    python tools/graft_upstream.py UPSTREAM_DIR [--dry-run]

UPSTREAM_DIR: an upstream vllm-ascend (>= 0.30) source tree, e.g. the
unpacked 0.30.0rc2 sdist or a git checkout. Copies ``vllm_ascend/kv_offload``
and ``csrc/kv_offload`` (OWNED_DIRS; no built files, no ``module.cpp``) and
patches exactly MODIFIED_FILES; docs/upstream_graft.md says what goes where.
Every anchor is looked up and every file computed before anything is
written: an unknown upstream (a missing anchor), one with files of its own
under our directories (< 0.30), or a tree grafted from another version of
this repo is refused with status 1 and left untouched. A second run is a
no-op.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Upstream files the graft modifies (docs/upstream_graft.md lists the same).
MODIFIED_FILES = ("CMakeLists.txt", "csrc/torch_binding.cpp", "setup.py")
# Directories the graft adds; upstream >= 0.30 has neither.
OWNED_DIRS = ("vllm_ascend/kv_offload", "csrc/kv_offload")
# Left out of csrc/kv_offload: the standalone build's pybind module (upstream's
# library is the module).
CSRC_EXCLUDED = ("module.cpp",)
_SKIP_SUFFIXES = (".so", ".pyd", ".dylib", ".pyc", ".pyo", ".o")

REGISTER_FN = "register_kv_offload_ops"
REGISTER_CALL = f"    vllm_ascend::{REGISTER_FN}(ops);\n"
REGISTER_DECL = (
    "// KV-cache CPU offloading (csrc/kv_offload/dispatch.cpp): adds the\n"
    "// kv_offload_* ops to the _C_ascend blocks below.\n"
    "namespace vllm_ascend {\n"
    f"void {REGISTER_FN}(torch::Library& m);\n"
    "}  // namespace vllm_ascend\n"
)
# torch_binding.cpp: the declaration goes at file scope after the last close of
# namespace vllm_ascend before the blocks (torch/library.h is included above) ...
DECL_ANCHOR = re.compile(
    r"^\}[ \t]*//[ \t]*namespace vllm_ascend[ \t]*\n", re.MULTILINE
)
# ... and the call opens both blocks (310P and the other SoCs).
BLOCK_ANCHOR = re.compile(
    r"^TORCH_LIBRARY_EXPAND\(CONCAT\(_C, _ascend\), ops\)[ \t]*\n\{[ \t]*\n",
    re.MULTILINE,
)
BLOCK_COUNT = 2
# CMakeLists.txt: our sources are added right after the library is declared.
CMAKE_ANCHOR = "pybind11_add_module(vllm_ascend_C ${VLLM_ASCEND_SRC})\n"
CMAKE_MARKER = "VLLM_ASCEND_KV_OFFLOAD_SRC"
# setup.py: the general-plugins list of setup(entry_points=...).
SETUP_ANCHOR = re.compile(
    r'(?P<head>"vllm\.general_plugins":\s*\[\n)(?P<body>(?:[ \t]*"[^"\n]*",?[ \t]*\n)+)'
    r"(?P<tail>[ \t]*\])"
)


class GraftError(RuntimeError):
    """The tree cannot be grafted as it is; nothing was written."""


def _is_build_or_hidden(rel: Path) -> bool:
    return (
        any(part.startswith(".") or part == "__pycache__" for part in rel.parts)
        or rel.name.endswith(_SKIP_SUFFIXES)
        or any(part.endswith(".egg-info") for part in rel.parts)
    )


def overlay_files(src_root: Path = ROOT) -> dict[str, Path]:
    """Our files to copy: upstream-relative path -> source file."""
    files: dict[str, Path] = {}
    for owned in OWNED_DIRS:
        base = src_root / owned
        if not base.is_dir():
            raise GraftError(f"{base} is missing: run this from a checkout of the repo")
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(base)
            if not path.is_file() or _is_build_or_hidden(rel):
                continue
            if owned == "csrc/kv_offload" and rel.as_posix().startswith(CSRC_EXCLUDED):
                continue
            files[f"{owned}/{rel.as_posix()}"] = path
    return files


def native_sources(files: dict[str, Path]) -> list[str]:
    """The .cpp files of the overlay that join upstream's library, in build order."""
    srcs = [p for p in files if p.startswith("csrc/kv_offload/") and p.endswith(".cpp")]
    first = "csrc/kv_offload/dispatch.cpp"
    if first not in srcs:
        raise GraftError(f"{first} is missing from this checkout")
    return sorted(srcs, key=lambda p: (p != first, p))


def our_entry_point(src_root: Path = ROOT) -> str:
    """``name = module:function`` of our vllm.general_plugins entry point."""
    with open(src_root / "pyproject.toml", "rb") as f:
        eps = tomllib.load(f)["project"].get("entry-points", {})
    entries = [f"{n} = {v}" for n, v in eps.get("vllm.general_plugins", {}).items()]
    if len(entries) != 1:
        raise GraftError(
            "pyproject.toml: expected exactly one vllm.general_plugins entry point, "
            f"found {entries}"
        )
    return entries[0]


# --------------------------------------------------------------------------
# patches: each returns the new text, the same text when already applied, or
# raises GraftError naming the missing anchor.


def patch_torch_binding(text: str) -> str:
    where = "csrc/torch_binding.cpp"
    blocks = list(BLOCK_ANCHOR.finditer(text))
    calls = text.count(f"vllm_ascend::{REGISTER_FN}(ops);")
    if REGISTER_FN in text:
        # Applied before: accept only exactly what this script writes.
        ok = (
            text.count(REGISTER_DECL) == 1
            and calls == BLOCK_COUNT
            and len(blocks) == BLOCK_COUNT
            and all(text.startswith(REGISTER_CALL, b.end()) for b in blocks)
        )
        if not ok:
            raise GraftError(
                f"{where} mentions {REGISTER_FN} but not as this script writes it; "
                "start from a fresh upstream tree"
            )
        return text
    if len(blocks) != BLOCK_COUNT:
        raise GraftError(
            f"{where}: anchor 'TORCH_LIBRARY_EXPAND(CONCAT(_C, _ascend), ops)' "
            f"followed by '{{' on its own line found {len(blocks)} times, expected "
            f"{BLOCK_COUNT} (the ASCEND_PLATFORM_310P block and the other one)"
        )
    closes = [m for m in DECL_ANCHOR.finditer(text) if m.end() <= blocks[0].start()]
    if not closes:
        raise GraftError(
            f"{where}: anchor '}} // namespace vllm_ascend' not found before the "
            "first TORCH_LIBRARY_EXPAND block"
        )
    for block in reversed(blocks):  # back to front: offsets stay valid
        text = text[: block.end()] + REGISTER_CALL + text[block.end() :]
    at = closes[-1].end()
    return text[:at] + "\n" + REGISTER_DECL + text[at:]


def patch_cmake(text: str, sources: list[str]) -> str:
    src_lines = "".join(f"  ${{CMAKE_CURRENT_SOURCE_DIR}}/{s}\n" for s in sources)
    block = (
        "\n"
        "# KV-cache CPU offloading (vllm_ascend/kv_offload, csrc/kv_offload): its\n"
        "# ops join this library; csrc/torch_binding.cpp registers them in the\n"
        "# _C_ascend block. The defines select the grafted build (no\n"
        "# registration block of its own) and the npu backend.\n"
        f"set({CMAKE_MARKER}\n"
        f"{src_lines}"
        ")\n"
        f"target_sources(vllm_ascend_C PRIVATE ${{{CMAKE_MARKER}}})\n"
        f"set_source_files_properties(${{{CMAKE_MARKER}}} PROPERTIES\n"
        '  COMPILE_DEFINITIONS "VLLM_ASCEND_KV_OFFLOAD_GRAFTED;VLLM_ASCEND_WITH_NPU"\n'
        '  INCLUDE_DIRECTORIES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/kv_offload")\n'
        "\n"
    )
    if CMAKE_MARKER in text:
        if text.count(CMAKE_ANCHOR + block) != 1:
            raise GraftError(
                f"CMakeLists.txt already mentions {CMAKE_MARKER} but not with this "
                "checkout's sources (grafted from another version?); start from a "
                "fresh upstream tree"
            )
        return text
    if text.count(CMAKE_ANCHOR) != 1:
        raise GraftError(
            f"CMakeLists.txt: anchor {CMAKE_ANCHOR.strip()!r} found "
            f"{text.count(CMAKE_ANCHOR)} times, expected once"
        )
    at = text.index(CMAKE_ANCHOR) + len(CMAKE_ANCHOR)
    return text[:at] + block + text[at:]


def patch_setup(text: str, entry_point: str) -> str:
    matches = list(SETUP_ANCHOR.finditer(text))
    if len(matches) != 1:
        raise GraftError(
            "setup.py: anchor '\"vllm.general_plugins\": [' followed by one quoted "
            f"entry per line found {len(matches)} times, expected once"
        )
    m = matches[0]
    quoted = f'"{entry_point}"'
    body_lines = m["body"].splitlines(keepends=True)
    if any(line.strip().rstrip(",") == quoted for line in body_lines):
        return text
    name = entry_point.split("=", 1)[0].strip()
    if re.search(rf'"{re.escape(name)}\s*=', m["body"]):
        raise GraftError(
            f"setup.py: a vllm.general_plugins entry named {name!r} exists with "
            "another target; start from a fresh upstream tree"
        )
    last = body_lines[-1]
    indent = last[: len(last) - len(last.lstrip())]
    if not last.rstrip().endswith(","):
        body_lines[-1] = last.rstrip() + ",\n"
    body = "".join(body_lines) + f"{indent}{quoted},\n"
    return text[: m.start("body")] + body + text[m.end("body") :]


# --------------------------------------------------------------------------


def plan_graft(upstream: Path, src_root: Path = ROOT) -> dict[str, bytes]:
    """Every file the grafted tree has that is ours or patched (path relative
    to the upstream root -> contents); raises GraftError, writing nothing."""
    for marker in ("setup.py", *MODIFIED_FILES, "vllm_ascend/__init__.py"):
        if not (upstream / marker).is_file():
            raise GraftError(
                f"{upstream} does not look like an upstream vllm-ascend source tree "
                f"({marker} is missing)"
            )
    files = overlay_files(src_root)
    # Files already under our directories must be ours (a re-run), not
    # upstream's: vllm-ascend < 0.30 ships vllm_ascend/kv_offload/.
    for owned in OWNED_DIRS:
        base = upstream / owned
        rels = [p.relative_to(base) for p in base.rglob("*") if p.is_file()]
        foreign = sorted(
            f"{owned}/{r.as_posix()}"
            for r in rels
            if not _is_build_or_hidden(r) and f"{owned}/{r.as_posix()}" not in files
        )
        if foreign:
            raise GraftError(
                f"{upstream} already has files under {owned}/ that this checkout does "
                f"not provide: {', '.join(foreign[:5])}"
                + (" ..." if len(foreign) > 5 else "")
                + ". vllm-ascend < 0.30 ships its own vllm_ascend/kv_offload/ (graft "
                "onto >= 0.30); a tree grafted from another version of this repo "
                "needs a fresh upstream tree"
            )
    wanted = {rel: src.read_bytes() for rel, src in files.items()}
    entry_point = our_entry_point(src_root)
    sources = native_sources(files)
    patchers = {
        "csrc/torch_binding.cpp": patch_torch_binding,
        "CMakeLists.txt": lambda t: patch_cmake(t, sources),
        "setup.py": lambda t: patch_setup(t, entry_point),
    }
    assert set(patchers) == set(MODIFIED_FILES)
    for rel, patch in patchers.items():
        original = (upstream / rel).read_text(encoding="utf-8")
        wanted[rel] = patch(original).encode("utf-8")
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream", type=Path, help="upstream vllm-ascend source tree")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would change, write nothing"
    )
    args = parser.parse_args(argv)
    upstream = args.upstream.resolve()
    try:
        wanted = plan_graft(upstream)
    except GraftError as e:
        print(f"graft_upstream: refusing: {e}", file=sys.stderr)
        return 1
    writes = {
        rel: data
        for rel, data in wanted.items()
        if not ((upstream / rel).is_file() and (upstream / rel).read_bytes() == data)
    }
    if not writes:
        print(f"graft_upstream: {upstream} is already grafted; nothing to do")
        return 0
    for rel in sorted(writes):
        exists = (upstream / rel).exists()
        kind = "patch" if rel in MODIFIED_FILES else "update" if exists else "add"
        print(f"{'would ' if args.dry_run else ''}{kind:6s} {rel}")
    if not args.dry_run:
        for rel, data in writes.items():
            target = upstream / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".graft-tmp")
            tmp.write_bytes(data)
            if target.exists():
                tmp.chmod(target.stat().st_mode & 0o7777)
            tmp.replace(target)
        print(
            f"graft_upstream: {len(writes)} files written, "
            f"{len(wanted) - len(writes)} already up to date"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
