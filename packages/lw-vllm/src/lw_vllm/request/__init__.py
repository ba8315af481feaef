"""One request as the connector sees it: what it adds to its chunks' keys besides token ids
(``request_keys``: prompt embeddings, LoRA, cache salt, multimodal hashes) and its scheduler-side
state (``request_state``: ``ReqState``, the remote-prefill phase and the metaserver's ``Outcome``).

Below ``hybrid`` and ``pd``, which both read a ``ReqState``. May import: ``identity`` only.
"""
