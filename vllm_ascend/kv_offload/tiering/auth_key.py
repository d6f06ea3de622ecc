"""The fs tier's deployment key (``auth_key_file``): read once per process
from a small file, refused when it is not a key, and the id published for
it in ``identity.json`` (and, through the identity digest, the directory
name).

A key file is a secret, so a message about it names the setting and the
file and what is wrong, never the key. The published id is a salted scrypt
of the key: the directory name and ``identity.json`` are readable by
everyone who can list the shared directory, and the former id (an HMAC of a
constant) let them test a guess offline with one HMAC; scrypt at
``KEY_ID_SCRYPT`` costs 128 MiB and 0.4-0.7 s (this CPU machine) per guess,
and the salt (the rest of the identity) makes a table of guesses good for
one model and layout only. Deployments with different keys still get
different ids, so different directories: neither removes the other's files
as forgeries.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import stat
from collections import Counter
from typing import Any

from vllm_ascend.kv_offload.config import OffloadConfigError

# The tier key naming the file that holds the deployment key (never the key).
AUTH_KEY_FILE = "auth_key_file"
# A key, not a blob: a larger file is refused before it is read.
MAX_AUTH_KEY_FILE_BYTES = 4096
MIN_AUTH_KEY_BYTES = 16
# What a random key always has and a typed or patterned one rarely does:
# enough distinct byte values, and enough bits by the byte histogram's
# Shannon entropy times the length (`openssl rand -base64 32`: about 30
# values and 200 bits; 16 identical characters: 1 value, 0 bits).
MIN_DISTINCT_BYTES = 12
MIN_ESTIMATED_BITS = 128
# scrypt's cost for the published key id (OWASP's minimum for passwords).
KEY_ID_SCRYPT = {"n": 2**17, "r": 8, "p": 1, "dklen": 16}
_KEY_ID_SALT_PREFIX = b"vllm-ascend-kv-offload key id:"

FIX = (
    "Fix: a random key only the engine's user can read, the same file on "
    "every node: 'openssl rand -base64 32 > FILE; chmod 600 FILE'"
)


def read_auth_key(key_file: Any, setting: str) -> bytes:
    """The deployment key in ``key_file``; refuses a file that is missing,
    not a regular file, accessible to every user, larger than
    ``MAX_AUTH_KEY_FILE_BYTES``, or too short or too uniform to be a key.
    Read once per process (until the file changes). Messages name
    ``setting`` and the file, never the key."""
    if not isinstance(key_file, str) or not key_file:
        raise OffloadConfigError(
            f"{setting}={key_file!r} must be the path of a file holding the "
            f"deployment key (not the key itself). {FIX}"
        )
    where = f"{setting}={key_file!r}"
    try:
        st = os.stat(key_file)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file")
        if st.st_mode & 0o007:
            raise ValueError(
                f"is accessible to every user (mode {stat.S_IMODE(st.st_mode):#o}), "
                "so anyone here could forge block files"
            )
        if st.st_size > MAX_AUTH_KEY_FILE_BYTES:
            raise ValueError(
                f"holds {st.st_size} bytes; a key file holds at most "
                f"{MAX_AUTH_KEY_FILE_BYTES} (this is not a key)"
            )
        version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        return _load(key_file, version)
    except OSError as e:
        raise OffloadConfigError(f"{where} cannot be read ({e.strerror}). {FIX}") from e
    except ValueError as e:
        raise OffloadConfigError(f"{where} {e}. {FIX}") from e


@functools.lru_cache(maxsize=8)
def _load(path: str, version: tuple[int, ...]) -> bytes:
    """The key in ``path`` as of ``version`` (its stat), read at most
    ``MAX_AUTH_KEY_FILE_BYTES + 1`` bytes; ValueError says what is wrong
    with it (without the key). Cached: a refusal raises, so is not."""
    del version  # part of the cache key only: a changed file is read again
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:  # closes fd
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("is not a regular file")
        data = f.read(MAX_AUTH_KEY_FILE_BYTES + 1)
    if len(data) > MAX_AUTH_KEY_FILE_BYTES:
        raise ValueError(
            f"grew past {MAX_AUTH_KEY_FILE_BYTES} bytes while read (this is not a key)"
        )
    key = data.strip()
    _check_strength(key)
    return key


def _check_strength(key: bytes) -> None:
    if len(key) < MIN_AUTH_KEY_BYTES:
        raise ValueError(
            f"holds {len(key)} bytes; the key needs at least {MIN_AUTH_KEY_BYTES}"
        )
    counts = Counter(key)
    if len(counts) == 1:
        raise ValueError(
            f"holds one character repeated {len(key)} times, not a random key"
        )
    n = len(key)
    bits = -n * sum(c / n * math.log2(c / n) for c in counts.values())
    if len(counts) < MIN_DISTINCT_BYTES or bits < MIN_ESTIMATED_BITS:
        raise ValueError(
            f"has too little entropy for a key: {len(counts)} distinct byte "
            f"values, about {bits:.0f} bits by their frequencies (a key needs "
            f"at least {MIN_DISTINCT_BYTES} values and {MIN_ESTIMATED_BITS} bits)"
        )


@functools.lru_cache(maxsize=8)
def key_id(auth_key: bytes, salt: str) -> dict[str, Any]:
    """The published id of ``auth_key``: scrypt at ``KEY_ID_SCRYPT`` salted
    with ``salt`` (the digest of the identity it joins), with its
    parameters, so that anyone can recompute it from the key and no one can
    check a guess cheaply. Computed once per process per key and salt."""
    value = hashlib.scrypt(
        auth_key,
        salt=_KEY_ID_SALT_PREFIX + salt.encode(),
        maxmem=2 * 128 * KEY_ID_SCRYPT["r"] * KEY_ID_SCRYPT["n"],
        **KEY_ID_SCRYPT,
    )
    return {"kdf": "scrypt", **KEY_ID_SCRYPT, "salt": salt, "value": value.hex()}
