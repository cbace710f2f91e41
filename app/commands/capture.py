"""`adapt ingest` and `adapt dataset stats|export`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from app.common import ConfigOpt, JsonOpt, command_group, emit, fail, get_config

SourceOpt = Annotated[
    Optional[str], typer.Option("--source", help="Capture dir, file or s3://bucket/prefix (default: config capture.source).")
]
SinceOpt = Annotated[Optional[str], typer.Option("--since", help="First hour to read (YYYY-MM-DD[THH], or 6h/2d ago).")]
UntilOpt = Annotated[Optional[str], typer.Option("--until", help="Hour to stop before (exclusive), same forms as --since.")]
EndpointOpt = Annotated[Optional[str], typer.Option("--endpoint", help="Only this endpoint (default: config capture.endpoint).")]


def register(app: typer.Typer) -> None:
    dataset = command_group(help="The captured conversation dataset.")

    @app.command("ingest")
    def ingest_cmd(
        source: SourceOpt = None,
        since: SinceOpt = None,
        until: UntilOpt = None,
        endpoint: EndpointOpt = None,
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Turn new Data Capture files into deduplicated ShareGPT conversations in the warehouse."""
        from capture.ingest import ingest
        from capture.catalog import CatalogError
        from capture.warehouse import WriterLost

        cfg = get_config(config, json_)
        try:
            res = ingest(cfg, source=source, since=since, until=until, endpoint=endpoint)
        except (WriterLost, CatalogError, FileNotFoundError, ValueError) as exc:
            fail(str(exc))
            return
        s = res.summary()
        human = (
            f"run {res.run_id}: read {res.read} lines from {res.objects} files → {res.normalized} conversations, "
            f"{res.duplicates} duplicates, {res.stitched} stitched, {res.quarantined} quarantined, "
            f"{res.skipped} skipped"
        )
        if res.superseded:
            human += f"\n  {res.superseded} stored conversations superseded by longer versions"
        if res.skip_reasons:
            human += "\n  skipped: " + ", ".join(f"{k}={v}" for k, v in sorted(res.skip_reasons.items()))
        if res.quarantine_reasons:
            human += "\n  quarantined: " + ", ".join(f"{k}={v}" for k, v in sorted(res.quarantine_reasons.items()))
        if res.redactions:
            human += "\n  redacted: " + ", ".join(f"{k}={v}" for k, v in sorted(res.redactions.items()))
        if res.missing_objects:
            human += f"\n  {res.missing_objects} listed files vanished before they could be read"
        emit(s, json_, human=human)

    @dataset.command("stats")
    def stats_cmd(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
        """Counts per split, day, format and endpoint; token length percentiles."""
        from capture.split import stats

        st = stats(get_config(config, json_))
        lines = [f"{st['conversations']} conversations ({', '.join(f'{k} {v}' for k, v in st['splits'].items())})"]
        for key in ("days", "formats", "endpoints"):
            if st[key]:
                lines.append(f"  {key}: " + ", ".join(f"{k}={v}" for k, v in st[key].items()))
        if st["tokens"]:
            lines.append("  tokens: " + ", ".join(f"{k}={v}" for k, v in st["tokens"].items()))
        lines.append(f"  quarantined {st['quarantined']}, skipped {st['skipped']}")
        emit(st, json_, human="\n".join(lines))

    @dataset.command("export")
    def export_cmd(
        split: Annotated[str, typer.Option("--split", help="train or heldout.")] = "train",
        out: Annotated[Path, typer.Option("--out", help="ShareGPT JSONL file to write.")] = Path("sharegpt.jsonl"),
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Write one split as ShareGPT JSONL."""
        from capture.split import SPLITS, export

        if split not in SPLITS:
            fail(f"--split must be one of {', '.join(SPLITS)}")
        n = export(get_config(config, json_), split, out)
        emit({"split": split, "rows": n, "out": str(out)}, json_, human=f"wrote {n} {split} conversations to {out}")

    app.add_typer(dataset, name="dataset")
