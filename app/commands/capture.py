"""`adapt ingest` and `adapt dataset stats|export`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from app.common import ConfigOpt, ForceOpt, JsonOpt, command_group, emit, error_text, fail, get_config


def _when(value: Optional[str]) -> Optional[str]:
    """Check a --since/--until value at parse time, so a bad one is a usage error (exit 2)."""
    from capture.sources import parse_when

    try:
        parse_when(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


SourceOpt = Annotated[
    Optional[str], typer.Option("--source", help="Capture dir, file or s3://bucket/prefix (default: config capture.source).")
]
SinceOpt = Annotated[Optional[str], typer.Option(
    "--since", callback=_when, help="First hour to read (YYYY-MM-DD[THH], or 6h/2d ago).")]
UntilOpt = Annotated[Optional[str], typer.Option(
    "--until", callback=_when, help="Hour to stop before (exclusive), same forms as --since.")]
EndpointOpt = Annotated[Optional[str], typer.Option("--endpoint", help="Only this endpoint (default: config capture.endpoint).")]

dataset_app = command_group(help="The captured conversation dataset.")


def ingest_cmd(
    source: SourceOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    endpoint: EndpointOpt = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Turn new Data Capture files into deduplicated ShareGPT conversations in the warehouse."""
    cfg = get_config(config, json_)
    from capture.catalog import CatalogError
    from capture.ingest import ingest
    from capture.warehouse import WriterLost

    try:
        res = ingest(cfg, source=source, since=since, until=until, endpoint=endpoint)
    except (WriterLost, CatalogError, FileNotFoundError, ValueError) as exc:
        fail(error_text(exc))
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


@dataset_app.command("stats")
def stats_cmd(
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    tokens: Annotated[bool, typer.Option(
        "--tokens", help="Also tokenize the train split with the target's tokenizer: trained tokens by kind "
                         "(reasoning, content, tool calls, end of turn), rows skipped and examples inexact by reason.")] = False,
) -> None:
    """Counts per split, day, format and endpoint; token length percentiles."""
    from capture.split import stats

    cfg = get_config(config, json_)
    st = stats(cfg)
    lines = [f"{st['conversations']} conversations ({', '.join(f'{k} {v}' for k, v in st['splits'].items())})"]
    for key in ("days", "formats", "endpoints"):
        if st[key]:
            lines.append(f"  {key}: " + ", ".join(f"{k}={v}" for k, v in st[key].items()))
    if st["tokens"]:
        lines.append("  tokens: " + ", ".join(f"{k}={v}" for k, v in st["tokens"].items()))
    lines.append(f"  quarantined {st['quarantined']}, skipped {st['skipped']}")
    if tokens:
        st["trained"] = _trained_tokens(cfg, "train")
        tr = st["trained"]
        lines.append("  trained tokens: " + ", ".join(f"{k}={v}" for k, v in tr["tokens"].items()))
        lines.append(f"  rows {tr['rows']}: {tr['tokenized']} tokenized into {tr['examples']} examples "
                     f"({', '.join(f'{k}={v}' for k, v in tr['sources'].items()) or 'none'})")
        for key in ("skipped", "inexact"):
            if tr[key]:
                lines.append(f"  {key}: " + ", ".join(f"{k}={v}" for k, v in tr[key].items()))
    emit(st, json_, human="\n".join(lines))


def _target_tokenizer(cfg):
    from transformers import AutoTokenizer

    from targets.model_zoo import ModelZooError, ensure_target

    try:
        return AutoTokenizer.from_pretrained(ensure_target(cfg.target.model, cfg.target.model_cache))
    except (ModelZooError, OSError) as exc:
        fail(error_text(exc))


def _trained_tokens(cfg, split: str) -> dict:
    """What training makes of ``split``: its TokenizeReport plus the loss tokens by kind."""
    from adapt.data import TokenizeReport, token_split, tokenize_rows
    from capture.split import load_split

    tok = _target_tokenizer(cfg)
    rep = TokenizeReport()
    examples = tokenize_rows(tok, load_split(cfg, split), cfg.training.max_seq_len, rep)
    return {**rep.to_dict(), "tokens": token_split(tok, examples)}


@dataset_app.command("tokens")
def tokens_cmd(
    split: Annotated[Literal["train", "heldout"], typer.Option("--split", help="train or heldout.")] = "train",
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="The first N rows only.")] = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """What a head would train on: one example a line, {row_id, input_ids, loss_mask, source}
    (without --json, with the decoded text, trained tokens between [[ and ]]). Rows that cannot be
    rendered are counted on stderr."""
    import json
    import sys

    from adapt.data import TokenizeReport, tokenize_rows
    from capture.split import load_split

    cfg = get_config(config, json_)
    tok = _target_tokenizer(cfg)
    rows = load_split(cfg, split)
    rep = TokenizeReport()
    for ex in tokenize_rows(tok, rows[:limit] if limit else rows, cfg.training.max_seq_len, rep):
        ids, mask = ex.input_ids.tolist(), [int(m) for m in ex.loss_mask.tolist()]
        obj = {"row_id": ex.row_id, "input_ids": ids, "loss_mask": mask, "source": ex.source}
        if ex.inexact:
            obj["inexact"] = list(ex.inexact)
        if not json_:
            parts, i = [], 0
            while i < len(ids):
                j = i
                while j < len(ids) and mask[j] == mask[i]:
                    j += 1
                text = tok.decode(ids[i:j])
                parts.append(f"[[{text}]]" if mask[i] else text)
                i = j
            obj["text"] = "".join(parts)
        sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    r = rep.to_dict()
    sys.stderr.write(f"{split}: {r['rows']} rows, {r['tokenized']} tokenized into {r['examples']} examples"
                     + "".join(f"; {k}: " + ", ".join(f"{a}={b}" for a, b in r[k].items())
                               for k in ("sources", "skipped", "inexact") if r[k]) + "\n")


@dataset_app.command("export")
def export_cmd(
    split: Annotated[Literal["train", "heldout"], typer.Option("--split", help="train or heldout.")] = "train",
    out: Annotated[Path, typer.Option("--out", help="ShareGPT JSONL file to write.")] = Path("sharegpt.jsonl"),
    force: ForceOpt = False,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Write one split as ShareGPT JSONL (plus tools, tool calls, reasoning and token ids where captured)."""
    cfg = get_config(config, json_)
    from capture.split import export

    if out.exists() and not force:
        fail(f"{out} exists: pass --force to replace it")
    n = export(cfg, split, out)
    emit({"split": split, "rows": n, "out": str(out)}, json_, human=f"wrote {n} {split} conversations to {out}")


def register(app: typer.Typer) -> None:
    app.command("ingest")(ingest_cmd)
    app.add_typer(dataset_app, name="dataset")
