"""A checkpoint's manifest: every file's size and sha256, written last before the rename, verified on load.

It catches what a complete-looking directory can still hide: a truncated shard, bytes overwritten on disk, a file
deleted afterwards. Hashing runs on a thread pool (hashlib releases the GIL), so large checkpoints verify at disk
speed rather than one core's.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class CorruptCheckpoint(Exception):
    """A checkpoint whose files do not match its manifest (or that cannot be read at all)."""


def file_sha256(path: str) -> str:
    """A file's sha256, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def _files(root: str):
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST:
                yield rel


def _hash_all(root: str, rels) -> Dict[str, str]:
    rels = sorted(rels)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as pool:
        return dict(zip(rels, pool.map(lambda r: file_sha256(os.path.join(root, r)), rels)))


def write_manifest(ckpt_dir: str, run_id: str, config_hash: str) -> None:
    """Record every file of `ckpt_dir` (call when all its other files are written)."""
    rels = list(_files(ckpt_dir))
    hashes = _hash_all(ckpt_dir, rels)
    files = {rel: {"size": os.path.getsize(os.path.join(ckpt_dir, rel)), "sha256": hashes[rel]} for rel in rels}
    tmp = os.path.join(ckpt_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"run_id": run_id, "config_hash": config_hash, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, MANIFEST))


def has_manifest(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, MANIFEST))


def verify(ckpt_dir: str) -> None:
    """Raise CorruptCheckpoint naming the first bad file: missing, of another size, or of another checksum."""
    try:
        with open(os.path.join(ckpt_dir, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable ({type(e).__name__})") from None
    for rel, info in sorted(files.items()):
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path):
            raise CorruptCheckpoint(f"{rel} is missing")
        size = os.path.getsize(path)
        if size != info["size"]:
            raise CorruptCheckpoint(f"{rel} has {size} bytes, the manifest says {info['size']} "
                                    "(truncated or rewritten)")
    hashes = _hash_all(ckpt_dir, files)
    for rel, info in sorted(files.items()):
        if hashes[rel] != info["sha256"]:
            raise CorruptCheckpoint(f"{rel} does not match its checksum (its bytes changed on disk)")
