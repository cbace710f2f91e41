"""The C extension in ``capture/_native`` (decode-and-hash for ingest): built once, then imported.

The shared object is compiled with the system C compiler (``cc``; ``$CC`` overrides) the
first time it is needed, into a directory keyed by a hash of the C sources, the flags
and the interpreter's ABI, so an edited source or another Python builds a fresh copy
and a stale one is never loaded. That directory is ``capture/_native/build/<key>/``
(gitignored) or, where the checkout is read-only, ``$DRAFTER_ADAPT_HOME/native/<key>/``.
A file lock makes parallel processes (pytest workers, ingest pool workers) wait for
one build instead of racing. ``scripts/env.sh`` runs ``python -m capture.native`` so
that a fresh checkout builds it once on activation.

The module holds no format rule of its own: :func:`load` hands it :mod:`capture.rules`
(``configure``) before anyone can call it, so a change of the rules needs no rebuild.

:func:`load` raises :class:`NativeUnavailable` when it cannot build or import the module
(tests use it, so they fail rather than skip). Whether production code uses it at all is
:mod:`capture.backend`'s decision, and only its.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from capture import rules

NAME = "_capture_native"
SOURCE_DIR = Path(__file__).resolve().parent / "_native"
CFLAGS = ["-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-std=gnu11"]

_module: ModuleType | None = None


class NativeUnavailable(RuntimeError):
    """The C extension could not be built or imported."""


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c")) + sorted(SOURCE_DIR.glob("*.h"))


def _key(sources: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(CFLAGS).encode())
    h.update((sysconfig.get_config_var("EXT_SUFFIX") or "").encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def _build_roots() -> list[Path]:
    home = Path(os.environ.get("DRAFTER_ADAPT_HOME") or Path.home() / ".cache" / "drafter-adapt")
    return [SOURCE_DIR / "build", home / "native"]


def _so_name() -> str:
    return NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise NativeUnavailable(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.configure(rules.native_table())
    return mod


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable(
            "no C compiler found (cc/gcc, or $CC): it is needed to build the native capture decoder in "
            f"{SOURCE_DIR} (install gcc, e.g. `apt-get install gcc`)")
    return cc


def _compile(sources: list[Path], out: Path, cflags: list[str] = CFLAGS) -> None:
    """Compile into a temporary file beside ``out``, then rename it into place (atomic)."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeUnavailable(f"Python headers not found in {include} (install python3-dev)")
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [_compiler(), *cflags, "-I", include, *(str(p) for p in sources if p.suffix == ".c"), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeUnavailable(f"building the native capture decoder failed:\n$ {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _prune_stale(root: Path, key: str) -> None:
    """Remove the builds in ``root`` of sources other than ``key``'s.

    Only for the checkout's own build directory, which serves one version of the sources;
    the shared one under ``$DRAFTER_ADAPT_HOME`` may serve several checkouts. A process that
    has a removed build loaded keeps it (the mapping outlives the file).
    """
    for d in root.iterdir():
        if d.name != key and len(d.name) == 16 and all(c in "0123456789abcdef" for c in d.name) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def _build(sources: list[Path], key: str) -> Path:
    errors = []
    for root in _build_roots():
        target = root / key / _so_name()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.parent / ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then find it built
                if not target.exists():
                    _compile(sources, target)
                    if root == SOURCE_DIR / "build":
                        _prune_stale(root, key)
            return target
        except OSError as exc:  # read-only checkout: try the next root
            errors.append(f"{target.parent}: {exc}")
    raise NativeUnavailable("no writable directory to build the native capture decoder in: " + "; ".join(errors))


def build_into(directory: Path, cflags: list[str]) -> Path:
    """The module built with ``cflags`` (say, sanitizers) into ``directory``, for :func:`load` to take."""
    out = directory / _so_name()
    _compile(_sources(), out, cflags)
    return out


def load(path: Path | None = None) -> ModuleType:
    """The built and imported extension, configured with :mod:`capture.rules`; raises
    :class:`NativeUnavailable` if it cannot be had.

    ``path`` loads that build of it instead (the fuzzer's sanitized one), for the rest of the process.
    """
    global _module
    if path is not None:
        _module = _import(path)
    if _module is not None:
        return _module
    sources = _sources()
    if not any(p.suffix == ".c" for p in sources):
        raise NativeUnavailable(f"no C sources in {SOURCE_DIR}")
    key = _key(sources)
    path = next((p for p in (r / key / _so_name() for r in _build_roots()) if p.exists()), None)
    if path is None:
        path = _build(sources, key)
    try:
        _module = _import(path)
    except ImportError as exc:
        raise NativeUnavailable(f"cannot import {path}: {exc}") from exc
    return _module


def utf8_args(arr) -> tuple:
    """The buffers of a ``pa.string()`` array as the module's entry points take them:
    (array offset, length, offsets, data, validity or ``None`` when nothing is null)."""
    validity, offsets, data = arr.buffers()
    return arr.offset, len(arr), offsets, data if data is not None else b"", validity if arr.null_count else None


if __name__ == "__main__":
    # `python -m capture.native`: build (if needed) and import; silent on success.
    try:
        load()
    except NativeUnavailable as exc:
        print(f"[capture.native] {exc}", file=sys.stderr)
        sys.exit(1)
