"""``PutSessions``: Mooncake's put sessions (reserve an object on the master, fill it with ranged
puts, then make it readable), each call under the client's deadline.

What the installed client does (measured, docs/guide/mooncake.md "Put sessions"):

* ``start``: the master allocates the object; ``batch_is_exist`` and gets do not see it. Status per
  key: 0; OBJECT_ALREADY_EXISTS (-705) when the key is stored or in another client's session
  (until ``--put_start_discard_timeout_sec``, 30 s); INVALID_PARAMS (-600) when this client has a
  session of the key already, or for 0 bytes; NO_AVAILABLE_HANDLE (-200) when it does not fit.
* ``ranges``: ``batch_put_from_multi_buffer_ranges``; per key the bytes written, or < 0.
* ``end``: 0, and the object is readable (unwritten ranges hold whatever the segment held: the
  writer fills them). ``revoke``: 0, nothing visible, the space is free at once. Both -600 for a
  key without a session here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lw_mooncake.client import StoreClient

_METHODS = ("batch_put_session_start", "batch_put_from_multi_buffer_ranges", "batch_put_session_end",
            "batch_put_session_revoke")


def have_put_sessions(store: Any) -> bool:
    """Whether Mooncake's client ``store`` offers put sessions."""
    return all(callable(getattr(store, m, None)) for m in _METHODS)


class PutSessions:
    def __init__(self, client: StoreClient) -> None:
        self.client = client

    def _call(self, name: str, *args: Any) -> list[int]:
        self.client.check_open()
        return list(self.client.calls.call(name, getattr(self.client.store, name), *args))

    def start(self, keys: Sequence[str], nbytes: int) -> list[int]:
        return self._call("batch_put_session_start", list(keys), [nbytes] * len(keys), *self.client.put_args())

    def ranges(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], offsets: list[list[int]]) -> list[int]:
        return self._call("batch_put_from_multi_buffer_ranges", keys, ptrs, sizes, offsets)

    def end(self, keys: Sequence[str]) -> list[int]:
        return self._call("batch_put_session_end", list(keys))

    def revoke(self, keys: Sequence[str]) -> list[int]:
        return self._call("batch_put_session_revoke", list(keys))
