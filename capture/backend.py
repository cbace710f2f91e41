"""Which implementation capture runs, decided here and only here: the native C module or Python.

Every part of capture that has both (decoding chunks of lines, parsing inference times,
content hashes, the dedupe table, the redaction gate) asks :func:`native` and runs its
Python fallback where the answer is ``None``:

* ``DRAFTER_ADAPT_NATIVE=0`` in the environment turns the native module off, silently;
* a module that cannot be built or imported is reported once per process (a warning), and
  the fallback runs: ingest stays correct, only slower;
* inside ``with python_fallback():`` the fallback runs; tests, the fuzzer and benchmarks
  compare the two that way.

:class:`Backend` is the decision itself, with the loader injectable: a test can stand in a
loader that fails, as a machine without a compiler would.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

from capture import native as _native

log = logging.getLogger("capture.backend")

ENV = "DRAFTER_ADAPT_NATIVE"


class Backend:
    """The native module where it can be had and is wanted, else ``None``, with the reason kept."""

    def __init__(self, load: Callable[[], ModuleType] = _native.load) -> None:
        self._load = load
        self._module: ModuleType | None = None
        self.failure: str | None = None  # why native() answers None, once a load failed
        self._off = 0  # python_fallback() blocks open
        self._lock = threading.Lock()

    def native(self) -> ModuleType | None:
        """The native module to use, or ``None``: use the Python fallback."""
        if self._off or os.environ.get(ENV, "1") == "0":
            return None
        if self._module is None and self.failure is None:
            with self._lock:
                if self._module is None and self.failure is None:
                    try:
                        self._module = self._load()
                    except _native.NativeUnavailable as exc:
                        self.failure = str(exc)
                        log.warning("native capture decoder unavailable, using the slower Python fallback: %s", exc)
        return self._module

    @contextmanager
    def python_fallback(self) -> Iterator[None]:
        """The Python fallback inside the block, whatever :meth:`native` would answer."""
        with self._lock:
            self._off += 1
        try:
            yield
        finally:
            with self._lock:
                self._off -= 1


_default = Backend()


def native() -> ModuleType | None:
    """The process's choice: the native module, or ``None`` for the Python fallback."""
    return _default.native()


def python_fallback():
    """``with python_fallback():`` runs the Python fallback of every capture path inside."""
    return _default.python_fallback()


def failure() -> str | None:
    """Why :func:`native` answers ``None`` in this process, if the module could not be had."""
    return _default.failure
