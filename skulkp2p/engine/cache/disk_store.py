"""The prefix cache's entries on disk, so that a node restarted (even killed) finds them.

The memory cache (prefix_cache.py) hands each entry it keeps to `PrefixDiskStore.put`, which
copies its arrays (contiguous, evaluated: a memory copy, no disk) and queues it; a writer thread
of its own writes it, so the decode loop never waits on the disk. A lookup that the memory cache
cannot serve as well as an entry on disk can loads that entry: its file is read, checked and
parsed into host arrays without MLX (`read`, which a batched request does before it takes the
model's lock, `PrefixCache.read_ahead`), and only the copy into MLX arrays (`install`) runs on
the thread that holds the model.

A file is written whole or not at all: a temporary file beside it, fsync, rename, fsync of the
folder; a process killed mid-write leaves only the temporary file, removed at the next start.
Every file carries a SHA-256 of all that follows it: a file that fails it (a flipped byte, a
truncation) is refused and removed, and the lookup is a miss. Entries are tied to the model: the
folder and every file's header carry a fingerprint of its weights and of what computed the
caches (the model's id and dtype, the versions of mlx and mlx-lm, this format), and a file of
another fingerprint is never loaded.

Bounded in bytes (the files' sizes), least recently used out first; use survives a restart as
the files' modification times (a hit touches its file). One process at a time uses a folder (an
exclusive lock beside the entries): a second process of the same model and data dir gets
`StoreInUse` and keeps its cache in memory only.

The file: MAGIC (8 bytes), the SHA-256 of the rest (32), the header's length (8, little endian),
the header (JSON: format, fingerprint, key tokens, the caches' classes and the shape of their
state with arrays by name), then the arrays as safetensors. Safetensors because it keeps every
dtype mlx computes in (bfloat16, which numpy lacks; quantized words), mlx reads and writes it
natively, and loading it runs no code (no pickle); a small JSON header because the key and the
state's scalars are few, and a reader can index the folder from the headers alone.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import re
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_caches
from mlx_lm.models.cache import PromptTrie

from skulkp2p.atomic_file import TMP_SUFFIX, write_atomic
from skulkp2p.engine.cache.caches import CacheEntry, State

log = logging.getLogger("skulkp2p.prefix")

FORMAT = 1
MAGIC = b"SKPFXC1\n"
_DIGEST = 32
_PREFIX = len(MAGIC) + _DIGEST + 8  # magic, digest, header length
SUFFIX = ".entry"
LOCK_NAME = ".lock"
_NS = "disk"
# Entries queued and not yet written may hold at most this many bytes (or the store's bound if
# smaller): past it the oldest queued entry is dropped, never waited for.
MAX_PENDING_BYTES = 1 << 30

# A state's shape in the header: arrays by name, tuples marked, scalars as they are.
Spec: TypeAlias = "None | bool | int | float | str | list[Spec] | dict[str, Spec]"


class StoreInUse(RuntimeError):
    """Another live process holds this folder of entries."""


class BadEntry(ValueError):
    """A file that is not a whole entry of this store: refused (and removed)."""


@dataclass(frozen=True)
class DiskEntry:
    """What the index knows of a file from its header."""
    key: tuple[int, ...]
    trimmable: bool
    mtp_rows: int
    has_hidden: bool
    nbytes: int  # the file's size
    path: Path

    @property
    def length(self) -> int:
        return len(self.key) - 1


@dataclass
class StoredEntry:
    """An entry's contents as written and read: the caches after every token of `key` but the
    last (prefix_cache.py's _Entry, without its bookkeeping)."""
    key: tuple[int, ...]
    caches: list[CacheEntry]
    mtp: CacheEntry | None
    mtp_rows: int
    mtp_hidden: mx.array | None
    trimmable: bool


# ------------------------------------------------------------------------------ fingerprint

_SAMPLES = 16  # chunks of each weights file read into the fingerprint
_SAMPLE_BYTES = 1 << 16


def weights_fingerprint(model_dir: Path, identity: Sequence[str]) -> str:
    """A hex SHA-256 of the model's files and `identity` (what else decides the caches' bits:
    the model's id, dtype, library versions). Cheap at any size: each weights file's name, size,
    safetensors header and 16 chunks spread over it (a fine-tune changes nearly every chunk);
    every JSON file (config, tokenizer) whole."""
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, *identity]).encode())
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir()
                   if p.is_file() and p.suffix in (".safetensors", ".json")) \
        if model_dir.is_dir() else [model_dir]
    for path in files:
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if path.suffix == ".json":
                h.update(f.read())
                continue
            head = f.read(8)
            h.update(head)
            if path.suffix == ".safetensors" and len(head) == 8:
                h.update(f.read(min(struct.unpack("<Q", head)[0], size)))
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


# ------------------------------------------------------------------------------ encoding

def _cache_maker(name: str) -> Callable[[object], CacheEntry]:
    """mlx-lm's `from_state` of its cache class `name` (mlx-lm has no type information)."""
    cls = getattr(mlx_caches, name, None)
    make = getattr(cls, "from_state", None)
    if not isinstance(cls, type) or not callable(make):
        raise BadEntry(f"unknown cache class {name!r}")
    return cast(Callable[[object], CacheEntry], make)


def writable(cache: CacheEntry) -> bool:
    """mlx-lm's own cache classes only: they are rebuilt from their state by name."""
    return type(cache) is getattr(mlx_caches, type(cache).__name__, None)


def _encode(value: State | int | float | str, arrays: dict[str, mx.array], name: str) -> Spec:
    if isinstance(value, mx.array):
        arrays[name] = mx.contiguous(value)
        return {"a": name}
    if isinstance(value, tuple):
        return {"t": [_encode(v, arrays, f"{name}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, arrays, f"{name}.{i}") for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a cache state holds a {type(value).__name__}")


def _decode(spec: Spec, arrays: dict[str, mx.array]) -> State | int | float | str:
    if isinstance(spec, dict):
        if "a" in spec and isinstance(spec["a"], str):
            if spec["a"] not in arrays:
                raise BadEntry(f"array {spec['a']!r} missing")
            return arrays[spec["a"]]
        items = spec.get("t")
        if not isinstance(items, list):
            raise BadEntry("a malformed state")
        return tuple(_decode(v, arrays) for v in items)  # type: ignore[misc]
    if isinstance(spec, list):
        return [_decode(v, arrays) for v in spec]  # type: ignore[misc]
    return spec


@dataclass
class _Encoded:
    """An entry ready for the writer: its header and its arrays (contiguous, evaluated)."""
    key: tuple[int, ...]
    header: dict[str, object]
    arrays: dict[str, mx.array]
    nbytes: int  # the arrays' bytes (the file's, near enough)
    trimmable: bool
    mtp_rows: int


def encode(entry: StoredEntry, fingerprint: str) -> _Encoded:
    arrays: dict[str, mx.array] = {}
    caches = [{"class": type(c).__name__, "state": _encode(c.state, arrays, f"c{i}")}
              for i, c in enumerate(entry.caches)]
    mtp = None if entry.mtp is None else {
        "class": type(entry.mtp).__name__, "state": _encode(entry.mtp.state, arrays, "mtp")}
    if entry.mtp_hidden is not None:
        arrays["hidden"] = mx.contiguous(entry.mtp_hidden)
    mx.eval(list(arrays.values()))
    header: dict[str, object] = {
        "format": FORMAT, "key": list(entry.key), "trimmable": entry.trimmable,
        "mtp_rows": entry.mtp_rows, "has_hidden": entry.mtp_hidden is not None,
        "caches": caches, "mtp": mtp, "fingerprint": fingerprint}
    return _Encoded(entry.key, header, arrays, sum(a.nbytes for a in arrays.values()),
                    entry.trimmable, entry.mtp_rows)


def _rebuild(spec: object, arrays: dict[str, mx.array]) -> CacheEntry:
    if not isinstance(spec, dict) or not isinstance(spec.get("class"), str):
        raise BadEntry("a malformed cache")
    return _cache_maker(spec["class"])(_decode(spec.get("state"), arrays))


def _read_header(f: io.BufferedReader, size: int) -> tuple[bytes, dict[str, object]]:
    """(the digest, the header) of an open entry file; BadEntry when it is not one."""
    head = f.read(_PREFIX)
    if len(head) < _PREFIX or not head.startswith(MAGIC):
        raise BadEntry("not an entry (magic)")
    digest = head[len(MAGIC):len(MAGIC) + _DIGEST]
    (n,) = struct.unpack("<Q", head[-8:])
    if n > size - _PREFIX:
        raise BadEntry("truncated header")
    try:
        header = json.loads(f.read(n))
    except ValueError:
        raise BadEntry("unreadable header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BadEntry("another format")
    return digest, header


def _index_entry(header: dict[str, object], nbytes: int, path: Path) -> DiskEntry:
    key = header.get("key")
    mtp_rows = header.get("mtp_rows")
    if not isinstance(key, list) or len(key) < 2 or not all(type(t) is int for t in key) \
            or type(mtp_rows) is not int:
        raise BadEntry("a malformed key")
    return DiskEntry(tuple(key), bool(header.get("trimmable")), mtp_rows,
                     bool(header.get("has_hidden")), nbytes, path)


def entry_name(key: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:40] + SUFFIX


def write_entry(folder: Path, enc: _Encoded) -> Path:
    """Write `enc` whole or not at all (temporary file, fsync, rename, fsync of the folder)."""
    payload = io.BytesIO()
    mx.save_safetensors(payload, enc.arrays)
    body = payload.getbuffer()
    header = json.dumps(enc.header, separators=(",", ":")).encode()
    length = struct.pack("<Q", len(header))
    digest = hashlib.sha256()
    for part in (length, header, body):
        digest.update(part)
    final = folder / entry_name(enc.key)
    write_atomic(final, (MAGIC, digest.digest(), length, header, body))
    return final


# safetensors' dtype names -> numpy's (BF16 is read as its 16-bit words: numpy has no bfloat16)
_HOST_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16,
                "I16": np.int16, "U32": np.uint32, "I32": np.int32, "U64": np.uint64,
                "I64": np.int64, "F16": np.float16, "BF16": np.uint16, "F32": np.float32,
                "F64": np.float64}


@dataclass
class RawEntry:
    """An entry read and checked without MLX (on any thread, off the model's lock): what the
    index knows of it, its header, and its arrays as host buffers over the file's bytes
    (safetensors' dtype name beside each). `install` makes it a StoredEntry (MLX work)."""
    index: DiskEntry
    header: dict[str, object]
    arrays: dict[str, tuple[np.ndarray, str]]


def _host_arrays(body: memoryview) -> dict[str, tuple[np.ndarray, str]]:
    """The arrays of a safetensors buffer as numpy views of it; BadEntry when it is not one."""
    if len(body) < 8:
        raise BadEntry("truncated arrays")
    (n,) = struct.unpack("<Q", body[:8])
    if n > len(body) - 8:
        raise BadEntry("truncated arrays")
    try:
        table = json.loads(body[8:8 + n].tobytes())
    except ValueError:
        raise BadEntry("malformed arrays") from None
    if not isinstance(table, dict):
        raise BadEntry("malformed arrays")
    data = body[8 + n:]
    out: dict[str, tuple[np.ndarray, str]] = {}
    for name, info in table.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        span = info.get("data_offsets") if isinstance(info, dict) else None
        if dtype not in _HOST_DTYPES or not isinstance(shape, list) or not all(
                type(d) is int and d >= 0 for d in shape) or not isinstance(span, list) \
                or len(span) != 2 or not all(type(o) is int for o in span):
            raise BadEntry(f"array {name!r} malformed")
        host = np.dtype(_HOST_DTYPES[dtype])
        start, end = span
        if not 0 <= start <= end <= len(data) or end - start != host.itemsize * math.prod(shape):
            raise BadEntry(f"array {name!r} out of bounds")
        out[name] = (np.frombuffer(data[start:end], dtype=host).reshape(shape), dtype)
    return out


def _check_spec(spec: object, arrays: dict[str, tuple[np.ndarray, str]]) -> None:
    """A cache's spec names a class mlx-lm has and only arrays the entry holds."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class"), str):
        raise BadEntry("a malformed cache")
    _cache_maker(spec["class"])
    stack: list[object] = [spec.get("state")]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if "a" in value:
                if value["a"] not in arrays:
                    raise BadEntry(f"array {value['a']!r} missing")
            elif isinstance(value.get("t"), list):
                stack.extend(value["t"])
            else:
                raise BadEntry("a malformed state")
        elif isinstance(value, list):
            stack.extend(value)


def read_raw(path: Path, fingerprint: str) -> RawEntry:
    """The entry in `path`, read and checked whole (checksum, format, fingerprint, the header's
    caches against its arrays), without MLX; BadEntry when it is not a whole entry of this
    fingerprint."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _PREFIX or not data.startswith(MAGIC):
        raise BadEntry("not an entry (magic)")
    view = memoryview(data)
    if hashlib.sha256(view[len(MAGIC) + _DIGEST:]).digest() != data[len(MAGIC):
                                                                     len(MAGIC) + _DIGEST]:
        raise BadEntry("checksum mismatch")
    (n,) = struct.unpack("<Q", data[_PREFIX - 8:_PREFIX])
    try:
        header = json.loads(view[_PREFIX:_PREFIX + n].tobytes())
    except ValueError:
        raise BadEntry("unreadable header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BadEntry("another format")
    if header.get("fingerprint") != fingerprint:
        raise BadEntry("another model's entry")
    index = _index_entry(header, len(data), path)
    arrays = _host_arrays(view[_PREFIX + n:])
    specs = header.get("caches")
    if not isinstance(specs, list):
        raise BadEntry("a malformed header")
    for spec in [*specs, *([header["mtp"]] if header.get("mtp") is not None else [])]:
        _check_spec(spec, arrays)
    if index.has_hidden and "hidden" not in arrays:
        raise BadEntry("array 'hidden' missing")
    return RawEntry(index, header, arrays)


def install(raw: RawEntry) -> StoredEntry:
    """A read entry's caches as MLX arrays (copied from the host buffers, evaluated): the MLX
    work of a load, for the thread that holds the model."""
    arrays: dict[str, mx.array] = {}
    for name, (host, dtype) in raw.arrays.items():
        a = mx.array(host)
        arrays[name] = a.view(mx.bfloat16) if dtype == "BF16" else a
    try:
        caches = [_rebuild(s, arrays) for s in cast(list[object], raw.header["caches"])]
        mtp = None if raw.header.get("mtp") is None else _rebuild(raw.header["mtp"], arrays)
    except (TypeError, ValueError, AttributeError) as e:
        raise BadEntry(f"caches cannot be rebuilt: {e}") from None
    index = raw.index
    hidden = arrays.get("hidden") if index.has_hidden else None
    mx.eval(list(arrays.values()))
    return StoredEntry(index.key, caches, mtp, index.mtp_rows, hidden, index.trimmable)


def read_entry(path: Path, fingerprint: str) -> StoredEntry:
    """The entry in `path`, checked whole; BadEntry when it is not a whole entry of this
    fingerprint."""
    return install(read_raw(path, fingerprint))


def cache_identity(model_id: str, dtype: str, part: str = "") -> list[str]:
    """What besides the weights decides an entry's bits, for `weights_fingerprint`: the model's
    id and dtype, the part of it held (a ring stage's layers, a tensor rank's shard), the
    versions of mlx and mlx-lm."""
    return [model_id, dtype, f"mlx {_version('mlx')}", f"mlx-lm {_version('mlx-lm')}",
            *([part] if part else [])]


def _version(dist: str) -> str:
    """A library's installed version (what computed the caches), or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------ folders

_FP_CHARS = 16  # of the fingerprint, in the folder's name
_FOLDER = re.compile(r"(.+)-([0-9a-f]{16})")


def store_folder(root: Path, model_id: str, fingerprint: str, part: str = "") -> Path:
    """The folder of a model's entries under `root`: its id (made safe as a name), the part of
    the model held (a ring stage's layers, after an "@") and the start of its fingerprint."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", model_id)[:80] or "_"
    if part:
        name += "@" + re.sub(r"[^A-Za-z0-9._-]", "_", part)[:40]
    return Path(root) / f"{name}-{fingerprint[:_FP_CHARS]}"


@dataclass(frozen=True)
class _Superseded:
    """A folder of the same model and part under another fingerprint (other weights, dtype or
    library versions): its entries are never loaded by this store."""
    path: Path
    nbytes: int  # its entry files' sizes
    used: float  # the newest file's time


def _superseded(folder: Path) -> list[_Superseded]:
    """The other folders beside `folder` of the same model and part (a ring stage's layers, a
    tensor rank's shard: another part's folder may belong to a live neighbour on this data dir)
    under other fingerprints, least recently used first. Only folders named as `store_folder`
    names them and holding the lock file every store creates (a live process's lock keeps its
    folder: remove_superseded)."""
    m = _FOLDER.fullmatch(folder.name)
    if m is None:
        return []
    out: list[_Superseded] = []
    try:
        siblings = list(folder.parent.iterdir())
    except OSError:
        return []
    for path in siblings:
        other = _FOLDER.fullmatch(path.name)
        if path == folder or other is None or other.group(1) != m.group(1):
            continue
        try:
            if path.is_symlink() or not path.is_dir() or not (path / LOCK_NAME).is_file():
                continue
            files = [f.stat() for f in path.iterdir() if f.name.endswith(SUFFIX)]
        except OSError:
            continue
        out.append(_Superseded(path, sum(f.st_size for f in files),
                               max((f.st_mtime for f in files), default=0.0)))
    return sorted(out, key=lambda s: s.used)


def remove_superseded(path: Path) -> bool:
    """Remove a superseded store's folder: its lock taken first (a live process holding it
    keeps it), then only what a store writes there (entry files that start as entries do,
    temporary files, the lock file), then the folder if nothing else is left. Whether the
    folder is gone."""
    try:
        fd = _lock(path)
    except (StoreInUse, OSError):
        return False
    try:
        for f in path.iterdir():
            if f.name.endswith(TMP_SUFFIX) and f.is_file() and not f.is_symlink():
                f.unlink(missing_ok=True)
            elif f.name.endswith(SUFFIX) and f.is_file() and not f.is_symlink():
                with open(f, "rb") as entry:
                    ours = entry.read(len(MAGIC)) == MAGIC
                if ours:
                    f.unlink(missing_ok=True)
        (path / LOCK_NAME).unlink(missing_ok=True)
    except OSError as e:
        log.warning("prefix cache: removing superseded entries in %s failed: %s", path, e)
        return False
    finally:
        os.close(fd)
    try:
        path.rmdir()
    except OSError:
        return False  # something not ours is left there: the folder stays
    return True


# ------------------------------------------------------------------------------ the store

class PrefixDiskStore:
    """One model's entries in `folder`, at most `max_bytes`, written behind by a thread."""

    def __init__(self, folder: Path, max_bytes: int, fingerprint: str):
        if max_bytes <= 0:
            raise ValueError("a disk store needs a positive size (0 turns it off: no store)")
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self.fingerprint = fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = _lock(self.folder)
        self._lock = threading.Condition()
        self._trie = PromptTrie()
        self._lru: OrderedDict[tuple[int, ...], DiskEntry] = OrderedDict()
        self.nbytes = 0
        self._pending: deque[_Encoded] = deque()
        self._pending_bytes = 0
        self._writing = False
        self._touched: set[Path] = set()
        self._closed = False
        # Counters for reports.
        self.writes = 0
        self.dropped = 0  # queued entries dropped (the queue was full, or the write failed)
        self.loads = 0
        self.refused = 0  # files refused (checksum, format, fingerprint) and removed
        self.superseded_removed = 0  # folders of the model's other fingerprints removed
        # The model's folders under other fingerprints, counted against the bound: removed
        # whole, least recently used first, before any entry of this one when room is needed.
        self._superseded = _superseded(self.folder)
        self._scan()
        self._thread = threading.Thread(target=self._run, name="prefix-disk-writer",
                                        daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def entries(self) -> list[DiskEntry]:
        """The entries on disk, least recently used first."""
        with self._lock:
            return list(self._lru.values())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"disk_entries": len(self._lru), "disk_bytes": self.nbytes,
                    "disk_max_bytes": self.max_bytes, "disk_writes": self.writes,
                    "disk_loads": self.loads, "disk_refused": self.refused,
                    "disk_pending": len(self._pending) + int(self._writing),
                    "disk_dropped": self.dropped,
                    "disk_superseded_removed": self.superseded_removed}

    # ------------------------------------------------------------------------- startup

    def _scan(self) -> None:
        """Index the folder from the files' headers, oldest use first; remove what a killed
        writer left and every file that is not an entry of this fingerprint."""
        found: list[tuple[float, DiskEntry]] = []
        for path in self.folder.iterdir():
            if path.name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    _, header = _read_header(f, st.st_size)
                if header.get("fingerprint") != self.fingerprint:
                    raise BadEntry("another model's entry")
                entry = _index_entry(header, st.st_size, path)
            except (OSError, BadEntry) as e:
                log.warning("prefix cache: %s refused (%s): removed", path.name, e)
                self.refused += 1
                path.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, entry))
        for _, entry in sorted(found, key=lambda f: f[0]):
            self._add(entry)
        self._evict()
        if self._lru:
            log.info("prefix cache: %d entries (%.1f MB) on disk in %s", len(self._lru),
                     self.nbytes / 1e6, self.folder)

    # ------------------------------------------------------------------------- lookups

    def candidates(self, tokens: list[int]) -> list[tuple[DiskEntry, int | None]]:
        """The entries that may serve `tokens`: (entry, None) for one whose key is a prefix of
        them, (entry, common) for the shortest one past where they leave the trie."""
        with self._lock:
            if not self._lru:
                return []
            found = self._trie.search(_NS, tokens)
            out: list[tuple[DiskEntry, int | None]] = []
            for key, common in ((found.exact, None), (found.shorter, None),
                                (found.longer, found.common_prefix)):
                e = None if key is None else self._lru.get(tuple(key))
                if e is not None and all(e is not o for o, _ in out):  # (one, at most once)
                    out.append((e, common))
            return out

    def load(self, entry: DiskEntry) -> StoredEntry | None:
        """The entry's contents, or None when its file is gone or refused (then removed)."""
        raw = self.read(entry)
        return self.install(raw) if raw is not None else None

    def read(self, entry: DiskEntry) -> RawEntry | None:
        """The entry's file read and checked, without MLX (any thread: the file read, the
        checksum and the parse happen off the model's lock); None when it is gone or refused
        (then removed)."""
        try:
            return read_raw(entry.path, self.fingerprint)
        except (OSError, BadEntry) as e:
            self._refuse(entry, e)
            return None

    def install(self, raw: RawEntry) -> StoredEntry | None:
        """A read entry as caches (MLX work: on the thread that holds the model), or None when
        its caches cannot be rebuilt (its file is then removed)."""
        try:
            stored = install(raw)
        except BadEntry as e:
            self._refuse(raw.index, e)
            return None
        self.touch(raw.index.key)
        with self._lock:
            self.loads += 1
        return stored

    def _refuse(self, entry: DiskEntry, why: Exception) -> None:
        log.warning("prefix cache: %s refused (%s): removed", entry.path.name, why)
        with self._lock:
            self.refused += 1
            held = self._lru.get(entry.key)
            if held is not None and held.path == entry.path:
                self._remove(entry.key)
            else:
                entry.path.unlink(missing_ok=True)

    def touch(self, key: tuple[int, ...]) -> None:
        """A use: the entry goes last out (its file's time is set by the writer)."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
                self._touched.add(entry.path)
                self._lock.notify_all()

    def has(self, key: tuple[int, ...], mtp_rows: int = 0) -> bool:
        with self._lock:
            entry = self._lru.get(key)
            return entry is not None and entry.mtp_rows >= mtp_rows

    # ------------------------------------------------------------------------- writing

    def put(self, entry: StoredEntry) -> bool:
        """Queue `entry` for writing; its arrays are copied now (contiguous), so the caller's
        may change. False when it is not written (on disk already, too big, or a cache type
        that cannot be rebuilt)."""
        if self._closed or self.has(entry.key, entry.mtp_rows):
            return False
        if not all(writable(c) for c in entry.caches) or (
                entry.mtp is not None and not writable(entry.mtp)):
            log.debug("prefix cache: an entry with caches of other types is not written")
            return False
        enc = encode(entry, self.fingerprint)
        if enc.nbytes > self.max_bytes:
            return False
        limit = min(MAX_PENDING_BYTES, self.max_bytes)
        with self._lock:
            if enc.trimmable:  # queued prefixes of it are served by it
                kept = [p for p in self._pending if not _covers(enc, p)]
                self.dropped += len(self._pending) - len(kept)
                self._pending = deque(kept)
                self._pending_bytes = sum(p.nbytes for p in kept)
            while self._pending and self._pending_bytes + enc.nbytes > limit:
                old = self._pending.popleft()
                self._pending_bytes -= old.nbytes
                self.dropped += 1
            self._pending.append(enc)
            self._pending_bytes += enc.nbytes
            self._lock.notify_all()
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued entry is written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or self._writing or self._touched:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.5))
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (for up to `timeout` s), then stop the writer."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._touched and not self._closed:
                    self._lock.wait()
                if self._closed and not self._pending:
                    return
                touched, self._touched = self._touched, set()
                enc = self._pending.popleft() if self._pending else None
                if enc is not None:
                    self._pending_bytes -= enc.nbytes
                self._writing = True
            try:
                for path in touched:
                    try:
                        os.utime(path)
                    except OSError:
                        pass
                if enc is not None:
                    self._write(enc)
            except Exception:  # a full disk, a folder removed: the entry is not kept
                log.exception("prefix cache: writing an entry to %s failed", self.folder)
                with self._lock:
                    self.dropped += 1
            finally:
                with self._lock:
                    self._writing = False
                    self._lock.notify_all()

    def _write(self, enc: _Encoded) -> None:
        if self.has(enc.key, enc.mtp_rows):
            return
        path = write_entry(self.folder, enc)
        entry = DiskEntry(enc.key, enc.trimmable, enc.mtp_rows,
                          "hidden" in enc.arrays, path.stat().st_size, path)
        with self._lock:
            if enc.key in self._lru:
                self._forget(enc.key)
            self._add(entry)
            self.writes += 1
            if entry.trimmable:
                for _, old in self._trie.pop_prefixes(_NS, list(entry.key)):
                    if old.mtp_rows <= entry.mtp_rows:  # served by the new one, trimmed
                        self._lru.pop(old.key, None)
                        self.nbytes -= old.nbytes
                        old.path.unlink(missing_ok=True)
                    else:
                        self._trie.add(_NS, list(old.key), old)
            self._evict()

    # ------------------------------------------------------------------------- the index

    def _add(self, entry: DiskEntry) -> None:
        self._trie.add(_NS, list(entry.key), entry)
        self._lru[entry.key] = entry
        self.nbytes += entry.nbytes

    def _forget(self, key: tuple[int, ...]) -> DiskEntry:
        entry = self._lru.pop(key)
        self._trie.pop(_NS, list(key))
        self.nbytes -= entry.nbytes
        return entry

    def _remove(self, key: tuple[int, ...]) -> None:
        self._forget(key).path.unlink(missing_ok=True)

    def _evict(self) -> None:
        while self._superseded and self.nbytes + sum(
                s.nbytes for s in self._superseded) > self.max_bytes:
            old = self._superseded.pop(0)
            if remove_superseded(old.path):
                self.superseded_removed += 1
                log.info("prefix cache: removed %s (%.1f MB), entries of other weights of this "
                         "model", old.path.name, old.nbytes / 1e6)
        while self.nbytes > self.max_bytes and self._lru:
            self._remove(next(iter(self._lru)))


def _covers(new: _Encoded, old: _Encoded) -> bool:
    return (len(old.key) < len(new.key) and new.key[:len(old.key)] == old.key
            and old.mtp_rows <= new.mtp_rows)


def _lock(folder: Path) -> int:
    """An exclusive lock on the folder for this process (released however it ends)."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StoreInUse(f"another process uses the prefix cache in {folder}") from None
        raise
    return fd
