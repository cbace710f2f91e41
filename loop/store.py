"""Where a cycle's state and files live, so that any worker can run its next step.

Each cycle has a local work directory (``<state_dir>/cycles/<id>``) and, with
``[cycle] store = "s3://bucket/prefix"``, a copy in the shared store: ``state.json`` and
every file a step hands to a later one (snapshots, the trained head, evaluation and bench
results). A step pushes what it produced when it finishes; a later step, on whichever
worker, pulls what it reads if its local directory lacks it. Paths in the state are
relative to the cycle directory, so they mean the same thing on every worker. Without a
store (the default) the local directory is the store, and nothing is copied.

The trained head's resumable checkpoint (``head.run``) stays local: a step that resumes
on another worker starts its training over, which is correct, only slower.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from capture.fsmode import write_private
from settings.config import Config


class CycleStore:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.local_root = Path(cfg.state_dir) / "cycles"
        self.uri = cfg.cycle.store.rstrip("/")
        self.remote = self.uri.startswith("s3://")
        if self.remote:
            self.bucket, _, prefix = self.uri[len("s3://"):].partition("/")
            self.prefix = prefix.strip("/")
        elif self.uri:
            raise ValueError(f"[cycle] store must be empty (local) or s3://bucket/prefix, not {self.uri!r}")

    # -- local ----------------------------------------------------------------------------

    def local_dir(self, cycle_id: str) -> Path:
        if not cycle_id or "/" in cycle_id or cycle_id.startswith("."):
            raise ValueError(f"bad cycle id {cycle_id!r}")
        return self.local_root / cycle_id

    def rel(self, cycle_id: str, path: str | Path) -> str:
        """``path`` relative to the cycle directory when it lies inside it, else unchanged (absolute)."""
        p = Path(path)
        try:
            return p.resolve().relative_to(self.local_dir(cycle_id).resolve()).as_posix()
        except ValueError:
            return str(path)

    # -- remote ---------------------------------------------------------------------------

    def _s3(self):
        import boto3

        return boto3.client("s3", **self.cfg.s3.client_kwargs())

    def _key(self, cycle_id: str, rel: str) -> str:
        return "/".join(x for x in (self.prefix, cycle_id, rel) if x)

    def _keys(self, prefix: str) -> Iterator[str]:
        for page in self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"]

    # -- state ----------------------------------------------------------------------------

    def read_state(self, cycle_id: str) -> dict[str, Any] | None:
        if self.remote:
            s3 = self._s3()
            try:
                body = s3.get_object(Bucket=self.bucket, Key=self._key(cycle_id, "state.json"))["Body"].read()
            except s3.exceptions.NoSuchKey:
                return None
            return json.loads(body)
        p = self.local_dir(cycle_id) / "state.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def write_state(self, state: dict[str, Any]) -> None:
        d = self.local_dir(state["cycle_id"])
        d.mkdir(parents=True, exist_ok=True)
        body = json.dumps(state, indent=1, default=str)
        tmp = d / f".state.json.{os.getpid()}"
        write_private(tmp, body)  # owner-only, whatever the umask
        os.replace(tmp, d / "state.json")  # atomic: a crash leaves the previous state
        if self.remote:
            self._s3().put_object(Bucket=self.bucket, Key=self._key(state["cycle_id"], "state.json"),
                                  Body=body.encode())

    def cycle_ids(self) -> list[str]:
        if self.remote:
            pre = (self.prefix + "/") if self.prefix else ""
            return sorted({k[len(pre):].split("/", 1)[0] for k in self._keys(pre) if k.endswith("/state.json")})
        if not self.local_root.is_dir():
            return []
        return sorted(p.name for p in self.local_root.iterdir() if (p / "state.json").is_file())

    # -- files ----------------------------------------------------------------------------

    def push(self, cycle_id: str, rel: str) -> None:
        """Copy ``rel`` (a file or a directory under the cycle directory) to the store."""
        if not self.remote or Path(rel).is_absolute():
            return
        src = self.local_dir(cycle_id) / rel
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        s3 = self._s3()
        for f in files:
            s3.upload_file(str(f), self.bucket, self._key(cycle_id, f.relative_to(self.local_dir(cycle_id)).as_posix()))

    def pull(self, cycle_id: str, rel: str) -> Path:
        """The local path of ``rel``, fetched from the store (a file or a whole directory) if missing here."""
        if Path(rel).is_absolute():
            return Path(rel)
        local = self.local_dir(cycle_id) / rel
        if local.exists() or not self.remote:
            return local
        s3 = self._s3()
        key = self._key(cycle_id, rel)
        found = False
        for k in self._keys(key):
            if k != key and not k.startswith(key + "/"):
                continue
            out = self.local_dir(cycle_id) / k[len(self._key(cycle_id, "")):].lstrip("/")
            out.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(self.bucket, k, str(out))
            found = True
        if not found:
            raise FileNotFoundError(f"{rel} of cycle {cycle_id} is neither here nor in {self.uri}")
        return local


def relative_paths(obj: Any) -> Iterator[str]:
    """The relative paths a step's output names (values of keys ending in ``path``/``jsonl``/``json``)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, str) and k.endswith(("path", "jsonl", "_json")) and v and not Path(v).is_absolute():
                yield v
            else:
                yield from relative_paths(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from relative_paths(v)
