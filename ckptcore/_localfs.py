"""Local-disk operations of the storage layer (``_storage.LocalStore`` is a thin front for them).

Local paths use ``os`` directly: fsync, rename, ``O_NOFOLLOW`` and mmap are only reachable there.

Containment: every file read from a checkpoint is opened with ``O_NOFOLLOW`` and checked with
``fstat`` on that same descriptor to be a regular file, so a symbolic link, FIFO, device, socket or
directory where a file belongs raises :class:`UnsafeCheckpointError` instead of reading something
outside the checkpoint (or blocking on a pipe).  Deleting never follows links.

Durability: a failed write, flush, fsync or close raises, naming the file (an fsync's EIO names
none by itself): a save must fail rather than report a checkpoint the disk may not hold.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import stat
import sys
from typing import Any, Callable

from .errors import CheckpointError, UnsafeCheckpointError

log = logging.getLogger("ckptcore")

# Reading a checkpoint's file: never through a link; a FIFO must not block the open; no
# controlling terminal from a tty; not inherited by children.
_READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))

# A listing's entry: (name, is_dir, mtime, is_link, size); _storage makes an Entry of it.
Listed = tuple[str, bool, float, bool, int]


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a special file (mode {mode:#o})"


def _link_error(path: str) -> UnsafeCheckpointError:
    try:
        target = f" to {os.readlink(path)!r}"
    except OSError:
        target = ""
    return UnsafeCheckpointError(
        f"{path}: is a symbolic link{target}, not a regular file; ckptcore never follows links "
        "inside a checkpoint (one could lead outside it). Replace the link with the file itself")


def open_regular(path: str, *, in_folder: bool = False) -> tuple[int, os.stat_result]:
    """Open a local file for reading without following a link: ``(fd, fstat of fd)``.

    ``in_folder``: the file's own folder is inside the checkpoint too (a nested shard,
    ``3f/shard-...``), so it must not be a link either: it is opened first without following
    one, and the file relative to it (``O_NOFOLLOW`` guards the last component only).

    Raises ``FileNotFoundError`` when absent and :class:`UnsafeCheckpointError` (naming the path
    and what is there) for anything but a regular file.  The caller closes ``fd``; sizes must come
    from the returned stat, and data from this descriptor, so nothing can be swapped in between.
    """
    try:
        fd = _open_in_folder(path) if in_folder else os.open(path, _READ_FLAGS)
    except OSError as e:
        # O_NOFOLLOW on a link gives ELOOP (EMLINK on FreeBSD, EFTYPE on NetBSD).
        if e.errno in (errno.ELOOP, errno.EMLINK, getattr(errno, "EFTYPE", -1)) \
                and os.path.islink(path):
            raise _link_error(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(
                f"{path}: is {file_kind(st.st_mode)}, not a regular file; a checkpoint holds only "
                "regular files (remove it, or restore the file from a good copy)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _open_in_folder(path: str) -> int:
    """``path`` opened relative to its folder, the folder opened without following a link:
    :class:`UnsafeCheckpointError` when the folder is a link or not a folder at all."""
    folder, name = os.path.split(path)
    try:
        dfd = os.open(folder, _DIR_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        try:
            mode = os.lstat(folder).st_mode
        except OSError:
            raise e from None
        if stat.S_ISLNK(mode):
            raise _link_error(folder) from None
        what = "a regular file" if stat.S_ISREG(mode) else file_kind(mode)
        raise UnsafeCheckpointError(
            f"{folder}: is {what}, not a folder; a checkpoint's shard folders are plain "
            "folders") from None
    try:
        return os.open(name, _READ_FLAGS, dir_fd=dfd)
    finally:
        os.close(dfd)


def read_file(path: str, max_bytes: int | None, check: Callable[[int], None], *,
              in_folder: bool = False) -> bytes:
    """The whole regular file at ``path``, never through a link (``in_folder``: nor through its
    folder, see :func:`open_regular`); ``check(size)`` is called with its size before any of it
    is read, and with the length read when ``max_bytes`` is given."""
    fd, st = open_regular(path, in_folder=in_folder)
    with open(fd, "rb", closefd=True) as f:
        check(st.st_size)
        if max_bytes is None:
            return f.read()
        # Ask for what fstat said (a read's buffer is allocated at the size asked for),
        # then for the rest up to the limit in case it grew since.
        data = f.read(st.st_size + 1)
        if len(data) > st.st_size:
            data += f.read(max_bytes + 1 - len(data))
        check(len(data))
        return data


def scan(path: str, details: bool = True) -> list[Listed]:
    """Entries directly below ``path`` (links as links); empty when it does not exist.
    ``details=False``: no mtime or size (no ``stat`` per entry: a root of thousands of steps)."""
    try:
        with os.scandir(path) as it:
            out = []
            for e in it:
                st = e.stat(follow_symlinks=False) if details else None
                out.append((e.name, e.is_dir(follow_symlinks=False),
                            st.st_mtime if st else None, e.is_symlink(),
                            st.st_size if st else None))
            return out
    except (FileNotFoundError, NotADirectoryError):
        return []


def walk(path: str) -> list[Listed]:
    """Every file below ``path``, named relative to it with ``/``; links are listed as links and
    never followed."""
    out = []
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            full = os.path.join(top, name)
            st = os.lstat(full)
            out.append((os.path.relpath(full, path).replace(os.sep, "/"), False,
                        st.st_mtime, stat.S_ISLNK(st.st_mode), st.st_size))
    return out


def write_file(path: str, data: bytes, *, create_only: bool) -> None:
    """Write a whole file durably; any write/fsync/close error is raised, naming the file."""
    f = open(path, "xb" if create_only else "wb")
    try:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
        close_quietly(f, path)
        raise named_error(e, "write or fsync", path) from e
    except BaseException:
        close_quietly(f, path)
        raise
    try:
        f.close()
    except OSError as e:
        raise named_error(e, "close", path) from e


def unlink(path: str) -> None:
    """Remove one file; nothing if absent.  A link is removed itself, never its target, and nothing
    is deleted through a link (a folder that is a link raises :class:`UnsafeCheckpointError`)."""
    parent, name = os.path.split(path)
    try:
        dfd = os.open(parent, _DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError as e:
        if os.path.islink(parent):
            raise UnsafeCheckpointError(
                f"{parent}: is a symbolic link; refusing to delete {name} through it "
                "(that would delete a file wherever the link points)") from e
        if e.errno == errno.ENOTDIR:
            return  # a file where the folder was: nothing to delete under it
        raise
    try:
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            log.warning("%s: is a symbolic link; removing the link itself, not its target",
                        path)
        elif stat.S_ISDIR(st.st_mode):  # (unlink would raise a bare IsADirectoryError)
            raise UnsafeCheckpointError(
                f"{path}: is a folder where a checkpoint holds a file; not deleting it "
                "(remove it by hand)")
        os.unlink(name, dir_fd=dfd)  # unlink never follows a link
    except FileNotFoundError:
        pass
    finally:
        os.close(dfd)


def remove_tree(path: str, url: str) -> None:
    """Remove a folder and everything in it; nothing if absent.  Never follows a link (a link at
    ``path`` is removed itself and logged; links inside are removed as links); a file that cannot
    be removed is logged (under ``url``) and left for ``gc()``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        # rmtree refuses a link and, with ignore_errors, would silently leave it.
        log.warning("%s: is %s, not a folder; removing it itself%s", path, file_kind(st.st_mode),
                    " (its target is untouched)" if stat.S_ISLNK(st.st_mode) else "")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return

    def failed(func: Any, p: str, exc: Any) -> None:
        err = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(err, FileNotFoundError):
            log.warning("%s: could not remove %s (%s: %s); left for gc()", url, p,
                        type(err).__name__, err)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=failed)
    else:
        shutil.rmtree(path, onerror=failed)


def named_error(e: OSError, op: str, path: str) -> OSError:
    """``e`` with ``path`` and ``op`` in its message (an fsync's EIO names no file by itself)."""
    if isinstance(e, CheckpointError) or e.errno is None or e.filename is not None:
        return e
    return OSError(e.errno, f"{e.strerror} ({op})", path)


def close_quietly(f: Any, path: str) -> None:
    """Close ``f`` after an error that is being raised; a second error is logged, not raised."""
    try:
        f.close()
    except Exception as e:  # the first error is the one to report
        log.warning("%s: close after a failed write also failed: %s", path, e)


def fsync_close(f: Any) -> None:
    """Close a file from ``open_write``, first forcing local data to disk.

    A local file's failed flush, fsync or close raises (naming the file): the save must fail,
    not report a checkpoint the disk may not hold.  Remote files (no ``fileno``) just close; their
    close uploads and raises on failure.
    """
    try:
        fd = f.fileno()
    except (AttributeError, io.UnsupportedOperation):
        f.close()
        return
    path = getattr(f, "name", None)
    path = path if isinstance(path, str) else f"descriptor {fd}"
    try:
        f.flush()
        os.fsync(fd)
    except OSError as e:
        close_quietly(f, path)
        raise named_error(e, "flush or fsync", path) from e
    except BaseException:
        close_quietly(f, path)
        raise
    try:
        f.close()
    except OSError as e:
        raise named_error(e, "close", path) from e


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None  # libc's sync_file_range once looked up; False where there is none


def start_writeback(f: Any, start: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``start`` of a local file to disk now.

    Why: dirty pages otherwise wait in the page cache until the final fsync, so the disk idles
    while we copy and the fsync then waits for everything; starting writeback as we go overlaps
    the two (Linux ``sync_file_range``, which does not wait).  Purely advisory: ``fsync_close``
    still makes the file durable and reports any I/O error, so failures here are ignored.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = _find_sync_file_range()
    if _sync_file_range:
        _sync_file_range(f.fileno(), start, length, _SYNC_FILE_RANGE_WRITE)


def _find_sync_file_range() -> Any:
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def fsync_dir(path: str) -> None:
    """Make a folder's entries durable; any failure raises (naming the folder)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        raise named_error(e, "fsync of the folder", path) from e
    finally:
        os.close(fd)
