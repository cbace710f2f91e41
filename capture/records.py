"""One SageMaker Data Capture line: decode it into request/response text, or write one.

A capture line looks like::

    {"captureData": {"endpointInput":  {"observedContentType": "application/json", "mode": "INPUT",
                                        "data": "...", "encoding": "JSON"},
                     "endpointOutput": {"observedContentType": null, "mode": "OUTPUT",
                                        "data": "...", "encoding": "BASE64"}},
     "eventMetadata": {"eventId": "...", "inferenceTime": "2024-01-19T19:27:57Z", "inferenceId": "..."},
     "eventVersion": "0"}

Decoding never raises anything but :class:`Reject`, which carries the reason a line
did not become a conversation and whether it is bad data (quarantine) or merely
not LLM traffic (skip).
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from capture import rules
from capture.rules import BASE64, CSV, ENCODINGS, JSON

BOM = b"\xef\xbb\xbf"


class Reject(Exception):
    """A line that does not become a conversation.

    ``kind`` is ``"quarantine"`` for malformed input (kept, with a copy, for a person to
    look at) or ``"skip"`` for well-formed input that is not LLM chat traffic (counted).
    """

    def __init__(self, kind: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {reason}{': ' + detail if detail else ''}")
        self.kind = kind
        self.reason = reason
        self.detail = detail


def quarantine(reason: str, detail: str = "") -> Reject:
    return Reject("quarantine", reason, detail)


def skip(reason: str, detail: str = "") -> Reject:
    return Reject("skip", reason, detail)


@dataclass(slots=True)
class Payload:
    """One side of an exchange, decoded to text."""

    text: str
    content_type: str | None
    encoding: str


@dataclass(slots=True)
class CaptureRecord:
    event_id: str | None
    inference_id: str | None
    inference_time: datetime | None
    request: Payload
    response: Payload | None


def parse_time(value: Any) -> datetime | None:
    """Parse an ISO-8601 ``inferenceTime``; ``None`` when absent or unparseable (e.g. the SDK's ``{%s}``)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        t = datetime.fromisoformat(value.strip())  # 3.11+: accepts a trailing Z
    except ValueError:
        return None
    off = t.utcoffset()
    if off is None or not off:
        return t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc)


_scan = json.decoder.JSONDecoder().scan_once  # the C scanner, minus json.loads' per-call Python wrapping


def fast_loads(text: str) -> Any:
    """``json.loads`` for a str, cheaper per call; raises ValueError/RecursionError like it."""
    try:
        obj, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)  # leading whitespace or not JSON: let json.loads say which
    if end != len(text) and text[end:].strip():
        return json.loads(text)  # trailing garbage: json.loads raises "Extra data"
    return obj


def _json_loads(data: bytes | str, reason: str) -> Any:
    try:
        if isinstance(data, bytes):
            data = data.decode("utf-8")
        return fast_loads(data)
    except RecursionError:
        raise quarantine("too_deeply_nested", reason) from None
    except UnicodeDecodeError as exc:
        raise quarantine("invalid_utf8", f"{reason}: {exc.reason} at byte {exc.start}") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise quarantine(reason, str(exc)[:200]) from None


def _field(obj: dict, key: str, path: str, types: type | tuple[type, ...], required: bool = True) -> Any:
    if key not in obj or obj[key] is None:
        if required:
            raise quarantine("missing_field", f"{path}.{key}")
        return None
    v = obj[key]
    if not isinstance(v, types):
        raise quarantine("wrong_type", f"{path}.{key} is {type(v).__name__}")
    return v


def _payload(side: dict, path: str) -> Payload:
    data = _field(side, "data", path, str)
    enc = _field(side, "encoding", path, str, required=False)
    ct = side.get("observedContentType")
    if ct is not None and not isinstance(ct, str):
        raise quarantine("wrong_type", f"{path}.observedContentType is {type(ct).__name__}")
    enc = rules.encoding_of(enc)
    if enc == BASE64:
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise quarantine("invalid_base64", f"{path}.data: {exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise quarantine("invalid_utf8", f"{path}.data (base64) at byte {exc.start}") from None
    elif enc in (JSON, CSV):
        text = data
    else:
        raise quarantine("unknown_encoding", f"{path}.encoding={enc[:40]}")
    if "\x00" in text:
        raise quarantine("nul_bytes", f"{path}.data contains NUL")
    return Payload(text=text, content_type=ct, encoding=enc)


def decode_line(line: bytes) -> CaptureRecord:
    """Decode one capture line (without its newline) or raise :class:`Reject`."""
    if line.startswith(BOM):
        line = line[3:]
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line.strip():
        raise skip("empty_line")
    if b"\x00" in line:
        raise quarantine("nul_bytes", "raw NUL byte in the line")
    rec = _json_loads(line, "invalid_json")
    if not isinstance(rec, dict):
        raise quarantine("wrong_type", f"line is a JSON {type(rec).__name__}, not an object")
    cap = _field(rec, "captureData", "$", dict)
    inp = _field(cap, "endpointInput", "captureData", dict)
    out = _field(cap, "endpointOutput", "captureData", dict, required=False)
    meta = rec.get("eventMetadata")
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict):
        raise quarantine("wrong_type", f"eventMetadata is {type(meta).__name__}")
    event_id = meta.get("eventId")
    inference_id = meta.get("inferenceId")
    request = _payload(inp, "captureData.endpointInput")
    response = _payload(out, "captureData.endpointOutput") if out is not None else None
    return CaptureRecord(
        event_id=event_id if isinstance(event_id, str) else None,
        inference_id=inference_id if isinstance(inference_id, str) else None,
        inference_time=parse_time(meta.get("inferenceTime")),
        request=request,
        response=response,
    )


def _side(mode: str, payload: dict | list | str | bytes, content_type: str | None, encoding: str) -> dict:
    if isinstance(payload, (dict, list)):
        raw = json.dumps(payload, ensure_ascii=False)
    elif isinstance(payload, bytes):
        raw = payload.decode("utf-8") if encoding != BASE64 else ""
    else:
        raw = payload
    enc = encoding.upper()
    if enc == BASE64:
        blob = payload if isinstance(payload, bytes) else raw.encode("utf-8")
        data = base64.b64encode(blob).decode("ascii")
    elif enc in (JSON, CSV):
        data = raw
    else:
        raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
    return {"observedContentType": content_type, "mode": mode, "data": data, "encoding": enc}


def make_capture_record(
    request: dict | list | str | bytes,
    response: dict | list | str | bytes,
    *,
    request_content_type: str | None = "application/json",
    response_content_type: str | None = "application/json",
    event_id: str | None = None,
    inference_time: datetime | str | None = None,
    inference_id: str | None = None,
    request_encoding: str = "JSON",
    response_encoding: str = "JSON",
    custom_attributes: list[str] | None = None,
) -> str:
    """Return one Data Capture JSONL line (no newline) in SageMaker's exact shape.

    ``request``/``response`` are payload dicts (serialized as JSON), or the raw body
    (e.g. an SSE stream ``"data: {...}\\n\\ndata: [DONE]\\n\\n"``). ``*_encoding`` is
    ``JSON``/``CSV`` (data stored as text) or ``BASE64``. ``inference_time`` defaults to now.
    """
    if inference_time is None:
        inference_time = datetime.now(timezone.utc)
    if isinstance(inference_time, datetime):
        t = inference_time if inference_time.tzinfo else inference_time.replace(tzinfo=timezone.utc)
        inference_time = t.astimezone(timezone.utc).strftime(rules.TIME_FORMAT)
    meta: dict[str, Any] = {"eventId": event_id or str(uuid.uuid4()), "inferenceTime": inference_time}
    if inference_id:
        meta["inferenceId"] = inference_id
    if custom_attributes:
        meta["customAttributes"] = list(custom_attributes)
    rec = {
        "captureData": {
            "endpointInput": _side("INPUT", request, request_content_type, request_encoding),
            "endpointOutput": _side("OUTPUT", response, response_content_type, response_encoding),
        },
        "eventMetadata": meta,
        "eventVersion": "0",
    }
    return json.dumps(rec, ensure_ascii=False, separators=(",", ":"))
