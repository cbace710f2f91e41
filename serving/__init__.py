"""Serving: a vLLM replica pool behind a capturing router, head hot-swap, replay bench.

* ``replica``: command line + supervision of one ``vllm serve`` (loopback only).
* ``pool``: replicas (started or attached), health, crash restarts, draining, live acceptance.
* ``router``: OpenAI-compatible front, least-outstanding balancing, streaming, capture, admin.
* ``capture_writer``: async batched SageMaker Data Capture JSONL to a directory or S3.
* ``head_transfer``: vLLM weight-transfer engine (a plugin) that loads a head file in place.
* ``admin``: bearer-token auth and the client of vLLM's weight-update protocol (head swaps).
* ``agent`` / ``embedded``: the door of a replica the pool did not start (proxy, or holding the engine).
* ``attach``: what to run for such a replica (its ``vllm serve`` line, a Kubernetes manifest).
* ``swap``: validate → canary → one by one → roll back; rolling restart for new shapes.
* ``metrics``: vLLM spec-decode counters → acceptance.
* ``bench`` + ``plots``: interleaved A/B replay benchmark with bootstrap CIs.
* ``serve``: assembles the stack; ``cli``: ``adapt serve|swap|bench|pool status``.
"""
