"""Endpoint Data Capture → ShareGPT conversations in Parquet, catalogued in DuckDB.

Public API (import the submodules; nothing heavy is imported here):

* ``capture.ingest.ingest(cfg, source=None, since=None, until=None, endpoint=None) -> IngestResult``
* ``capture.split.load_split(cfg, split)``, ``capture.split.export(cfg, split, out)``, ``capture.split.stats(cfg)``
* ``capture.records.make_capture_record(request, response, ...)`` — one Data Capture line, as SageMaker writes it
* ``capture.sources.layout_key(endpoint, variant, when)`` — where such a file goes below the capture prefix

Inside: ``capture.rules`` is the one table of format rules (the C decoder is configured
from it); ``capture.backend`` alone decides between the native module and Python.
"""
