"""What a request adds to its chunks' keys besides token ids: everything that changes the KV's bytes.

* ``prompt_embeds`` requests: vLLM sets those positions' token ids to 0, so the ids say nothing.
  Each chunk's rows of the embeddings (dtype, shape and bytes) are hashed with SHA-256 into that
  chunk's link of the chain (``lw_core.keys.chunk_hashes``' ``chunk_digests``); two prompts of equal
  length but other embeddings never share a chunk, and the same embeddings hit on any engine.
* LoRA: the adapter's identity, not its name. A local adapter directory is identified by the
  content of its config and weights files (``lw_vllm.identity.model_identity.files_identity``, the digests
  cached by file), so a name re-pointed at another adapter, or an adapter rewritten in place, never
  reuses the old adapter's KV, and two names of one adapter share it. An adapter vLLM fetches
  itself (not a local path) is identified by name and path, as vLLM's own block hashes do.
* ``cache_salt`` and multimodal hashes, as vLLM reports them.

The prompt's token ids come from ``all_token_ids`` (``prompt_token_ids`` is ``None`` for an
embeddings prompt).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from lw_core.keys import HashExtra
from lw_vllm.identity.model_identity import files_identity

# Files of a LoRA adapter that change the KV (its tokenizer does not: keys hash token ids).
ADAPTER_CONFIGS = ("adapter_config.json",)


def num_prompt_tokens(req: Any) -> int:
    n = getattr(req, "num_prompt_tokens", None)
    return int(n) if n is not None else len(req.prompt_token_ids or ())


def prompt_tokens(req: Any) -> list[int]:
    """The prompt's token ids as the KV was computed from them (0 where embeddings stand)."""
    ids = req.prompt_token_ids
    if ids is not None and getattr(req, "prompt_embeds", None) is None:
        return list(ids)
    return list(req.all_token_ids[: num_prompt_tokens(req)])


def lora_identity(lora: Any) -> str | None:
    """The adapter's identity for the key (see the module's doc); ``None`` without an adapter."""
    if lora is None:
        return None
    path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
    if path:
        local = files_identity(Path(path).expanduser(), ADAPTER_CONFIGS)
        if local is not None:
            return f"content:{local}"
    return f"name:{getattr(lora, 'lora_name', '')}@path:{path}"


def hash_extra(req: Any) -> HashExtra:
    mm = getattr(req, "mm_features", None) or ()
    return HashExtra(
        lora=lora_identity(getattr(req, "lora_request", None)),
        cache_salt=getattr(req, "cache_salt", None),
        mm_hashes=tuple(str(getattr(f, "identifier", f)) for f in mm),
    )


def _rows_digest(rows: Any) -> bytes:
    import torch

    t = rows.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}\0".encode())
    h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.digest()


def input_digests(req: Any, chunk_size: int) -> tuple[bytes, ...]:
    """Per chunk of the prompt (the trailing partial one included), a digest of its embedding
    rows; empty for a prompt of token ids only."""
    embeds = getattr(req, "prompt_embeds", None)
    if embeds is None:
        return ()
    n = int(embeds.shape[0])
    return tuple(_rows_digest(embeds[s : s + chunk_size]) for s in range(0, n, chunk_size))
