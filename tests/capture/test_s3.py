"""Ingest from and into S3 (a real SeaweedFS server): listing, streaming, vanished objects, S3 warehouse;
and the server itself keeps what is put."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from capture import ingest as ingest_mod
from capture.ingest import ingest
from capture.sources import iter_lines, list_objects
from capture.split import export, load_split, stats
from capture.warehouse import Warehouse
from settings.config import load_config
from tests.capture_support import catalog_rows, chat
from tests.paths import DATACAPTURE

pytestmark = pytest.mark.services

T0 = datetime(2025, 6, 1, 8, 0, tzinfo=timezone.utc)


@pytest.fixture
def s3env(s3_server, tmp_path):
    """A unique prefix in the test bucket for capture and warehouse, and a config pointing at them."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    bucket = s3_server.bucket
    cfg = load_config(overrides={
        "state_dir": str(tmp_path / "state"),
        "s3": {"endpoint_url": s3_server.endpoint_url, "region": s3_server.region},
        "capture": {"source": f"s3://{bucket}/{prefix}/capture"},
        "warehouse": {"uri": f"s3://{bucket}/{prefix}/warehouse"},
    })
    client = s3_server.client()

    def put(t: datetime, name: str, body: bytes, endpoint: str = "llm-ep") -> str:
        key = f"{prefix}/capture/{endpoint}/AllTraffic/{t:%Y/%m/%d/%H}/{name}"
        client.put_object(Bucket=bucket, Key=key, Body=body)
        return f"s3://{bucket}/{key}"

    return cfg, client, bucket, prefix, put


def test_s3_source_and_s3_warehouse_incremental(s3env):
    cfg, client, bucket, prefix, put = s3env
    put(T0, "34-30-683-real.jsonl", (DATACAPTURE / "llm-jumpstart-llama31.jsonl").read_bytes())
    put(T0, "00-00-000-tabular.jsonl", (DATACAPTURE / "tabular-csv-notebook.jsonl").read_bytes())
    put(T0 + timedelta(hours=1), "00-00-000-a.jsonl", "\n".join(chat(i, T0 + timedelta(hours=1)) for i in range(4)).encode())
    res = ingest(cfg)
    assert (res.objects, res.read, res.normalized, res.skipped, res.quarantined) == (3, 10, 7, 3, 0)
    assert ingest(cfg).read == 0
    put(T0 + timedelta(hours=2), "00-00-000-b.jsonl", (chat(9, T0 + timedelta(hours=2)) + "\n" + chat(0, T0)).encode())
    later = ingest(cfg)
    assert (later.objects, later.read, later.normalized, later.duplicates) == (1, 2, 1, 1)
    assert ingest(cfg).read == 0

    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/warehouse/")["Contents"]]
    # Parquet parts by day, and nothing else but the catalog's own tables (DuckLake's Parquet, once
    # they outgrow what the catalog keeps inline).
    lake = [k for k in keys if k.startswith(f"{prefix}/warehouse/_lake/")]
    assert all(k.endswith(".parquet") for k in lake)
    parts = [k for k in keys if k not in lake]
    assert parts and all("/dt=" in k and k.endswith(".parquet") for k in parts)
    rows = load_split(cfg, "train", heldout_hours=0)
    assert len(rows) == 8 and len({r["content_hash"] for r in rows}) == 8
    assert {r["endpoint"] for r in rows} == {"llm-ep"}
    assert sum(1 for r in rows if r["format"] == "tgi") == 3
    st = stats(cfg, heldout_hours=0)
    assert st["conversations"] == 8 and st["skip_reasons"] == {"not_llm_traffic": 3}


def test_s3_listing_paginates_and_filters_window(s3env):
    cfg, client, bucket, prefix, put = s3env
    for h in range(5):
        put(T0 + timedelta(hours=h), f"f{h}.jsonl", chat(h, T0).encode())
    put(T0, "other.jsonl", chat(50, T0).encode(), endpoint="other-ep")
    src = cfg.capture.source
    every = list(list_objects(src, client=client, page_size=2))
    assert len(every) == 6 and len({o.uri for o in every}) == 6
    assert all(o.etag and o.size > 0 for o in every)
    window = list(list_objects(src, client=client, page_size=2, endpoint="llm-ep", variant="AllTraffic",
                               since=T0 + timedelta(hours=1), until=T0 + timedelta(hours=3)))
    assert [o.hour for o in window] == [T0 + timedelta(hours=1), T0 + timedelta(hours=2)]


def test_s3_streamed_read_handles_crlf_bom_and_no_final_newline(s3env):
    cfg, client, bucket, prefix, put = s3env
    body = b"\xef\xbb\xbf" + chat(1, T0).encode() + b"\r\n" + b"x" * 3_000_000 + b"\n" + chat(2, T0).encode()
    uri = put(T0, "mixed.jsonl", body)
    lines = list(iter_lines(uri, client=client, chunk_size=64 * 1024))
    assert len(lines) == 3 and len(lines[1]) == 3_000_000 and lines[2] == chat(2, T0).encode()
    res = ingest(cfg)
    assert (res.read, res.normalized, res.quarantined) == (3, 2, 1)
    assert res.quarantine_reasons == {"invalid_json": 1}


def test_s3_object_vanishing_between_list_and_read(s3env, monkeypatch):
    cfg, client, bucket, prefix, put = s3env
    put(T0, "keep.jsonl", chat(1, T0).encode())
    doomed = put(T0, "doomed.jsonl", chat(2, T0).encode())
    real_list = ingest_mod.list_objects

    def list_then_delete(*a, **kw):
        objs = list(real_list(*a, **kw))
        client.delete_object(Bucket=bucket, Key=doomed.split(f"s3://{bucket}/", 1)[1])
        return iter(objs)

    monkeypatch.setattr(ingest_mod, "list_objects", list_then_delete)
    res = ingest(cfg)
    assert (res.objects, res.missing_objects, res.read, res.normalized) == (1, 1, 1, 1)
    monkeypatch.setattr(ingest_mod, "list_objects", real_list)
    # If it comes back it is read then: a vanished object is not marked processed.
    put(T0, "doomed.jsonl", chat(2, T0).encode())
    assert ingest(cfg).normalized == 1


def test_s3_warehouse_crash_leaves_orphans_invisible_then_cleans_them(s3env, monkeypatch, tmp_path):
    cfg, client, bucket, prefix, put = s3env
    put(T0, "a.jsonl", "\n".join(chat(i, T0) for i in range(3)).encode())

    def dying_commit(self, *a, **kw):
        raise RuntimeError("crash before commit")

    real_commit = Warehouse.commit
    monkeypatch.setattr(Warehouse, "commit", dying_commit)
    with pytest.raises(RuntimeError):
        ingest(cfg)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/warehouse/dt=").get("Contents", [])
    assert len(listed) == 1
    assert load_split(cfg, "train", heldout_hours=0) == []
    monkeypatch.setattr(Warehouse, "commit", real_commit)
    res = ingest(cfg)
    assert (res.read, res.normalized) == (3, 3)
    after = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/warehouse/dt=")["Contents"]]
    # The crashed run's part is gone (its run failed: no catalog will name it); the next run's is there.
    assert len(after) == 1 and after[0] != listed[0]["Key"]
    out = tmp_path / "train.jsonl"
    assert export(cfg, "train", out, heldout_hours=0) == 3
    assert json.loads(out.read_text().splitlines()[0])["conversations"][0]["from"] == "human"
    assert catalog_rows(cfg, "SELECT count(*) FROM parquet_files WHERE path LIKE ?", [f"{bucket}/{prefix}/warehouse/%"]) == [(1,)]


def test_s3_server_roundtrip(s3_server):
    c = s3_server.client()
    c.put_object(Bucket=s3_server.bucket, Key="foundation/hello.txt", Body=b"hello")
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=s3_server.bucket, Prefix="foundation/")["Contents"]]
    assert keys == ["foundation/hello.txt"]
