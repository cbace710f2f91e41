"""Init service `buckets`: create the stack's S3 buckets (once; a bucket that exists is kept).

    python /init/buckets.py BUCKET...

The S3 endpoint and keys come from the environment boto3 reads (AWS_ENDPOINT_URL_S3,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION). S3 answering its health probe is
not yet its filer taking writes, so an unreachable S3 or a server error (5xx) is retried for a
while; a refusal (wrong keys, a bad name) is not. Exits non-zero, having said why, when a bucket
cannot be created or read back.
"""

from __future__ import annotations

import sys
import time

import boto3
from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

EXISTS = {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}


def ensure_bucket(client, name: str) -> str:
    """Create ``name`` unless it exists; return "created" or "exists". Raises when S3 refuses."""
    try:
        client.create_bucket(Bucket=name)
        state = "created"
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in EXISTS:
            raise
        state = "exists"
    client.head_bucket(Bucket=name)  # readable with these keys, not only named
    return state


def transient(exc: Exception) -> bool:
    """Worth retrying: S3 not reachable yet, or answering 5xx while it starts."""
    if isinstance(exc, ClientError):
        return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
    return isinstance(exc, (ConnectionError, HTTPClientError))  # not e.g. a name botocore refuses


def main(argv: list[str], attempts: int = 30, delay_s: float = 2.0) -> int:
    if not argv:
        print("usage: buckets.py BUCKET...", file=sys.stderr)
        return 2
    client = boto3.client("s3")
    for name in argv:
        for attempt in range(1, attempts + 1):
            try:
                print(f"bucket {name}: {ensure_bucket(client, name)}", flush=True)
                break
            except (BotoCoreError, ClientError) as exc:
                if not transient(exc) or attempt == attempts:
                    print(f"bucket {name}: failed (attempt {attempt}): {exc}", file=sys.stderr)
                    return 1
                time.sleep(delay_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
