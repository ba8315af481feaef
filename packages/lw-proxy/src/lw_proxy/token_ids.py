"""Token ids for resuming: the proxy asks decoders for them, and hides them from clients that did not.

A choice the decoder ends with ``stop_reason == "recomputed"`` is resumed from the tokens it already
generated (``lw_proxy.recompute``). Exactly those tokens, not their text: text re-tokenized after the
prompt can split differently (``" w5"`` as one token or three), and the engine would then continue a
different sequence than a single engine does. vLLM returns them when a request says
``return_token_ids: true``: ``prompt_token_ids`` (completions: in each choice's first event; chat: at
the top of the first event) and ``token_ids`` (each event's new tokens); without it both keys are
still there, as ``null``. So the proxy sets ``return_token_ids: true`` on every decoder request
(``asks``) and, when the client did not ask for them itself, turns those lists back into ``null`` on
the way out (``strip``), which gives the client the bytes a single engine would have sent.

Not with ``echo``: vLLM then drops the echoed prompt text in favour of the ids, which would change
the answer; such requests resume by text, as before. A client's own ``return_token_ids`` counts when
it is JSON ``true`` (or 1); any other value is replaced by ``true`` and the ids are stripped.

``strip`` works on the bytes: ``"token_ids":[`` can only be an object key there (inside a JSON
string every quote is escaped), and the lists hold integers only.
"""

from __future__ import annotations

import re
from typing import Any

_IDS = re.compile(rb'"(prompt_token_ids|token_ids)"(\s*):(\s*)\[[^\]]*\]')


def client_asked(body: dict[str, Any]) -> bool:
    v = body.get("return_token_ids")
    return v is True or (type(v) is int and v == 1)


def asks(body: dict[str, Any]) -> bool:
    """The proxy adds ``return_token_ids: true`` to this request's decoder calls (and strips the ids)."""
    return not client_asked(body) and not body.get("echo")


def strip(data: bytes) -> bytes:
    """``data`` (SSE events or a JSON answer) with every ``prompt_token_ids``/``token_ids`` list
    replaced by ``null``."""
    if b"token_ids" not in data:
        return data
    return _IDS.sub(rb'"\1"\2:\3null', data)


def strip_choice(ch: dict[str, Any]) -> None:
    for k in ("prompt_token_ids", "token_ids"):
        if ch.get(k) is not None:
            ch[k] = None
