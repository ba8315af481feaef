"""The model's identity in every pool key: what the model *is*, not where it lies.

Two engines share objects only when their KV for the same tokens is the same, i.e. the same
config and the same weights. The path string is no such identity: the same weights at two paths
(two hosts, two mount points) never shared, and new weights written over a path kept sharing.

``model_identity``:

* ``model_id`` set by the operator (``kv_connector_extra_config.model_id``): that string, as is.
  Engines with the same ``model_id`` share objects; the operator vouches that the weights match.
* a local directory (or single weights file): SHA-256 over ``config.json`` and every weights file's
  name, size and content. Content, not the safetensors headers: a fine-tune has the same headers
  and sizes as its base model, and sharing their KV would be wrong output. Measured here (one
  shared core, warm page cache): 0.77 s per GB with SHA-256 (BLAKE2b 1.29 s), 4 ms for the tiny
  test models. Each file's digest is cached on disk by (real path, size, mtime, inode) under
  ``$LW_POOL_CACHE_DIR`` (default ``~/.cache/lw-pool/model-digests``), so a host pays it once per
  weights file, not once per engine start or TP worker.
* a hub id vLLM downloaded itself: the content of the snapshot it downloaded (the hub's cache),
  so ``main`` at two commits never shares; when no snapshot is found locally, the name plus its
  revision (a warning says so: pin ``revision`` or set ``model_id``).

A directory whose weights have no known suffix (tensorizer, npz, sharded sub-folders) is identified
by every file in it, never by its path.

``engine_identity`` adds what the engine makes of those weights (see ``engine_identity.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "LW_POOL_CACHE_DIR"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Files that change the KV for the same token ids (the tokenizer does not: keys hash token ids).
CONFIG_FILES = ("config.json", "params.json")
_CHUNK = 8 << 20

_lock = threading.Lock()
_memo: dict[tuple, str] = {}


def _cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV)
    return Path(base) if base else Path.home() / ".cache" / "lw-pool" / "model-digests"


def _file_digest(path: Path) -> str:
    """SHA-256 of a file's content, cached in this process and on disk by (real path, size, mtime, inode)."""
    real = path.resolve()
    st = real.stat()
    ident = (str(real), st.st_size, st.st_mtime_ns, st.st_ino)
    with _lock:
        if ident in _memo:
            return _memo[ident]
    entry = _cache_dir() / hashlib.sha256(json.dumps(ident).encode()).hexdigest()
    try:
        cached = entry.read_text().strip()
        if len(cached) == 64:
            with _lock:
                _memo[ident] = cached
            return cached
    except OSError:
        pass
    t0 = time.perf_counter()
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    took = time.perf_counter() - t0
    if took > 1.0:
        log.info("lw-vllm: hashed %s (%.1f GB) for the model identity in %.1f s (cached in %s)",
                 real, st.st_size / 1e9, took, entry.parent)
    try:  # atomic: a concurrent TP worker writes the same digest
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False) as tmp:
            tmp.write(digest)
        os.replace(tmp.name, entry)
    except OSError as e:  # a read-only home only costs the hash again next start
        log.debug("lw-vllm: model digest cache not written (%s)", e)
    with _lock:
        _memo[ident] = digest
    return digest


def _weight_files(d: Path) -> list[Path]:
    """The weights files of a model directory: top-level files with a known weights suffix; when it
    has none (a format outside the list: tensorizer, npz, sharded sub-folders, ...), every regular
    file under it but hidden ones, so an unknown format is still identified by its content."""
    files = sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if files:
        return files
    return sorted(p for p in d.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(d).parts))


def files_identity(p: Path, config_names: tuple[str, ...]) -> str | None:
    """SHA-256 (hex) over ``p``'s config files (``config_names``) and every weights file's name,
    size and content; ``p`` a directory or one weights file. ``None`` when ``p`` is neither."""
    if p.is_file():
        files, configs = [p], []
    elif p.is_dir():
        configs = [p / n for n in config_names if (p / n).is_file()]
        files = [f for f in _weight_files(p) if f not in configs]
        if not files:
            return None
    else:
        return None
    h = hashlib.sha256(b"lw-pool/model-identity/v1\0")
    for c in configs:
        h.update(f"config:{c.name}\0".encode())
        h.update(c.read_bytes())
    for f in files:
        name = f.relative_to(p).as_posix() if p.is_dir() else f.name
        h.update(f"weights:{name}:{f.stat().st_size}:{_file_digest(f)}\0".encode())
    return h.hexdigest()


def local_identity(path: str) -> str | None:
    """SHA-256 (hex) of a local model's config and weights; ``None`` when ``path`` is no local model."""
    return files_identity(Path(path).expanduser(), CONFIG_FILES)


def hub_snapshot(model: str, revision: str | None) -> str | None:
    """The local snapshot directory vLLM downloaded ``model`` (a hub id) into, if there is one."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id=model, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, not downloaded, no huggingface_hub: no snapshot to identify
        return None


def model_identity(model: str, revision: str | None = None, model_id: str | None = None) -> str:
    """What the key's model fingerprint is made of (see the module's doc)."""
    if model_id:
        return f"id:{model_id}"
    local = local_identity(model)
    if local is not None:
        return f"content:{local}"
    snap = hub_snapshot(model, revision)
    local = local_identity(snap) if snap else None
    if local is not None:
        return f"content:{local}"
    return f"name:{model}@{revision or 'unpinned'}"
