"""Steady client load on an OpenAI-compatible endpoint, every response checked.

Used to show that a swap or restart loses no request: ``workers`` threads loop
until stopped (or a time / request bound), mixing plain and streamed requests,
and count what succeeded and what failed with why.
"""

from __future__ import annotations

import threading
import time

import httpx


class SteadyLoad:
    """Context manager: ``with SteadyLoad(url, model) as load: ...``, then read ``ok`` / ``failed``.

    Request ``n`` of a worker is streamed when ``n % 3 == 0``; with ``completions``
    every even request goes to ``/v1/completions`` instead of chat. A streamed reply
    counts as good only if it ends with ``data: [DONE]``, a plain one only with choices.
    """

    def __init__(self, url: str, model: str, workers: int = 3, max_seconds: float = 400.0,
                 max_requests: int = 5000, max_tokens: int = 16, completions: bool = True) -> None:
        self.url, self.model, self.max_tokens, self.completions = url, model, max_tokens, completions
        self.deadline = time.monotonic() + max_seconds
        self.max_requests = max_requests
        self.stop_ev = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        # Failures of streams whose client had received part of the answer (no proxy can save those).
        self.failed_started: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _request(self, i: int, n: int) -> tuple[str, dict]:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "stream": n % 3 == 0}
        if self.completions and n % 2 == 0:
            body["prompt"] = f"worker {i} request {n} the of and to"
            return "/v1/completions", body
        body["messages"] = [{"role": "user", "content": f"worker {i} request {n}: explain code"}]
        return "/v1/chat/completions", body

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=300) as c:
            n = 0
            while not self.stop_ev.is_set() and time.monotonic() < self.deadline and n < self.max_requests:
                n += 1
                path, body = self._request(i, n)
                data = b""
                try:
                    if body["stream"]:
                        with c.stream("POST", self.url + path, json=body) as r:
                            for chunk in r.iter_raw():
                                data += chunk
                        good = r.status_code == 200 and data.rstrip().endswith(b"data: [DONE]")
                    else:
                        r = c.post(self.url + path, json=body)
                        good = r.status_code == 200 and bool(r.json()["choices"])
                    err = None if good else f"HTTP {r.status_code}"
                except Exception as exc:  # noqa: BLE001 - every failure is counted, with its reason
                    err = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    if err:
                        self.failed.append(err)
                        if data:
                            self.failed_started.append(err)
                    else:
                        self.ok += 1

    def __enter__(self) -> "SteadyLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_ev.set()
        for t in self.threads:
            t.join(300)
