"""Serving: a vLLM replica pool behind a capturing router, head hot-swap, replay bench.

* ``replica``: command line + supervision of one ``vllm serve`` (loopback only).
* ``pool``: replicas (started or attached), health, crash restarts, draining, live acceptance.
* ``router``: OpenAI-compatible front, least-outstanding balancing, streaming, capture, admin.
* ``capture_writer``: async batched SageMaker Data Capture JSONL to a directory or S3.
* ``hotswap``: vLLM worker extension that reloads the drafter head in place.
* ``admin``: bearer-token auth and the controller's collective_rpc client.
* ``swap``: validate → canary → one by one → roll back; rolling restart for new shapes.
* ``metrics``: vLLM spec-decode counters → acceptance.
* ``bench`` + ``plots``: interleaved A/B replay benchmark with bootstrap CIs.
* ``serve``: assembles the stack; ``cli``: ``adapt serve|swap|bench|pool status``.
"""
