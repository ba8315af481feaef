"""The disk tier's directory, file format and read handle (``disk_tier``): one file per object,
named by a hash of its key.

A file is a header, then the object's bytes. The header (format 3): magic, format version, the
key's length, the object's size, a random generation (nonce) written per demotion, the segment
size (``SEGMENT``, 64 KiB), the header's size, the header's own checksum (BLAKE2b), the key, then
one CRC-32 per segment of the payload; it is zero-padded to a multiple of ``HEADER_BYTES`` (4 KiB:
one block for any object up to about 60 MiB), so the payload and every segment start on a 4 KiB
boundary. ``read_header`` checks only the header (identity, sizes, the checksum over fields, key
and segment table); each segment is checked against its CRC-32 when it is read (``check_segment``),
so a layer's range can be handed out once the few segments under it are read and checked, without
reading the rest of the file first. A file is written under a temporary name (``TMP_PREFIX``),
fsync'd, then renamed: a reader never sees a partial one, and one that is short, foreign or
damaged anyway fails ``parse_header`` (a miss at open) or ``check_segment`` (a failed read).
Files of formats 1 and 2 (one checksum over the whole payload) fail ``parse_header``: a miss.

The directory (``prepare_dir``) must be ours, not a symlink, not writable by group or others, and
new, empty or marked as a disk tier (``MARKER``): anything else is refused, naming
``embedded_disk_path``, so files there are never replaced or removed.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import struct
import time
import zlib

from lw_core.backend import BackendError
from lw_core.backends.embedded import files

MAGIC = b"LWDISK\x00\x01"
VERSION = 3  # a CRC-32 per segment; formats 1 and 2 (one payload checksum) are misses
VERSIONS = (3,)
HEADER_BYTES = 4096  # the header's unit: its size is a multiple of this, so the payload is aligned
SEGMENT = 64 << 10  # bytes per checked segment (a power of two, a multiple of HEADER_BYTES)
MAX_SEGMENT = 64 << 20
MAX_HEADER = 64 << 20  # a header claiming more is damage, not read
SUFFIX = ".obj"
TMP_PREFIX = ".tmp-"
MARKER = "LW_DISK_TIER"
MARKER_TEXT = b"lw-pool disk tier 1\n"
# magic, version, key length, payload bytes, generation, segment bytes, header bytes, header checksum
_HEAD = struct.Struct("<8sIIQQII16s")
MAX_KEY = HEADER_BYTES - _HEAD.size
STALE_TMP_S = 600.0  # a temporary file this old is a dead demotion's, whoever made it


class BadFile(Exception):
    """A file that is not a whole, intact object of the disk tier (or not the key asked for)."""


def segments(nbytes: int, seg: int = SEGMENT) -> int:
    """How many segments a payload of ``nbytes`` has."""
    return -(-nbytes // seg)


def header_bytes(klen: int, nbytes: int, seg: int = SEGMENT) -> int:
    """The header's size for a key of ``klen`` bytes and a payload of ``nbytes``."""
    raw = _HEAD.size + klen + 4 * segments(nbytes, seg)
    return -(-raw // HEADER_BYTES) * HEADER_BYTES


def file_bytes(klen: int, nbytes: int) -> int:
    """The size of the file of a payload of ``nbytes`` under a key of ``klen`` bytes."""
    return header_bytes(klen, nbytes) + nbytes


class Header:
    """A parsed, checked header; ``crcs``: the CRC-32 of each segment."""

    __slots__ = ("bkey", "nbytes", "generation", "seg", "head_bytes", "crcs")

    def __init__(self, bkey: bytes, nbytes: int, generation: int, seg: int, head_bytes: int, crcs: tuple[int, ...]) -> None:
        self.bkey = bkey
        self.nbytes = nbytes
        self.generation = generation
        self.seg = seg
        self.head_bytes = head_bytes
        self.crcs = crcs

    @property
    def nsegs(self) -> int:
        return len(self.crcs)

    def span(self, s: int) -> tuple[int, int]:
        """Segment ``s``'s payload offsets: [lo, hi)."""
        lo = s * self.seg
        return lo, min(lo + self.seg, self.nbytes)


class DiskHandle:
    """A read handle on one object of the disk tier (``disk_tier`` owns every field but ``key``
    and ``nbytes``): the open file (kept until ``release``, closed by the last read in flight
    after it), its checked header, and, for an object held in memory, ``data`` (a buffer the tier
    recycles) with ``state`` (per segment: ``PENDING``, ``READING``, ``OK``, ``BAD``); segments
    are read into ``data`` ahead of the reads that want them and handed out once checked."""

    PENDING, READING, OK, BAD = 0, 1, 2, 3

    __slots__ = ("key", "nbytes", "_fd", "data", "head", "name", "ident", "check", "state", "left", "inflight",
                 "closing", "bad")

    def __init__(self, key: str, head: Header, fd: int, name: str, ident: tuple[int, int], check: bool,
                 data: mmap.mmap | None = None) -> None:
        self.key = key
        self.nbytes = head.nbytes
        self._fd = fd
        self.data = data
        self.head = head
        self.name = name
        self.ident = ident  # (inode, generation) of the file opened
        self.check = check  # compare each segment's CRC-32 (False: this file was checked whole before)
        self.state = bytearray(head.nsegs) if data is not None else None
        self.left = head.nsegs  # segments not yet read and checked (held objects)
        self.inflight = 0  # reads using the fd (and ``data``) right now
        self.closing: tuple[int, mmap.mmap | None] | None = None  # released while reads were in flight
        self.bad: str | None = None  # why a read of this object failed (it is a miss from then on)

    def __repr__(self) -> str:
        return f"DiskHandle({self.key!r}, nbytes={self.nbytes}, {'open' if self._fd >= 0 else 'closed'})"


def file_name(bkey: bytes) -> str:
    """The object's file name: a hash of its key (keys may hold any characters)."""
    return hashlib.blake2b(bkey, digest_size=20).hexdigest() + SUFFIX


def segment_crcs(data: memoryview | bytes | bytearray, seg: int = SEGMENT) -> tuple[int, ...]:
    """The CRC-32 of each segment of ``data``."""
    m = memoryview(data).cast("B")
    return tuple(zlib.crc32(m[lo : lo + seg]) for lo in range(0, m.nbytes, seg))


def check_segment(head: Header, s: int, data: memoryview | bytes | bytearray | mmap.mmap) -> bool:
    """Whether ``data`` (segment ``s``'s bytes) has the CRC-32 the header holds for it."""
    return zlib.crc32(data) == head.crcs[s]


def _head_sum(fields: bytes, bkey: bytes, table: bytes) -> bytes:
    return hashlib.blake2b(fields + bkey + table, digest_size=16).digest()


def build_header(bkey: bytes, nbytes: int, generation: int, crcs: tuple[int, ...], seg: int = SEGMENT) -> bytes:
    """The header of an object of ``nbytes`` under ``bkey`` whose segments have CRC-32s ``crcs``
    (zero-padded to ``header_bytes``)."""
    if len(bkey) > MAX_KEY:
        raise ValueError(f"disk tier: key of {len(bkey)} bytes is longer than {MAX_KEY}")
    if len(crcs) != segments(nbytes, seg):
        raise ValueError(f"disk tier: {len(crcs)} segment checksums for {segments(nbytes, seg)} segments")
    size = header_bytes(len(bkey), nbytes, seg)
    fields = _HEAD.pack(MAGIC, VERSION, len(bkey), nbytes, generation, seg, size, b"")[: _HEAD.size - 16]
    table = struct.pack(f"<{len(crcs)}I", *crcs)
    head = fields + _head_sum(fields, bkey, table) + bkey + table
    return head + bytes(size - len(head))


def _fields(raw: bytes) -> tuple[int, int, int, int, int, int, bytes]:
    if len(raw) < _HEAD.size:
        raise BadFile(f"header is {len(raw)} bytes (torn)")
    magic, version, klen, nbytes, gen, seg, size, hsum = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise BadFile("bad magic (not a disk-tier object)")
    if version not in VERSIONS:
        raise BadFile(f"format version {version} (expected one of {VERSIONS})")
    if klen > MAX_KEY or not HEADER_BYTES <= seg <= MAX_SEGMENT or seg & (seg - 1):
        raise BadFile(f"key length {klen} or segment size {seg} out of range")
    if size != header_bytes(klen, nbytes, seg) or size > MAX_HEADER:
        raise BadFile(f"header size {size} does not match its fields")
    return klen, nbytes, gen, seg, size, hsum, bytes(raw[: _HEAD.size - 16])


def parse_header(raw: bytes, file_size: int, bkey: bytes | None = None) -> Header:
    """Check a header (all ``header_bytes`` of it) against its file's size (and the key
    expected, when given)."""
    klen, nbytes, gen, seg, size, hsum, fields = _fields(raw)
    if len(raw) < size:
        raise BadFile(f"header is {len(raw)} bytes of {size} (torn)")
    key = bytes(raw[_HEAD.size : _HEAD.size + klen])
    n = segments(nbytes, seg)
    table = bytes(raw[_HEAD.size + klen : _HEAD.size + klen + 4 * n])
    if _head_sum(fields, key, table) != hsum:
        raise BadFile("header checksum mismatch")
    if bkey is not None and key != bkey:
        raise BadFile("key mismatch (another key's file, or a hash collision)")
    if file_size != size + nbytes:
        raise BadFile(f"file has {file_size} bytes, header says {size + nbytes} (torn)")
    return Header(key, nbytes, gen, seg, size, struct.unpack(f"<{n}I", table))


def read_header(fd: int, bkey: bytes | None = None) -> Header:
    """Read and check the header of the open file ``fd`` (one read, two for a header over 4 KiB)."""
    raw = os.pread(fd, HEADER_BYTES, 0)
    size = _fields(raw)[4]
    if size > len(raw):
        raw = os.pread(fd, size, 0)
    return parse_header(raw, os.fstat(fd).st_size, bkey)


def scan_dir(path: str, *, headers: bool) -> tuple[list[tuple[int, str, int]], list[tuple[str, Exception]]]:
    """The tier's object files: (mtime ns, name, bytes) of each good one, (name, why) of each bad
    one (its header checked when ``headers``); dead demotions' temporaries are removed."""
    found: list[tuple[int, str, int]] = []
    bad: list[tuple[str, Exception]] = []
    now = time.time()
    for ent in os.scandir(path):
        p = ent.path
        if ent.name.startswith(TMP_PREFIX):
            if stale_tmp(ent.name, p, now):
                unlink(p)
            continue
        if not ent.name.endswith(SUFFIX) or not ent.is_file(follow_symlinks=False):
            continue
        if not headers:  # a listing only: stat, no open
            try:
                st = ent.stat(follow_symlinks=False)
            except OSError:
                continue
            found.append((st.st_mtime_ns, ent.name, st.st_size))
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile
        try:
            st = os.fstat(fd)
            if file_name(read_header(fd).bkey) != ent.name:
                raise BadFile("its name is not its key's")
            found.append((st.st_mtime_ns, ent.name, st.st_size))
        except (BadFile, OSError) as e:
            bad.append((ent.name, e))
        finally:
            os.close(fd)
    return found, bad


def unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def stale_tmp(name: str, p: str, now: float) -> bool:
    """A temporary file whose writer is dead (its pid is gone) or that is older than STALE_TMP_S."""
    try:
        pid = int(name[len(TMP_PREFIX) :].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return True
    except PermissionError:
        pass
    try:
        return now - os.stat(p, follow_symlinks=False).st_mtime > STALE_TMP_S
    except OSError:
        return False


def prepare_dir(path: str) -> None:
    """Create the tier directory (0700), or check that an existing one is ours and is a disk tier."""
    try:
        os.makedirs(path, 0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise BackendError(f"embedded disk tier: cannot create embedded_disk_path={path!r}: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise BackendError(f"embedded disk tier: embedded_disk_path={path!r} is not a directory (or is a symbolic link)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise BackendError(
            f"embedded disk tier: embedded_disk_path={path!r} is owned by uid {st.st_uid} or writable by group or "
            f"others (mode {st.st_mode & 0o7777:04o}); this process runs as uid {os.geteuid()}: use a directory of your own"
        )
    names = os.listdir(path)
    marker = os.path.join(path, MARKER)
    if MARKER in names:
        fd = files.open_file(marker, os.O_RDONLY, what="disk tier marker")
        try:
            head = os.read(fd, 64)
        finally:
            os.close(fd)
        if head and not head.startswith(b"lw-pool disk tier "):
            raise BackendError(f"embedded disk tier: {marker!r} is not an lw-pool disk tier marker (embedded_disk_path)")
        return
    if names:
        shown = ", ".join(map(repr, sorted(names)[:5])) + (" ..." if len(names) > 5 else "")
        raise BackendError(
            f"embedded disk tier: embedded_disk_path={path!r} is neither empty nor an lw-pool disk tier (no {MARKER} "
            f"file; it holds {shown}); refusing to write there: set embedded_disk_path to a new or empty directory"
        )
    try:
        fd = files.open_file(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="disk tier marker")
    except BackendError as e:
        if isinstance(e.__cause__, FileExistsError):
            return
        raise
    try:
        os.write(fd, MARKER_TEXT)
    finally:
        os.close(fd)
