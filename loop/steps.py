"""The names of a cycle's steps, in order: importable without the pipeline's dependencies (the CLI's
choices and help, the DAG's task ids)."""

from __future__ import annotations

STEPS = ("ingest", "snapshot", "base", "train", "evaluate", "bench", "gate", "log_run", "register", "promote")
