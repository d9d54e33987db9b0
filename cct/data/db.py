"""Databases of serialized records, read and written as Caffe's ``db_lmdb.cpp`` and ``db_leveldb.cpp`` do.

**LMDB**: reading opens the environment read-only without a lock file and without read-ahead, so databases
on read-only media work; records come in key (byte) order and the cursor wraps to the first record at the
end.  Writing buffers one transaction's puts and, when LMDB reports the map full, doubles the map size and
writes the transaction again (Caffe's ``LMDBTransaction::Commit``).

**LevelDB** (``backend: LEVELDB``, the default of ``data_param.backend`` in caffe.proto): through plyvel, the
optional ``leveldb`` extra (``pip install 'cct[leveldb]'``), imported when a LevelDB is first opened; without
it, one line says what to install.  Records come in LevelDB's bytewise key order, as Caffe's iterator gives
them; a new database is created with Caffe's options (256 MiB write buffer, at most 100 open files, an
existing one refused) and written in batches of one commit each.  LevelDB lets one process open a database
once, so readers in one process (a train and a test net on the same source) share it.

Many Caffe prototxts omit ``backend`` (LEVELDB) although their source is an LMDB: such a source is read as
LMDB with a warning.  :func:`open_reader`, :func:`open_writer` and :func:`iterate_records` choose the
implementation from the backend name or number.
"""
from __future__ import annotations

import itertools
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


LMDB, LEVELDB = "lmdb", "leveldb"


def is_lmdb(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "data.mdb"))


def is_leveldb(path: str) -> bool:
    """A LevelDB directory has a CURRENT file naming its manifest."""
    return os.path.isfile(os.path.join(path, "CURRENT"))


def backend_name(backend: int | str) -> str:
    """``DataParameter.LMDB``/``LEVELDB`` or a command line's ``lmdb``/``leveldb`` → ``"lmdb"``/``"leveldb"``."""
    if isinstance(backend, str):
        name = backend.lower()
        if name not in (LMDB, LEVELDB):
            raise CctError(f"-backend {backend}: unknown database backend (lmdb or leveldb)")
        return name
    return LEVELDB if backend == pb.DataParameter.LEVELDB else LMDB


def resolve_source(source: str, backend: int | str, field: str = "data_param") -> tuple[str, str]:
    """Check a Data layer's ``source``/``backend``; return ``(path, "lmdb" | "leveldb")``.

    An absent source is an error naming it; LEVELDB with an LMDB directory is read as LMDB with a warning;
    a directory that is not a database of the backend is an error naming what it is."""
    if not source:
        raise ParamError(f"{field}.source", "no database given (source is empty)")
    if not os.path.exists(source):
        raise CctError(f"{field}.source: database {source} does not exist")
    name = backend_name(backend)
    if name == LEVELDB:
        if is_leveldb(source):
            return source, LEVELDB
        if is_lmdb(source):
            log.warning("%s.backend is LEVELDB (the default) but %s is an LMDB: reading it as LMDB "
                        "(add `backend: LMDB` to silence this)", field, source)
            return source, LMDB
        raise CctError(f"{field}.source: {source} is not a LevelDB directory (no CURRENT file in it)")
    if not is_lmdb(source):
        hint = " (it is a LevelDB: use `backend: LEVELDB`)" if is_leveldb(source) else ""
        raise CctError(f"{field}.source: {source} is not an LMDB directory (no data.mdb in it){hint}")
    return source, LMDB


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
        self._start = 0

    def first(self) -> tuple[bytes, bytes]:
        with self._env.begin(buffers=False) as txn:
            cur = txn.cursor()
            if not cur.first():
                raise CctError(f"{self.path}: the database is empty")
            return bytes(cur.key()), bytes(cur.value())

    def next(self) -> tuple[bytes, memoryview]:
        """The record at the cursor; then advance, wrapping to the first record at the end.

        The value is a zero-copy view into the database, valid until :meth:`close`."""
        key, value = self.take(1)[0]
        return bytes(key), value

    def take(self, n: int) -> list[tuple[memoryview, memoryview]]:
        """The next ``n`` records (:meth:`next` ``n`` times, in one call), key and value as zero-copy views into
        the database, valid until :meth:`close`."""
        cursor = self._cursor
        if cursor is None:
            self._txn = self._env.begin(buffers=True)
            cursor = self._cursor = self._txn.cursor()
            if not cursor.first():
                raise CctError(f"{self.path}: the database is empty")
            for _ in range(self._start):
                cursor.next()
            self._start = 0
        out: list[tuple[memoryview, memoryview]] = []
        while len(out) < n:
            want = n - len(out)
            out.extend(itertools.islice(cursor.iternext(), want))  # from the record at the cursor on
            # the cursor is on the last record taken, or past the end when there were fewer
            if len(out) < n or not cursor.next():
                log.debug("Restarting data prefetching from start.")  # DLOG in Caffe: silent in release builds
                cursor.first()
        return out

    def skip(self) -> None:
        """Advance without reading (multi-rank sharding)."""
        self.next()

    def seek(self, offset: int) -> None:
        """Put the cursor on record ``offset`` (counted from the first, wrapping around); the transaction
        is opened by the next :meth:`next`, in the thread that reads."""
        self.close()
        self._start = offset % len(self)

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


# ---- LevelDB ---------------------------------------------------------------------------------------------

def _plyvel():
    try:
        import plyvel
    except ImportError:
        raise CctError("LevelDB databases need plyvel: pip install 'cct[leveldb]' (or convert the database "
                       "to LMDB and use `backend: LMDB`)") from None
    return plyvel


_leveldbs: dict[str, list] = {}  # realpath -> [plyvel.DB, number of users]; LevelDB allows one open per process
_leveldbs_lock = threading.RLock()


def _acquire_leveldb(path: str):
    plyvel = _plyvel()
    key = os.path.realpath(path)
    with _leveldbs_lock:
        entry = _leveldbs.get(key)
        if entry is None:
            try:
                db = plyvel.DB(path, create_if_missing=False, max_open_files=100)
            except plyvel.Error as e:
                raise CctError(f"{path}: cannot open as a LevelDB ({e})") from None
            entry = _leveldbs[key] = [db, 0]
        entry[1] += 1
        return entry[0], key


def _release_leveldb(key: str) -> None:
    with _leveldbs_lock:
        entry = _leveldbs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _leveldbs[key]
            entry[0].close()


class LeveldbReader:
    """Records of a LevelDB in key order, cycling forever (the interface of :class:`LmdbReader`).

    The iterator is created by the first :meth:`next` call, in the thread that calls it."""

    def __init__(self, path: str):
        self.path = path
        self._db, key = _acquire_leveldb(path)
        weakref.finalize(self, _release_leveldb, key)
        self._it = None

    def first(self) -> tuple[bytes, bytes]:
        it = self._db.raw_iterator()
        it.seek_to_first()
        if not it.valid():
            raise CctError(f"{self.path}: the database is empty")
        return it.key(), it.value()

    def next(self) -> tuple[bytes, bytes]:
        """The record at the iterator; then advance, wrapping to the first record at the end."""
        if self._it is None:
            self._it = self._db.raw_iterator()
            self._it.seek_to_first()
            if not self._it.valid():
                raise CctError(f"{self.path}: the database is empty")
        key, value = self._it.key(), self._it.value()
        self._it.next()
        if not self._it.valid():
            log.debug("Restarting data prefetching from start.")
            self._it.seek_to_first()
        return key, value

    def take(self, n: int) -> list[tuple[bytes, bytes]]:
        """The next ``n`` records."""
        return [self.next() for _ in range(n)]

    def skip(self) -> None:
        self.next()

    def seek(self, offset: int) -> None:
        """Put the iterator on record ``offset`` (counted from the first, wrapping around)."""
        self._it = self._db.raw_iterator()
        self._it.seek_to_first()
        if not self._it.valid():
            raise CctError(f"{self.path}: the database is empty")
        for _ in range(offset % len(self)):
            self._it.next()

    def close(self) -> None:
        self._it = None

    def __len__(self) -> int:
        return sum(1 for _ in self._db.iterator(include_value=False))


def iterate_leveldb(path: str) -> Iterator[tuple[bytes, bytes]]:
    """Every record once, in key order."""
    db, key = _acquire_leveldb(path)
    try:
        yield from db.iterator()
    finally:
        _release_leveldb(key)


class LeveldbWriter:
    """A new LevelDB (``db::NEW``: an existing database is refused).  ``put`` buffers; ``commit`` writes the
    buffered records as one batch."""

    def __init__(self, path: str):
        plyvel = _plyvel()
        try:
            self.db = plyvel.DB(path, create_if_missing=True, error_if_exists=True,
                                write_buffer_size=256 * 1024 * 1024, max_open_files=100, block_size=65536)
        except plyvel.Error as e:
            raise CctError(f"{path}: cannot create a LevelDB ({e})") from None
        self.path = path
        self._batch = self.db.write_batch()
        log.info("Opened leveldb %s", path)

    def put(self, key: bytes, value: bytes) -> None:
        self._batch.put(key, value)

    def commit(self) -> None:
        self._batch.write()
        self._batch = self.db.write_batch()

    def close(self) -> None:
        self.commit()
        self.db.close()


# ---- by backend ------------------------------------------------------------------------------------------

def open_reader(source: str, backend: int | str, field: str = "data_param") -> LmdbReader | LeveldbReader:
    """A cycling reader of a Data layer's source (see :func:`resolve_source`)."""
    path, kind = resolve_source(source, backend, field)
    return LeveldbReader(path) if kind == LEVELDB else LmdbReader(path)


def open_writer(path: str, backend: int | str) -> LmdbWriter | LeveldbWriter:
    """A new database of the backend at ``path``."""
    return LeveldbWriter(path) if backend_name(backend) == LEVELDB else LmdbWriter(path)


def iterate_records(path: str, backend: int | str, what: str = "database") -> Iterator[tuple[bytes, bytes]]:
    """Every record of an existing database once, in key order; one-line errors for a wrong path or kind."""
    if not os.path.exists(path):
        raise CctError(f"{what} {path} does not exist")
    if backend_name(backend) == LEVELDB:
        if not is_leveldb(path):
            raise CctError(f"{what} {path} is not a LevelDB database (no CURRENT file in it)")
        return iterate_leveldb(path)
    if not is_lmdb(path):
        hint = " (it is a LevelDB: -backend leveldb)" if is_leveldb(path) else ""
        raise CctError(f"{what} {path} is not an LMDB database (no data.mdb in it){hint}")
    return iterate_lmdb(path)
