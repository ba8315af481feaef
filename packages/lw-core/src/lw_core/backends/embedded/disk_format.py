"""The disk tier's directory, file format and read handle (``disk_tier``): one file per object,
named by a hash of its key.

A file is a fixed ``HEADER_BYTES`` header, then the object's bytes (so the payload starts on a
4 KiB boundary, as ``O_DIRECT`` wants). The header: magic, format version, the key's length, the
object's size, a random generation (nonce) written per demotion, the payload's checksum (CRC-32
in format 2, what is written; BLAKE2b-256 in format 1, still read), the header's own checksum
(BLAKE2b), then the key. The payload's checksum only has to catch damage (the key's identity is the
header's, under its own checksum), and CRC-32 runs at several GB/s where BLAKE2b runs at about one
per core: a hit checks each file's payload on its first open, at the disk's speed. A file is written under a temporary name
(``TMP_PREFIX``), fsync'd, then renamed: a reader never sees a partial one, and one that is short,
foreign or damaged anyway fails ``parse_header`` or ``check_payload`` and is treated as a miss.

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
from typing import Protocol

from lw_core.backend import BackendError
from lw_core.backends.embedded import files
from lw_core.backends.embedded.disk_payload_reads import PayloadReads, aligned

MAGIC = b"LWDISK\x00\x01"
VERSION = 2  # written; format 1 (a BLAKE2b payload checksum) is still read
VERSIONS = (1, 2)
HEADER_BYTES = 4096
SUFFIX = ".obj"
TMP_PREFIX = ".tmp-"
MARKER = "LW_DISK_TIER"
MARKER_TEXT = b"lw-pool disk tier 1\n"
# magic, version, key length, payload bytes, generation, payload checksum, header checksum
_HEAD = struct.Struct("<8sIIQQ32s16s")
MAX_KEY = HEADER_BYTES - _HEAD.size
STALE_TMP_S = 600.0  # a temporary file this old is a dead demotion's, whoever made it
CHUNK = 8 << 20  # checksum reads, so verifying a big object never allocates its size twice


class BadFile(Exception):
    """A file that is not a whole, intact object of the disk tier (or not the key asked for)."""


class DiskHandle:
    """A read handle on one object of the disk tier: the open file (kept until ``release``) and,
    for a small object, its payload as read and checked at open (``data``, a buffer the tier
    recycles after ``release`` once no view of it is left; reads are served from it, so a hit reads
    the file once)."""

    __slots__ = ("key", "nbytes", "_fd", "data")

    def __init__(self, key: str, nbytes: int, fd: int, data: mmap.mmap | None = None) -> None:
        self.key = key
        self.nbytes = nbytes
        self._fd = fd
        self.data = data

    def __repr__(self) -> str:
        return f"DiskHandle({self.key!r}, nbytes={self.nbytes}, {'open' if self._fd >= 0 else 'closed'})"


def file_name(bkey: bytes) -> str:
    """The object's file name: a hash of its key (keys may hold any characters)."""
    return hashlib.blake2b(bkey, digest_size=20).hexdigest() + SUFFIX


class _Crc32:
    """CRC-32 (zlib) with hashlib's ``update``/``digest``; the digest is 4 bytes, zero-padded
    to the header's 32-byte field."""

    __slots__ = ("crc",)

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: memoryview | bytes | bytearray | mmap.mmap) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def digest(self) -> bytes:
        return self.crc.to_bytes(4, "little") + bytes(28)


class _Hasher(Protocol):
    def update(self, data: memoryview | bytes | bytearray | mmap.mmap, /) -> None: ...

    def digest(self) -> bytes: ...


def _hasher(version: int) -> _Hasher:
    return _Crc32() if version >= 2 else hashlib.blake2b(digest_size=32)


def payload_digest(data: memoryview | bytes | bytearray | mmap.mmap, version: int = VERSION) -> bytes:
    """The payload checksum a header of format ``version`` holds."""
    h = _hasher(version)
    h.update(data)
    return h.digest()


def _head_sum(fields: bytes, bkey: bytes) -> bytes:
    return hashlib.blake2b(fields + bkey, digest_size=16).digest()


def build_header(bkey: bytes, nbytes: int, generation: int, digest: bytes, version: int = VERSION) -> bytes:
    """The header block (``HEADER_BYTES``, zero-padded) of an object of ``nbytes`` under ``bkey``."""
    if len(bkey) > MAX_KEY:
        raise ValueError(f"disk tier: key of {len(bkey)} bytes is longer than {MAX_KEY}")
    fields = _HEAD.pack(MAGIC, version, len(bkey), nbytes, generation, digest, b"")[: _HEAD.size - 16]
    head = fields + _head_sum(fields, bkey) + bkey
    return head + bytes(HEADER_BYTES - len(head))


class Header:
    """A parsed, checked header."""

    __slots__ = ("bkey", "nbytes", "generation", "digest", "version")

    def __init__(self, bkey: bytes, nbytes: int, generation: int, digest: bytes, version: int = VERSION) -> None:
        self.bkey = bkey
        self.nbytes = nbytes
        self.generation = generation
        self.digest = digest
        self.version = version


def parse_header(raw: bytes, file_size: int, bkey: bytes | None = None) -> Header:
    """Check a header against its file's size (and the key expected, when given)."""
    if len(raw) < _HEAD.size:
        raise BadFile(f"header is {len(raw)} bytes (torn)")
    magic, version, klen, nbytes, gen, digest, hsum = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise BadFile("bad magic (not a disk-tier object)")
    if version not in VERSIONS:
        raise BadFile(f"format version {version} (expected one of {VERSIONS})")
    if klen > MAX_KEY or _HEAD.size + klen > len(raw):
        raise BadFile(f"key length {klen} out of range")
    key = bytes(raw[_HEAD.size : _HEAD.size + klen])
    if _head_sum(bytes(raw[: _HEAD.size - 16]), key) != hsum:
        raise BadFile("header checksum mismatch")
    if bkey is not None and key != bkey:
        raise BadFile("key mismatch (another key's file, or a hash collision)")
    if file_size != HEADER_BYTES + nbytes:
        raise BadFile(f"file has {file_size} bytes, header says {HEADER_BYTES + nbytes} (torn)")
    return Header(key, nbytes, gen, digest, version)


def read_header(fd: int, bkey: bytes | None = None) -> Header:
    """Read and check the header of the open file ``fd``."""
    return parse_header(os.pread(fd, HEADER_BYTES, 0), os.fstat(fd).st_size, bkey)


def read_payload(fd: int, head: Header, *, check: bool) -> bytes:
    """The whole payload (at most ``CHUNK`` bytes) in one read, its checksum compared with the
    header's when ``check``."""
    data = os.pread(fd, head.nbytes, HEADER_BYTES)
    if len(data) != head.nbytes:
        raise BadFile("payload is short (torn)")
    if check and payload_digest(data, head.version) != head.digest:
        raise BadFile("payload checksum mismatch")
    return data


def read_payload_into(fd: int, head: Header, buf: mmap.mmap, *, check: bool, reads: PayloadReads) -> None:
    """``read_payload`` into ``buf`` (a recycled buffer of ``aligned(head.nbytes)`` bytes, so a
    hit does not fault in fresh pages for every payload it holds), through ``reads`` (buffered,
    or direct I/O: ``PayloadReads``)."""
    if len(buf) != aligned(head.nbytes):
        raise ValueError(f"disk tier: a buffer of {len(buf)} bytes for a payload of {head.nbytes}")
    if reads.into(fd, HEADER_BYTES, buf, head.nbytes) != head.nbytes:
        raise BadFile("payload is short or long (torn or replaced)")
    if check:
        with memoryview(buf) as m, m[: head.nbytes] as payload:
            if payload_digest(payload, head.version) != head.digest:
                raise BadFile("payload checksum mismatch")


def check_payload(fd: int, head: Header) -> None:
    """Read the whole payload once and compare its checksum with the header's."""
    h = _hasher(head.version)
    pos, end = HEADER_BYTES, HEADER_BYTES + head.nbytes
    while pos < end:
        chunk = os.pread(fd, min(CHUNK, end - pos), pos)
        if not chunk:
            raise BadFile("payload is short (torn)")
        h.update(chunk)
        pos += len(chunk)
    if h.digest() != head.digest:
        raise BadFile("payload checksum mismatch")


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


def purge_dir(path: str, prefix: bytes) -> list[str]:
    """Remove the tier's object files whose key starts with ``prefix`` (every one for ``b""``);
    their names. A file whose header cannot be read is left to the tier (a miss it removes). The
    directory must be a disk tier (its ``MARKER``): nothing is removed anywhere else."""
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise BackendError(f"embedded disk tier: {path!r} is not a disk tier (no {MARKER} file); nothing removed")
    removed = []
    for ent in os.scandir(path):
        if not ent.name.endswith(SUFFIX) or ent.name.startswith(TMP_PREFIX) or not ent.is_file(follow_symlinks=False):
            continue
        if prefix:
            try:
                fd = os.open(ent.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # removed meanwhile
            try:
                if not read_header(fd).bkey.startswith(prefix):
                    continue
            except (BadFile, OSError):
                continue
            finally:
                os.close(fd)
        try:
            os.unlink(ent.path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise BackendError(f"embedded disk tier: cannot remove {ent.path!r}: {e}") from e
        removed.append(ent.name)
    return removed


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
