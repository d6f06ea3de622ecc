"""The fs tier's deployment key (``auth_key_file``): a file that is not a key
is refused before anything starts, naming the setting and the file but never
the key; the key is read once per process; what is published about it
(identity.json, the directory name) takes a slow scrypt per guess to check."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess

import pytest

from tests.unit.tier_helpers import AUTH_KEY, fs_tier, key_file, refusal
from vllm_ascend.kv_offload.config import OffloadConfigError
from vllm_ascend.kv_offload.tiering.auth_key import read_auth_key
from vllm_ascend.kv_offload.tiering.fs import tier_dir_usable
from vllm_ascend.kv_offload.tiering.identity import IDENTITY_FILE
from vllm_ascend.kv_offload.tiering.spec import check_tiering_config

SETTING = "['auth_key_file']"
AT_MOST_4_KIB = "bytes; a key file holds at most 4096"


def refused(tmp_path, path: str) -> str:
    """The message of the config check refusing key file ``path``."""
    tiers = [{"type": "fs", "root_dir": str(tmp_path), "auth_key_file": path}]
    return refusal(lambda: check_tiering_config({"secondary_tiers": tiers}))


# What the file holds (bytes; a size: that many NUL bytes, sparse; None:
# no file; "dir": a directory), its mode, what the refusal says is wrong.
NOT_A_KEY = {
    "world-readable": (AUTH_KEY, 0o644, "accessible to every user"),
    "missing": (None, 0o600, "cannot be read"),
    "directory": ("dir", 0o700, "not a regular file"),
    "short": (b"short", 0o600, "at least 16"),
    "one-character": (b"a" * 16, 0o600, "one character repeated 16 times"),
    "nul-bytes": (b"\0" * 4000, 0o600, "one character repeated 4000 times"),
    "two-values": (b"ab" * 2000, 0o600, "2 distinct byte values"),
    "digits": (b"0123456789" * 40, 0o600, "10 distinct byte values"),
    # 32 hex digits are at most 128 bits; their frequencies say fewer.
    "short-hex": (b"3f9c0e1ab27d4c58e6f1a0b9c3d72e4f", 0o600, "too little entropy"),
    # Over 4 KiB: refused by its size, never opened (a blob, even 2 GiB).
    **{
        f"{n}-bytes": (n, 0o600, f"holds {n} {AT_MOST_4_KIB}")
        for n in (4097, 64 << 10, 2 << 30)
    },
}


@pytest.mark.parametrize("data, mode, wrong", NOT_A_KEY.values(), ids=NOT_A_KEY)
def test_a_file_that_is_not_a_key_is_refused_naming_the_setting_and_the_fix(
    tmp_path, opened_paths, data, mode, wrong
):
    """Missing, not a regular file, readable by everyone, too large, too short
    or too uniform: refused naming the setting, the file and the fix, never
    the key."""
    path = str(tmp_path / "kv.key")
    if data == "dir":
        os.mkdir(path, mode)
    elif isinstance(data, int):
        os.truncate(key_file(tmp_path, b"", mode=mode), data)  # NUL bytes, no disk
    elif data is not None:
        path = key_file(tmp_path, data + b"\n", mode=mode)
    opened_paths.clear()
    message = refused(tmp_path, path)
    assert wrong in message
    assert SETTING in message and repr(path) in message
    assert "openssl rand -base64 32 > FILE; chmod 600 FILE" in message
    if isinstance(data, bytes):
        assert data.decode(errors="replace") not in message
    if isinstance(data, int):
        assert path not in opened_paths  # stat, then refused: never opened


def test_a_random_key_made_as_the_docs_say_is_accepted_and_read_again_if_changed(
    tmp_path,
):
    path = tmp_path / "kv.key"
    subprocess.run(
        f"openssl rand -base64 32 > {path}; chmod 600 {path}", shell=True, check=True
    )
    key = read_auth_key(str(path), "setting")
    assert key == path.read_bytes().strip() and len(key) == 44
    # The same file changed: read again.
    assert read_auth_key(key_file(tmp_path), "setting") == AUTH_KEY
    other = base64.b64encode(bytes(range(7, 71)))
    key_file(tmp_path, other)
    assert read_auth_key(str(path), "setting") == other


@pytest.mark.parametrize(
    "make, accepted",
    [
        (lambda: base64.b64encode(os.urandom(32)), True),  # openssl rand -base64 32
        (lambda: os.urandom(32).hex().encode(), True),  # openssl rand -hex 32
        (lambda: os.urandom(16).hex().encode(), False),  # openssl rand -hex 16
        (lambda: base64.b64encode(os.urandom(16)), False),  # openssl rand -base64 16
    ],
    ids=["base64-32", "hex-32", "hex-16", "base64-16"],
)
def test_random_keys_of_one_generator_are_all_accepted_or_all_refused(
    tmp_path, make, accepted
):
    # As docs/tiering.md says: never a random refusal of a good generator.
    outcomes = set()
    for i in range(200):
        path = key_file(tmp_path, make() + b"\n", name=f"{i}.key")
        try:
            read_auth_key(path, "setting")
            outcomes.add(True)
        except OffloadConfigError:
            outcomes.add(False)
    assert outcomes == {accepted}


def test_the_key_is_read_once_per_process(tmp_path, fs_tier_spec, opened_paths):
    path = key_file(tmp_path, AUTH_KEY, name="once.key")
    root = str(tmp_path / "kv")
    tier = {"type": "fs", "root_dir": root, "auth_key_file": path}
    opened_paths.clear()
    # What a scheduler does with it at start: the config check, the tier
    # directory, the tier.
    check_tiering_config({"secondary_tiers": [tier]})
    spec = fs_tier_spec()
    assert tier_dir_usable(tier, spec)
    fs_tier(spec, root, auth_key_file=path).shutdown()
    assert opened_paths.count(path) == 1


def published_identity(tmp_path, spec, key: bytes | None) -> tuple[str, dict]:
    """(directory name, identity.json) of a tier keyed with ``key``."""
    root = tmp_path / hashlib.sha256(key or b"").hexdigest()[:8]
    tier = {"root_dir": str(root)}
    if key is not None:
        tier["auth_key_file"] = key_file(tmp_path, key, name=f"{root.name}.key")
    assert tier_dir_usable(tier, spec)
    (name,) = [p for p in os.listdir(root) if p.startswith("ascend-kv-")]
    return name, json.loads((root / name / IDENTITY_FILE).read_text())


def test_identity_json_holds_no_key_id_a_guess_can_check_cheaply(
    tmp_path, fs_tier_spec
):
    spec = fs_tier_spec()
    plain_name, plain = published_identity(tmp_path, spec, None)
    name, keyed = published_identity(tmp_path, spec, AUTH_KEY)
    other_key = base64.b64encode(bytes(range(100, 132)))
    other_name, other = published_identity(tmp_path, spec, other_key)
    # The key id is the only key-derived value, and it differs by key, so
    # keyed tiers and deployments with different keys use their own
    # directories.
    for published in (keyed, other):
        assert {k: v for k, v in published.items() if k != "auth_key_id"} == plain
    assert keyed["auth_key_id"]["value"] != other["auth_key_id"]["value"]
    assert len({plain_name, name, other_name}) == 3
    # Checking a guess means a scrypt of at least OWASP's cost (128 MiB,
    # N=2^17, r=8), salted with this identity's digest: no table of
    # guesses made for one model and layout serves another.
    kid = keyed["auth_key_id"]
    assert kid["kdf"] == "scrypt" and kid["n"] >= 2**17 and kid["r"] >= 8
    plain_text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
    assert kid["salt"] == hashlib.sha256(plain_text.encode()).hexdigest()
    guess = hashlib.scrypt(
        AUTH_KEY,
        salt=b"vllm-ascend-kv-offload key id:" + kid["salt"].encode(),
        n=kid["n"], r=kid["r"], p=kid["p"], dklen=kid["dklen"],
        maxmem=2 * 128 * kid["r"] * kid["n"],
    )  # fmt: skip
    assert guess.hex() == kid["value"]
