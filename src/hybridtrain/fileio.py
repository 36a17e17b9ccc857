"""Reading files with errors that name them; writing files that several processes may write at
the same time (every rank of a run).

::

    read_text(path, max_bytes=None) -> str               # UTF-8 (a BOM is dropped); EncodingError
                                                         # names file:line; InputError: too large,
                                                         # a symlink loop, no permission
    json_loads(text) -> Any                              # json.loads; deep nesting a JSONDecodeError
    read_json(path) -> Any                               # ... and syntax errors file:line
    read_jsonl(path) -> list                             # one JSON value per non-blank line
    strip_bom(data) -> bytes                             # without a leading UTF-8 byte-order mark
    @text_reader(kind, arg="path")                       # registers a reader of user text files
    open_safetensors(path, device="cpu") -> safe_open    # a truncated file: ValueError naming it
    given_path(path, what) -> str | None                 # ~ expanded; empty: ValueError
    input_file(path, what) / output_file(path, what) / output_folder(path, what) -> str
                                                         # a path the user gave, checked first
    write_error(exc, what, path) -> WriteError | None    # a full or read-only disk, named
    append_text(path, text) -> None                      # a log line; WriteError names path
    atomic_write(path, data, fsync=False) -> bool        # str or bytes
    atomic_write_json(path, obj, indent=1, fsync=False) -> bool
    publish_files(src_dir, dst_dir) -> None              # each file of src_dir, atomically
    apply_umask(path) -> None                            # modes as a plain open()/mkdir give

Every text file hybridtrain reads (recipes, JSON, JSONL, chat templates, prompts, tokenizer and
model folders) is decoded by :func:`decode_utf8`: UTF-8, with or without the byte-order mark that
Windows editors write. Each function that reads a kind of text file a user gives registers itself
with :func:`text_reader` (in :data:`TEXT_READERS`), and one test feeds each a file that starts
with a byte-order mark.

A file is written to a temporary name unique to the process (``.NAME.<pid>.<random>.tmp`` in
the same folder) and renamed over ``path`` with :func:`os.replace`, so a reader sees the old file
or the whole new one, and two writers never share a temporary file. A file that already holds
exactly ``data`` is left alone (its mtime too, which keeps caches keyed on it valid); the
functions return whether they wrote.

Writers that go through private temporary files (``tempfile.mkdtemp`` folders are 0700,
safetensors writes 0600) call :func:`apply_umask` on what they publish, so exported weights get
the user's umask like every other file.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import secrets
from collections.abc import Callable
from typing import Any

__all__ = ["atomic_write", "atomic_write_json", "publish_files", "unique_tmp_path", "current_umask",
           "apply_umask", "EncodingError", "decode_utf8", "read_text", "read_json", "read_jsonl",
           "strip_bom", "BOM", "text_reader", "TEXT_READERS", "read_bytes", "InputError", "json_loads",
           "MAX_RECIPE_BYTES",
           "open_safetensors", "WriteError", "write_error", "append_text", "given_path",
           "input_file", "output_file", "output_folder"]


# -- errors -----------------------------------------------------------------------------------
# a disk that is full or read-only, a folder that is not writable, a file size limit: what to do
_FULL = "free some space or choose another folder"
_DENIED = "fix the folder's permissions or choose another folder"
DISK_ERRNOS = {errno.ENOSPC: _FULL, errno.EDQUOT: _FULL, errno.EROFS: "choose a writable folder",
               errno.EFBIG: "a file size limit (ulimit -f) is in force",
               errno.EACCES: _DENIED, errno.EPERM: _DENIED}


class WriteError(ValueError):
    """A file could not be written: the disk is full or read-only, or the folder not writable."""


def write_error(exc: BaseException, what: str,
                path: str | os.PathLike | None) -> WriteError | None:
    """The :class:`WriteError` for ``exc`` (an ``OSError``, or one that has it as its cause)
    raised while writing ``what`` into ``path`` (None: the file the error names); None for
    any other error."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    if exc is None or exc.errno not in DISK_ERRNOS:
        return None
    where = path if path is not None else exc.filename
    where = f" ({os.fspath(where)})" if where else ""
    return WriteError(f"{os.strerror(exc.errno).lower()} while writing {what}{where}; "
                      f"{DISK_ERRNOS[exc.errno]}")


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to ``path`` (a log); a full or read-only disk raises a
    :class:`WriteError` naming it."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        err = write_error(e, "log", path)
        if err is None:
            raise
        raise err from e


# -- reading ----------------------------------------------------------------------------------
class EncodingError(ValueError):
    """Bytes that are not UTF-8 in a text file (the message names the file, line and column)."""


BOM = codecs.BOM_UTF8
# byte-order marks of the encodings a text editor may save as instead (UTF-32's first: it
# starts with UTF-16's)
_OTHER_BOMS = (("UTF-32", codecs.BOM_UTF32_LE), ("UTF-32", codecs.BOM_UTF32_BE),
               ("UTF-16", codecs.BOM_UTF16_LE), ("UTF-16", codecs.BOM_UTF16_BE))

# reader function -> (kind of file it reads, e.g. "jsonl" or "recipe"; the parameter taking its path)
TEXT_READERS: dict[Callable, tuple[str, str]] = {}


def text_reader(kind: str, arg: str = "path") -> Callable:
    """Registers the decorated function as a reader of ``kind`` files, given in its parameter
    ``arg``, in :data:`TEXT_READERS` (the encoding test reads every registered reader's kind
    with a byte-order mark); returns the function unchanged."""
    def register(fn: Callable) -> Callable:
        TEXT_READERS[fn] = (kind, arg)
        return fn
    return register


def strip_bom(data: bytes) -> bytes:
    """``data`` without a leading UTF-8 byte-order mark."""
    return data[len(BOM):] if data.startswith(BOM) else data


def decode_utf8(data: bytes, path, line: int | None = None,
                error: type[ValueError] = EncodingError) -> str:
    """``data`` (read from ``path``) as UTF-8 text; bytes that are not UTF-8 raise ``error``
    naming the file, line and column (``line``: the line ``data`` is, else counted in it).
    ``data`` that starts the file (``line`` None or 1) may start with a byte-order mark,
    which is dropped."""
    if line is None or line == 1:
        data = strip_bom(data)
        other = next((name for name, bom in _OTHER_BOMS if data.startswith(bom)), None)
        if other is not None:
            raise error(f"{path}: the file is {other} (it starts with a {other} byte-order "
                        f"mark); save it as UTF-8 (e.g. `iconv -f {other} -t UTF-8`)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        head = data[: e.start]
        if line is None:
            line = head.count(b"\n") + 1
            head = head[head.rfind(b"\n") + 1:]
        col = len(head.decode("utf-8", errors="replace")) + 1
        raise error(
            f"{path}: line {line}: column {col}: bytes {data[e.start:e.end]!r} are not UTF-8; "
            "the file must be UTF-8 (convert it, e.g. `iconv -f latin1 -t utf-8`)"
        ) from None


class InputError(ValueError):
    """A file to read is too large, or cannot be opened for a reason other than its absence
    (a symbolic-link loop, permissions, ...)."""


def read_bytes(path: str | os.PathLike, max_bytes: int | None = None,
               what: str = "the file") -> bytes:
    """The bytes of ``path``; a file larger than ``max_bytes`` is refused before it is read,
    and an ``OSError`` other than a missing file or a folder is an :class:`InputError` naming
    ``path``."""
    try:
        if max_bytes is not None and os.stat(path).st_size > max_bytes:
            raise InputError(f"{os.fspath(path)} is {os.stat(path).st_size:,} bytes, more than "
                             f"{what} can be ({max_bytes:,} bytes); is it the right file?")
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError):
        raise
    except OSError as e:
        raise InputError(f"{os.fspath(path)}: cannot be read ({e.strerror or e}); check the "
                         "path (a symbolic link that leads to itself?) and its permissions"
                         ) from None


@text_reader("text")
def read_text(path: str | os.PathLike, max_bytes: int | None = None,
              what: str = "the file") -> str:
    """The UTF-8 text of ``path`` (:class:`EncodingError` names the file and line);
    :func:`read_bytes` refuses a file over ``max_bytes`` or one that cannot be opened."""
    return decode_utf8(read_bytes(path, max_bytes, what), os.fspath(path))


def json_loads(text: str) -> Any:
    """``json.loads(text)``; nesting deeper than Python's recursion limit is a
    ``json.JSONDecodeError`` too (not a ``RecursionError``)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("the JSON nests too deeply (thousands of levels)", text,
                                   0) from None


@text_reader("json")
def read_json(path: str | os.PathLike) -> Any:
    """The JSON document in ``path``; bad bytes or syntax raise a ``ValueError`` naming the file
    and line."""
    try:
        return json_loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)}: line {e.lineno}: column {e.colno}: not valid "
                         f"JSON ({e.msg})") from None


@text_reader("jsonl")
def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """The JSON value of each non-blank line of ``path``; bad bytes or syntax raise a
    ``ValueError`` naming the file and line."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = decode_utf8(raw, os.fspath(path), line=n)
            if not line.strip():
                continue
            try:
                out.append(json_loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}: line {n}: column {e.colno}: not valid "
                                 f"JSON ({e.msg})") from None
    return out


MAX_RECIPE_BYTES = 16 << 20  # a recipe is a few kB: a larger file is not one


# -- paths the user gives ----------------------------------------------------------------------
def _cwd_hint(path: str) -> str:
    return "" if os.path.isabs(path) else f" (relative paths are read from {os.getcwd()})"


def given_path(path: str | os.PathLike | None, what: str) -> str | None:
    """``path`` with ``~`` expanded (None stays None); an empty or blank one (an unset
    variable) is a ``ValueError`` naming ``what``, never the working directory."""
    if path is None:
        return None
    raw = os.fspath(path)
    if not raw.strip():
        raise ValueError(f"{what} is empty ({raw!r}): give a path (an unset shell variable?)")
    return os.path.expanduser(raw)


def input_file(path: str | os.PathLike, what: str) -> str:
    """``path`` (``~`` expanded) when it is a readable file; else a ``ValueError`` naming
    ``what`` (a flag or key, e.g. ``--prompts``) and the fix."""
    raw = os.fspath(path)
    p = os.path.expanduser(raw)
    if not p.strip():
        raise ValueError(f"{what} is empty: give a file")
    if os.path.isdir(p):
        raise ValueError(f"{what} {raw}: is a folder; give a file (e.g. {what} {raw}/FILE)")
    if not os.path.isfile(p):
        raise ValueError(f"{what} {raw}: no such file{_cwd_hint(p)}")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{what} {raw}: not readable (permission denied); fix its permissions")
    return p


def _existing_ancestor(p: str) -> str:
    """The nearest part of ``p`` (itself or a parent folder) that exists."""
    p = os.path.abspath(p)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def output_file(path: str | os.PathLike, what: str) -> str:
    """``path`` (``~`` expanded) when a file can be written there: not a folder, in a folder
    that exists and is writable; else a ``ValueError`` naming ``what`` and the fix."""
    raw = os.fspath(path)
    p = os.path.expanduser(raw)
    if not p.strip():
        raise ValueError(f"{what} is empty: give a file name")
    if os.path.isdir(p):
        raise ValueError(f"{what} {raw}: is a folder; give a file name (e.g. "
                         f"{what} {os.path.join(raw, 'out.jsonl')})")
    parent = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(parent):
        found = _existing_ancestor(parent)
        why = (f"{found} is a file, not a folder" if os.path.lexists(found)
               and not os.path.isdir(found) else f"its folder {parent} does not exist")
        raise ValueError(f"{what} {raw}: {why}; create the folder first (mkdir -p) or choose "
                         "another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {raw}: the folder {parent} is not writable; choose another path")
    return p


def output_folder(path: str | os.PathLike, what: str) -> str:
    """``path`` (``~`` expanded) when it is, or can be created as, a writable folder: not a
    file, not under a file; else a ``ValueError`` naming ``what`` and the fix."""
    raw = os.fspath(path)
    p = os.path.expanduser(raw)
    if not p.strip():
        raise ValueError(f"{what} is empty: give a folder")
    found = _existing_ancestor(p)
    if not os.path.isdir(found):
        where = "is a file" if found == os.path.abspath(p) else f"lies under the file {found}"
        raise ValueError(f"{what} {raw}: {where}, not a folder; choose a folder path")
    if not os.access(found, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {raw}: {found} is not writable; choose another folder")
    return p


def open_safetensors(path: str | os.PathLike, device: str = "cpu"):
    """``safetensors.safe_open(path, framework="pt", device=device)`` (use it in ``with``); a
    truncated or corrupt file raises a ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(os.fspath(path), framework="pt", device=device)
    except SafetensorError as e:
        size = os.path.getsize(path)
        raise ValueError(f"{os.fspath(path)}: not a readable safetensors file, truncated or "
                         f"corrupt ({size} bytes; {e}); copy or download it again") from None


def unique_tmp_path(path: str | os.PathLike) -> str:
    """A hidden name next to ``path`` that no other process (nor call) uses."""
    head, name = os.path.split(os.fspath(path))
    return os.path.join(head, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _holds(path: str, data: bytes) -> bool:
    try:
        if os.path.getsize(path) != len(data):
            return False
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


def atomic_write(path: str | os.PathLike, data: str | bytes, fsync: bool = False) -> bool:
    """Write ``data`` (text is UTF-8) to ``path`` through a private temporary file and one
    rename; ``fsync``: flush it to disk before the rename. Returns False when ``path`` already
    held ``data`` (nothing written). A full or read-only disk raises a :class:`WriteError`
    naming ``path`` (the temporary file removed)."""
    path = os.fspath(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if _holds(path, raw):
        return False
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = unique_tmp_path(path)
    try:
        with open(tmp, "xb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        err = write_error(e, "file", path)
        if err is None:
            raise
        raise err from e
    return True


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1,
                      fsync: bool = False, **dumps_kwargs: Any) -> bool:
    """:func:`atomic_write` of ``json.dumps(obj, indent=indent, **dumps_kwargs)``."""
    return atomic_write(path, json.dumps(obj, indent=indent, **dumps_kwargs), fsync=fsync)


def publish_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> None:
    """Copies each regular file of ``src_dir`` into ``dst_dir`` with :func:`atomic_write`
    (files ``dst_dir`` has and ``src_dir`` has not are kept)."""
    src_dir, dst_dir = os.fspath(src_dir), os.fspath(dst_dir)
    os.makedirs(dst_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            with open(src, "rb") as f:
                atomic_write(os.path.join(dst_dir, name), f.read())


def current_umask() -> int:
    """The process umask (read from /proc where it can be, without changing it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (and, for a folder, everything in it) the mode a plain ``open`` or
    ``mkdir`` would: files ``0o666 & ~umask``, folders ``0o777 & ~umask``."""
    mask = current_umask()
    path = os.fspath(path)
    if not os.path.isdir(path):
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for fn in files:
            os.chmod(os.path.join(root, fn), 0o666 & ~mask)
