"""``MooncakeBackend``: lw-core's Backend protocol over Mooncake Store's Python client.

One pool object is one Mooncake object. Writes use Mooncake's put sessions when the client has them
(``put_sessions``: None detects, False never; ``lw_mooncake.session_writer``): ``reserve`` starts a
session per key (the master allocates; nothing is visible), each ``write`` is a ranged put of that
layer's bytes (overlapping compute in the layer pipeline), ``commit`` ends the sessions (the objects
become readable), ``abort`` revokes. Without sessions, objects are put whole at commit:

* ``reserve``: ``batch_is_exist`` skips keys already stored; the rest get a local buffer in this
  process (nothing is sent yet). ``write`` / ``view`` fill it, layer by layer.
* ``commit``: ``batch_put_from`` of the whole objects from registered staging. Mooncake's put
  allocates, transfers, then marks the object complete: ``batch_is_exist`` / gets see it only then.
  So ``lookup``/``open`` only ever see complete chunks, and a writer killed before or during
  ``commit`` leaves nothing visible. ``abort`` drops the local buffer.
* ``open``: ``batch_get_replica_desc`` (the objects' sizes; missing ones are ``None``). Then, by
  ``load`` (key ``mooncake_load``): ``"per_layer"`` -- each batch is one ``get_into_ranges``, a
  ranged get of one layer of every object, into an extent of the get arena (``get_arena.GetArena``:
  registered with Mooncake once and offered as ``host_regions``, so a device copier moves layers
  from it by DMA) lent to the pipeline until its copy is done (``read_lent``; ``read``: into
  registered staging, then copied out, as without room in the arena), and ``view`` of a read
  handle is ``None``; ``"whole"`` -- ``open`` fetches the whole objects with ``batch_get_into``
  into the get arena (a buffer of the fetch's own when it is full), which ``view``/``read`` then
  serve (fewer, larger calls:
  Mooncake's cost is per key and call; measured in docs/bench/mooncake.md); ``"auto"`` (the
  default) -- ``"whole"`` for an open of at most ``mooncake_whole_max_bytes``, else ``"per_layer"``.
  ``release`` drops the local copies; Mooncake itself pins an object for ``--default_kv_lease_ttl``
  after each get.

This module is a facade: it builds its collaborators, each with its own state, and forwards the
protocol's calls to them:

* ``client.StoreClient`` -- the Mooncake client set up against the master, its calls under a
  deadline (``mooncake_call_timeout_s``; past it ``BackendUnavailable``), and whether it is closed;
* ``puts.StagedPuts`` / ``gets.StagedGets`` -- registered put and get staging, one batch at a time;
* ``get_arena.GetArena`` -- the memory gets land in, which extents of it read handles hold or are lent;
* ``arena.Arena`` (``put_arena``) -- the memory reservations' local objects live in, which puts send
  from and a device copier writes into (``write_buffers``);
* ``reservations.Reservations`` -- this process's open reservations (their local objects);
* ``put_sessions.PutSessions`` / ``session_writer.SessionWriter`` -- put sessions, when used;
* ``object_writer.ObjectWriter`` / ``object_reader.ObjectReader`` -- the protocol's two halves;
* the optional streaming extension (``streaming=True``, from ``pd_streaming``; design in
  ``lw_mooncake.streaming``): ``stream_write.StreamWriter`` (None without streaming) and
  ``stream_read.StreamReader``.

The facade's own state is its configuration (``load``, ``staging_size``). Mooncake loses every
object when its master dies (the master holds the only index).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from lw_core.backends.segment_stream.checks import check_publish, require_streaming
from lw_mooncake.arena import Arena
from lw_mooncake.calls import Deadlines
from lw_mooncake.client import INSTALL_HINT, StoreClient, route_address
from lw_mooncake.get_arena import ALIGN, ArenaLend, GetArena
from lw_mooncake.gets import StagedGets
from lw_mooncake.handle import MooncakeHandle, MooncakeStreamHandle
from lw_mooncake.object_reader import ObjectReader
from lw_mooncake.object_writer import ObjectWriter
from lw_mooncake.put_sessions import PutSessions, have_put_sessions
from lw_mooncake.puts import StagedPuts
from lw_mooncake.reservations import Reservations
from lw_mooncake.session_writer import SessionWriter
from lw_mooncake.stream_read import StreamReader
from lw_mooncake.stream_write import StreamWriter

__all__ = ["INSTALL_HINT", "MooncakeBackend", "MooncakeHandle", "route_address"]


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, master: str, *, metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp", rdma_devices: str = "",
                 local_hostname: str = "", global_segment_size: int = 0, local_buffer_size: int = 16 << 20,
                 staging_size: int = 64 << 20, call_timeout_s: float = 5.0, setup_timeout_s: float = 30.0,
                 load: str = "auto", whole_max_bytes: int = 256 << 20, get_arena_bytes: int = 256 << 20,
                 put_arena_bytes: int = 256 << 20, restore_signals: bool = True,
                 streaming: bool = False, put_sessions: bool | None = None, prefer_local_segment: bool = True) -> None:
        if load not in ("auto", "per_layer", "whole"):
            raise ValueError(f"mooncake_load={load!r}: expected 'auto', 'per_layer' or 'whole'")
        if whole_max_bytes < 0:
            raise ValueError(f"mooncake_whole_max_bytes={whole_max_bytes}: must be >= 0")
        if get_arena_bytes < 0:
            raise ValueError(f"mooncake_get_arena_bytes={get_arena_bytes}: must be >= 0")
        if put_arena_bytes < 0:
            raise ValueError(f"mooncake_put_arena_bytes={put_arena_bytes}: must be >= 0")
        self.load = load
        self.staging_size = staging_size
        self.client = StoreClient.connect(
            master, metadata_server=metadata_server, protocol=protocol, rdma_devices=rdma_devices,
            local_hostname=local_hostname, global_segment_size=global_segment_size,
            local_buffer_size=local_buffer_size, call_timeout_s=call_timeout_s, setup_timeout_s=setup_timeout_s,
            restore_signals=restore_signals, prefer_local_segment=prefer_local_segment)
        self.master, self.metadata_server = master, self.client.metadata_server
        self.local_hostname = self.client.local_hostname
        # Reservations' local objects live in one arena registered once (with Mooncake, and with a
        # device through ``host_regions``): puts send from it and a device writes into it with no
        # staging between (streaming's segment puts hold the extents they read, ``Reservations.pin``).
        self.put_arena = Arena(self.client.store, self.client.calls, put_arena_bytes, "put") if put_arena_bytes >= ALIGN else None
        self.puts = StagedPuts(self.client, staging_size, self.put_arena)
        # Gets land in another: whole objects, and each layer's ranged gets lent to the pipeline.
        self.arena = GetArena(self.client.store, self.client.calls, get_arena_bytes) if get_arena_bytes >= ALIGN else None
        self.gets = StagedGets(self.client, staging_size, self.arena)
        self.reservations = Reservations(self.put_arena)
        self.stream_writer = StreamWriter(self.client, self.puts, self.reservations) if streaming else None
        self.stream_reader = StreamReader(self.client, self.gets)
        use_sessions = have_put_sessions(self.client.store) if put_sessions is None else put_sessions
        sessions = (SessionWriter(PutSessions(self.client), self.puts, self.reservations, Counter())
                    if use_sessions else None)
        self.writer = ObjectWriter(self.client, self.puts, self.reservations, staging_size=staging_size,
                                   streams=self.stream_writer, sessions=sessions)
        self.reader = ObjectReader(self.client, self.gets, load=load, staging_size=staging_size,
                                   whole_max_bytes=whole_max_bytes)

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> MooncakeBackend:
        k = cfg.backend_keys
        kwargs.setdefault("streaming", bool(getattr(cfg, "pd_streaming", False)))
        return cls(k.mooncake_master, metadata_server=k.mooncake_metadata_server, protocol=k.mooncake_protocol,
                   rdma_devices=k.mooncake_rdma_devices, local_hostname=k.mooncake_local_hostname,
                   global_segment_size=k.mooncake_global_segment_size,
                   local_buffer_size=k.mooncake_local_buffer_size, staging_size=k.mooncake_staging_size,
                   call_timeout_s=k.mooncake_call_timeout_s, load=k.mooncake_load,
                   whole_max_bytes=k.mooncake_whole_max_bytes, get_arena_bytes=k.mooncake_get_arena_bytes,
                   put_arena_bytes=k.mooncake_put_arena_bytes,
                   prefer_local_segment=k.mooncake_prefer_local_segment, **kwargs)

    @property
    def store(self) -> Any:
        """Mooncake's client (``StoreClient.store``)."""
        return self.client.store

    @property
    def calls(self) -> Deadlines:
        return self.client.calls

    # ----- the protocol (ObjectReader, ObjectWriter) -----

    def lookup(self, keys: Sequence[str]) -> int:
        return self.reader.lookup(keys)

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MooncakeHandle | None]:
        return self.writer.reserve(keys, nbytes)

    def write(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        self.writer.write(handles, offsets, srcs)

    def view(self, handle: MooncakeHandle, offset: int, nbytes: int) -> memoryview | None:
        if isinstance(handle, MooncakeStreamHandle):
            return None  # streaming reads copy (a segment proves its bytes only when fetched)
        if handle.buf is None:  # a read handle, or a reservation that ended
            return self.reader.view(handle, offset, nbytes)
        return self.writer.view(handle, offset, nbytes)

    def write_buffers(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], nbytes: int) -> list[Any] | None:
        """The optional protocol method: the put sessions' local objects in the put arena, to fill
        and hand to ``write`` (which then copies nothing)."""
        return self.writer.write_buffers(handles, offsets, nbytes)

    def commit(self, handles: Sequence[MooncakeHandle]) -> None:
        self.writer.commit(handles)

    def abort(self, handles: Sequence[MooncakeHandle]) -> None:
        self.writer.abort(handles)

    def open(self, keys: Sequence[str]) -> list[MooncakeHandle | None]:
        return self.reader.open(keys)

    def read(self, handles: Sequence[Any], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        if any(isinstance(h, MooncakeStreamHandle) for h in handles):
            self.stream_reader.read(handles, offsets, dsts)
        else:
            self.reader.read(handles, offsets, dsts)

    def read_lent(self, handles: Sequence[Any], offsets: Sequence[int], nbytes: int) -> ArenaLend | None:
        """The optional protocol method: one layer of ``handles`` into the get arena, lent."""
        if any(isinstance(h, MooncakeStreamHandle) for h in handles):
            return None  # streaming reads check what each segment proves (stream_read)
        return self.reader.read_lent(handles, offsets, nbytes)

    def release(self, handles: Sequence[Any]) -> None:
        self.reader.release(handles)

    def host_regions(self) -> list[memoryview]:
        """Where gets land and where reservations live (the optional protocol method): a device
        copier registers them and moves layers between them and the KV cache directly."""
        return [a.region() for a in (self.arena, self.put_arena) if a is not None]

    # ----- streaming (StreamWriter, StreamReader) -----

    def publish(self, handles: Sequence[Any], upto: int) -> None:
        if self.stream_writer is not None:
            self.stream_writer.publish(handles, upto)
            return
        check_publish("mooncake", handles, upto, lambda h: isinstance(h, MooncakeHandle) and h.reserved)
        require_streaming("mooncake", False, "MooncakeBackend", "reservations get a head streaming readers find")

    def open_streaming(self, keys: Sequence[str]) -> list[MooncakeStreamHandle | None]:
        return self.stream_reader.open_streaming(keys)

    def wait_published(self, handles: Sequence[Any], upto: int, timeout_s: float) -> list[bool]:
        return self.stream_reader.wait_published(handles, upto, timeout_s)

    # ----- counters and close -----

    def stats(self) -> dict[str, int]:
        leftovers = len(self.stream_writer.collector) if self.stream_writer is not None else 0
        arenas = {k: v for a in (self.arena, self.put_arena) if a is not None for k, v in a.counts.items()}
        refused = sum(v for k, v in arenas.items() if k.endswith("_arena_refused"))
        return {**self.writer.counts, **self.gets.counts, **self.puts.counts, **arenas,
                "store_register_refusals": refused, "pending": len(self.reservations),
                "call_timeouts": self.calls.timeouts, "stream_leftovers": leftovers}

    def close(self, timeout_s: float = 10.0) -> None:
        if self.client.closed:
            return
        if self.stream_writer is not None:
            self.stream_writer.close()
        self.writer.close()
        for arena in (self.arena, self.put_arena):
            if arena is not None:
                arena.close()
        self.client.close(timeout_s)

    def __enter__(self) -> MooncakeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
