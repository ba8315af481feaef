"""Handles of pool objects: reserved (its local buffer) or opened for reading, and a streaming
reader's handle on a reservation or a committed object (``lw_mooncake.stream_read``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lw_core.backend import BackendError
from lw_core.procs import Owner


@dataclass(eq=False, slots=True)
class MooncakeHandle:
    key: str
    nbytes: int
    buf: np.ndarray | None = field(default=None, repr=False)  # the local object while reserved
    data: np.ndarray | None = field(default=None, repr=False)  # a read handle's fetched object ("whole")
    committed: bool = False  # its put succeeded: committing it again is a no-op
    failed: BackendError | None = None  # its put failed with this: committing it again raises it again
    reserved: bool = False  # made by reserve (a writer's handle), not by open
    session: bool = False  # reserved as a Mooncake put session (lw_mooncake.session_writer)
    sent: list[tuple[int, int]] = field(default_factory=list, repr=False)  # ranges written into the session
    extent: int | None = None  # where ``buf`` lies in the put arena (``lw_mooncake.reservations``), if it does
    filled: list[tuple[int, int]] = field(default_factory=list, repr=False)  # ranges of ``buf`` written (arena, whole puts)


@dataclass(eq=False, slots=True)
class MooncakeStreamHandle:
    """From ``open_streaming``: on a reservation (``token``, read through its segments) or on a
    committed object (``committed``, read by key). ``dead``: aborted, its writer died, or released."""

    key: str
    nbytes: int
    token: bytes | None
    boot: bytes = b""
    owner: Owner | None = None
    committed: bool = False
    dead: bool = False
