"""The engine's part of the model fingerprint: what turns the same weights into other KV bytes.

Beside the weights' identity (``model_identity``) the fingerprint holds:

* the model configuration as vLLM resolved it (``hf_config``, with ``--hf-overrides``, e.g. rope
  scaling, and ``--hf-config-path`` applied), without the fields that name a place or a library
  version (``_name_or_path``, ``transformers_version``, ...): SHA-256 of its sorted JSON;
* ``quantization`` (on-the-fly quantization changes the weights the KV is computed with) and
  ``load_format`` (``dummy`` weights are no checkpoint's);
* the revision asked for, when the weights were identified by name only.

``describe`` is the start-up line's account of what went in.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

from lw_vllm.identity.model_identity import model_identity

# Config fields that name where the config came from or which library wrote it, not the model.
_PLACE_FIELDS = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"})


class EngineIdentity(msgspec.Struct, frozen=True):
    weights: str  # model_identity(): id:..., content:<sha256>, or name:<model>@<revision>
    config: str  # SHA-256 of the resolved config (hex, 16 chars shown in logs)
    quantization: str | None
    load_format: str

    def parts(self) -> tuple[str, ...]:
        return (self.weights, self.config, f"quantization={self.quantization}", f"load_format={self.load_format}")

    def describe(self) -> str:
        w = self.weights
        kind, _, rest = w.partition(":")
        weights = f"{kind} {rest[:16]}" if kind == "content" else w
        return (f"weights {weights}, resolved config {self.config[:16]}, quantization {self.quantization}, "
                f"load_format {self.load_format}")


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()
                if str(k) not in _PLACE_FIELDS and not str(k).startswith("_attn_implementation")}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def config_digest(hf_config: Any) -> str:
    """SHA-256 of the resolved config's content (see the module's doc)."""
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    blob = json.dumps(_clean(d), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def engine_identity(vllm_config: Any, model_id: str | None) -> EngineIdentity:
    mc = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    quant = getattr(mc, "quantization", None)
    return EngineIdentity(
        weights=model_identity(str(mc.model), getattr(mc, "revision", None), model_id),
        config=config_digest(mc.hf_config),
        quantization=str(quant) if quant is not None else None,
        load_format=str(getattr(load_config, "load_format", "auto")),
    )
