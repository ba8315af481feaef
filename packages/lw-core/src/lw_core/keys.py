"""Chunk hashes and pool object keys.

Hashes are chained over token ids with a fixed algorithm (BLAKE2b-128) and a fixed root, so two
processes or machines compute the same keys without ``PYTHONHASHSEED`` (vLLM's own block hashes
depend on it). Everything that changes the KV for the same tokens -- the LoRA adapter's identity
(its content, not its name), ``cache_salt`` (tenant isolation), multimodal hashes -- goes into every
link of the chain, so two tenants never share an object. Inputs that are not token ids at all
(``prompt_embeds``: vLLM sets those positions' ids to 0) enter per chunk as a digest of the chunk's
own input bytes (``chunk_digests``), so two prompts of equal length but other embeddings never
share a chunk.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

import msgspec

KEY_VERSION = "lw1"
_ROOT = hashlib.blake2b(b"lw-kv-pool/chunk-hash/v1", digest_size=16).digest()


class HashExtra(msgspec.Struct, frozen=True, array_like=True):
    """What besides token ids determines a chunk's KV."""

    lora: str | None = None  # the adapter's identity (content digest, else name + path), never its name alone
    cache_salt: str | None = None
    mm_hashes: tuple[str, ...] = ()


_NO_EXTRA = HashExtra()
_encoder = msgspec.msgpack.Encoder()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)  # int64: any vocab size; fixed little-endian below for cross-machine keys
    if a.itemsize != 8:  # pragma: no cover - every supported platform has 8-byte long long
        raise RuntimeError("array('q') is not 64-bit here")

    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def chunk_hashes(tokens: Sequence[int], chunk_size: int, extra: HashExtra | None = None,
                 chunk_digests: Sequence[bytes] = ()) -> list[bytes]:
    """Chained hashes of every *full* chunk of ``tokens`` (a trailing partial chunk is not hashed).
    ``chunk_digests[i]``: a digest of chunk ``i``'s inputs that are not token ids (prompt
    embeddings); chunks past its end (generated tokens) have none."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    extra_b = _encoder.encode(extra or _NO_EXTRA)
    out: list[bytes] = []
    prev = _ROOT
    for i, start in enumerate(range(0, len(tokens) - chunk_size + 1, chunk_size)):
        h = hashlib.blake2b(digest_size=16)
        h.update(prev)
        h.update(extra_b)
        h.update(_token_bytes(tokens[start : start + chunk_size]))
        if i < len(chunk_digests):
            h.update(b"inputs:" + chunk_digests[i])
        prev = h.digest()
        out.append(prev)
    return out


def partial_chunk_hash(tokens: Sequence[int], chunk_size: int, request_id: str, extra: HashExtra | None = None,
                       full_hashes: Sequence[bytes] | None = None, chunk_digests: Sequence[bytes] = ()) -> bytes | None:
    """Hash for the trailing partial chunk, scoped to one request so no other lookup can match it.
    ``full_hashes``: ``chunk_hashes(tokens, chunk_size, extra, chunk_digests)`` when the caller has
    them already; ``chunk_digests`` as there, the partial chunk's own (if any) at index ``n_full``."""
    n_full = len(tokens) // chunk_size
    tail = tokens[n_full * chunk_size :]
    if not tail:
        return None
    if full_hashes is None or len(full_hashes) < n_full:
        full_hashes = chunk_hashes(tokens[: n_full * chunk_size], chunk_size, extra, chunk_digests)
    prev = full_hashes[n_full - 1] if n_full else _ROOT
    h = hashlib.blake2b(digest_size=16)
    h.update(prev)
    h.update(b"partial:" + request_id.encode())
    h.update(_encoder.encode(extra or _NO_EXTRA))
    h.update(_token_bytes(tail))
    if n_full < len(chunk_digests):
        h.update(b"inputs:" + chunk_digests[n_full])
    return h.digest()


def fingerprint(*parts: object) -> str:
    """Short stable fingerprint of model or layout facts (12 hex chars)."""
    return hashlib.blake2b(_encoder.encode([str(p) for p in parts]), digest_size=6).hexdigest()


class KeySpace(msgspec.Struct, frozen=True):
    """Names objects: ``lw1/{model_fp}/{layout_fp}/{rank_tag}/{chunk_hash_hex}``.

    ``model_fp`` covers model name and dtype; ``layout_fp`` block size, per-layer bytes, layer
    count and kv dtype: engines whose KV bytes differ can never read each other's objects.
    ``rank_tag`` names the slice of KV a worker holds ("all" for MLA, whose KV is the same on every
    TP rank; e.g. "tp0of2-pp0of1" otherwise).
    """

    model_fp: str
    layout_fp: str

    def key(self, rank_tag: str, chunk_hash: bytes) -> str:
        return f"{KEY_VERSION}/{self.model_fp}/{self.layout_fp}/{rank_tag}/{chunk_hash.hex()}"

    def keys(self, rank_tag: str, hashes: Sequence[bytes]) -> list[str]:
        prefix = f"{KEY_VERSION}/{self.model_fp}/{self.layout_fp}/{rank_tag}/"
        return [prefix + h.hex() for h in hashes]

    @classmethod
    def for_model(
        cls,
        *,
        model: str,
        dtype: str,
        block_size: int,
        layer_block_bytes: Sequence[int],
        kv_dtype: str,
        extra: Sequence[object] = (),
    ) -> KeySpace:
        return cls(
            model_fp=fingerprint(model, dtype),
            layout_fp=fingerprint(block_size, tuple(layer_block_bytes), len(layer_block_bytes), kv_dtype, *extra),
        )


def rank_tag(*, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, mla: bool = False) -> str:
    """Which KV slice a worker holds. MLA's latent KV is identical across TP ranks: one tag for all."""
    tp = "tpall" if mla else f"tp{tp_rank}of{tp_size}"
    return f"{tp}-pp{pp_rank}of{pp_size}"
