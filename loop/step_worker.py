"""One cycle step's work in a process of its own: ``python -m loop.step_worker STEP CYCLE_ID OUT_JSON``.

Started by :func:`loop.cycle.in_own_process` (``CycleOptions.step_processes``; the train step's ranks
under torchrun with ``[training] gpus`` above 1): the config comes as JSON on stdin (or, for
torchrun's ranks, in ``loop.cycle.CONFIG_ENV``), the cycle's state from its store, and the step's output is written to
``OUT_JSON`` (atomically) for the parent to record. The process ends with the step, and the
memory the step grew goes back to the machine with it. It dies with its parent (Linux), so a
stopped cycle leaves no trainer behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def die_with_parent() -> None:
    """SIGTERM when the parent process ends (Linux; elsewhere the parent's kill on interrupt covers it)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    from loop.cycle import CONFIG_ENV, IN_PROCESS, Cycle
    from settings.config import Config

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in IN_PROCESS:
        sys.stderr.write(f"usage: python -m loop.step_worker {{{','.join(IN_PROCESS)}}} CYCLE_ID OUT_JSON "
                         "(the config as JSON on stdin)\n")
        return 2
    step, cycle_id, out_path = args[0], args[1], Path(args[2])
    die_with_parent()
    # torchrun's ranks share no stdin: the parent puts the config in their environment instead.
    cx = Cycle(Config.model_validate_json(os.environ.pop(CONFIG_ENV, None) or sys.stdin.read()))
    out = IN_PROCESS[step](cx, cx.load_state(cycle_id))
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 answers for the step
        return 0
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(out, default=str))
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
