"""LMDB databases of serialized records, read and written as Caffe's ``db_lmdb.cpp`` does.

Reading opens the environment read-only without a lock file and without read-ahead, so databases on
read-only media work; records come in key (byte) order and the cursor wraps to the first record at the
end.  Writing buffers one transaction's puts and, when LMDB reports the map full, doubles the map size
and writes the transaction again (Caffe's ``LMDBTransaction::Commit``).

LevelDB is not supported.  ``data_param.backend`` defaults to LEVELDB in caffe.proto, and many Caffe
prototxts omit it although their source is an LMDB: such a source is read as LMDB with a warning.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator

from cct import log
from cct.errors import CctError, ParamError
from cct.proto import caffe_pb2 as pb

_MAP_SIZE = 10 * 1024 * 1024  # LMDB's default map size; doubled whenever a commit finds it full


def _lmdb():
    import lmdb

    return lmdb


def is_lmdb(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "data.mdb"))


def resolve_source(source: str, backend: int, field: str = "data_param") -> str:
    """Check a Data layer's ``source``/``backend``; return the LMDB path.

    An absent source is an error naming it; LEVELDB with an LMDB directory is accepted with a warning;
    LEVELDB otherwise is refused."""
    if not source:
        raise ParamError(f"{field}.source", "no database given (source is empty)")
    if not os.path.exists(source):
        raise CctError(f"{field}.source: database {source} does not exist")
    if backend == pb.DataParameter.LEVELDB:
        if is_lmdb(source):
            log.warning("%s.backend is LEVELDB (the default) but %s is an LMDB: reading it as LMDB "
                        "(add `backend: LMDB` to silence this)", field, source)
            return source
        raise ParamError(f"{field}.backend", f"LevelDB is not supported ({source}); convert the database "
                                             "to LMDB and use `backend: LMDB`")
    if not is_lmdb(source):
        raise CctError(f"{field}.source: {source} is not an LMDB directory (no data.mdb in it)")
    return source


_envs: dict[str, list] = {}  # realpath -> [read-only Environment, number of users]
# Re-entrant: opening an environment can run the garbage collector, whose finalizers call _release_env
# in this very thread while _acquire_env holds the lock.
_envs_lock = threading.RLock()


def _acquire_env(path: str):
    """The process-wide read-only environment of ``path`` (LMDB forbids opening one twice), counted."""
    lmdb = _lmdb()
    key = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(key)
        if entry is None:
            try:
                env = lmdb.open(path, readonly=True, lock=False, readahead=False, subdir=True,
                                max_readers=512, max_spare_txns=0)
            except lmdb.Error as e:
                raise CctError(f"{path}: cannot open as an LMDB ({e})") from None
            entry = _envs[key] = [env, 0]
        entry[1] += 1
        return entry[0], key


def _release_env(key: str) -> None:
    with _envs_lock:
        entry = _envs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _envs[key]
            entry[0].close()


class LmdbReader:
    """Records of an LMDB in key order, cycling forever.

    The read transaction and cursor are created by the first :meth:`next` call, in the thread that
    calls it (the prefetch thread); :meth:`first` uses its own short transaction."""

    def __init__(self, path: str):
        self.path = path
        self._env, key = _acquire_env(path)
        weakref.finalize(self, _release_env, key)
        self._txn = None
        self._cursor = None

    def first(self) -> tuple[bytes, bytes]:
        with self._env.begin(buffers=False) as txn:
            cur = txn.cursor()
            if not cur.first():
                raise CctError(f"{self.path}: the database is empty")
            return bytes(cur.key()), bytes(cur.value())

    def next(self) -> tuple[bytes, memoryview]:
        """The record at the cursor; then advance, wrapping to the first record at the end.

        The value is a zero-copy view into the database, valid until :meth:`close`."""
        if self._cursor is None:
            self._txn = self._env.begin(buffers=True)
            self._cursor = self._txn.cursor()
            if not self._cursor.first():
                raise CctError(f"{self.path}: the database is empty")
        key, value = self._cursor.item()
        key = bytes(key)
        if not self._cursor.next():
            log.debug("Restarting data prefetching from start.")  # DLOG in Caffe: silent in release builds
            self._cursor.first()
        return key, value

    def skip(self) -> None:
        """Advance without reading (multi-rank sharding)."""
        self.next()

    def close(self) -> None:
        if self._txn is not None:
            self._txn.abort()
        self._txn = self._cursor = None

    def __len__(self) -> int:
        return self._env.stat()["entries"]


def iterate_lmdb(path: str) -> Iterator[tuple[bytes, bytes]]:
    """Every record once, in key order."""
    env, key = _acquire_env(path)
    try:
        with env.begin(buffers=False) as txn:
            yield from txn.cursor()
    finally:
        _release_env(key)


class LmdbWriter:
    """A new LMDB (``db::NEW``): the directory must not exist.  ``put`` buffers; ``commit`` writes."""

    def __init__(self, path: str):
        lmdb = _lmdb()
        try:
            os.mkdir(path, 0o744)
        except OSError as e:
            raise CctError(f"mkdir {path} failed ({e.strerror})") from None
        self.path = path
        self._map_size = _MAP_SIZE
        self.env = lmdb.open(path, map_size=self._map_size, subdir=True, readahead=False, meminit=False)
        self._pending: list[tuple[bytes, bytes]] = []
        log.info("Opened lmdb %s", path)

    def put(self, key: bytes, value: bytes) -> None:
        self._pending.append((key, value))

    def commit(self) -> None:
        lmdb = _lmdb()
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in self._pending:
                        txn.put(k, v)
                break
            except lmdb.MapFullError:
                self._map_size *= 2
                log.info("Doubling LMDB map size to %dMB ...", self._map_size >> 20)
                self.env.set_mapsize(self._map_size)
        self._pending.clear()

    def close(self) -> None:
        if self._pending:
            self.commit()
        self.env.close()
