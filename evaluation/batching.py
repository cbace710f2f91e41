"""How prompts of many lengths are cut into batches for greedy generation (no torch: benchmarks plan with it)."""

from __future__ import annotations


def plan_batches(lengths: list[int], max_prompts: int, max_tokens: int, max_new: int) -> list[int]:
    """Sizes of the fewest contiguous batches of ``lengths`` (prompt lengths, sorted ascending) that each hold
    at most ``max_prompts`` prompts and ``max_tokens`` tokens, every prompt padded to the batch's longest plus
    ``max_new`` answer tokens; shortest batch first.

    Filled from the longest end: a batch's padded size is set by its longest prompt, so the few long prompts
    share one batch and the many short ones fill whole batches. A batch decodes until its last answer ends,
    which with hundreds of answers is nearly always at ``max_new``: every batch pays about the same number
    of steps whatever its size, so fewer batches mean fewer steps. Filling from the short end instead
    leaves the long tail in small batches of its own, each paying those steps again."""
    sizes = []
    end = len(lengths)
    while end > 0:
        n = min(max_prompts, end, max(1, max_tokens // (lengths[end - 1] + max_new)))
        sizes.append(n)
        end -= n
    return sizes[::-1]
