"""vLLM plugin entry point (group ``vllm.general_plugins``): runs in every vLLM process.

Registers ``LayerwiseStoreConnector`` with vLLM's ``KVConnectorFactory`` (idempotent: a second
call, or another package that registered the same name, is fine), the seed's name
``AscendStoreConnector`` as an alias only when nothing else registered it (vllm-ascend does, and
then its connector wins), and applies the CPU RoPE fix for MLA models (see ``rope_fix``) and the
CPU fix for seeded requests with chunked prefills (see ``seed_fix``) and the CPU fix for Mamba2
prefills with prefix caching (see ``mamba2_fix``), and sets the generator of a seeded request that
continues an answered prefill one draw ahead, as a single engine's is (see
``pd.seeded_continuation``).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

CONNECTOR_NAME = "LayerwiseStoreConnector"
ALIAS_NAME = "AscendStoreConnector"
MODULE = "lw_vllm.connector"


def _register(factory: Any, name: str) -> bool:
    registry = getattr(factory, "_registry", None)
    if registry is not None and name in registry:
        return False
    try:
        factory.register_connector(name, MODULE, CONNECTOR_NAME)
    except ValueError:  # registered between our check and the call (or no _registry attribute)
        return False
    return True


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _register(KVConnectorFactory, CONNECTOR_NAME)
    if _register(KVConnectorFactory, ALIAS_NAME):
        log.debug("lw-vllm: %s is an alias of %s", ALIAS_NAME, CONNECTOR_NAME)

    from lw_vllm.cpu_fixes import mamba2_fix, rope_fix, seed_fix

    rope_fix.apply()
    seed_fix.apply()
    mamba2_fix.apply()

    from lw_vllm.pd import seeded_continuation

    seeded_continuation.apply()
