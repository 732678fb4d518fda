"""Show what a LoRA file is: model family, module counts, ranks, alphas, precision, size and the
training metadata sd-scripts (or we) wrote into it. A file that is not a kohya LoRA is reported as such.
Read from the file's header alone, without torch: it answers in a fraction of a second whatever the size."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.safetensors", help="a kohya-format LoRA file, or a run's folder (its "
                        "LoRA)")
    parser.add_argument("--json", action="store_true", help="print everything as JSON (full metadata included)")
    parser.add_argument("--diffusers-out", metavar="OUT.safetensors", help="also write a copy under diffusers' "
                        "peft names, for pipelines that do not read kohya names (diffusers' SD3 pipeline)")


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return str(num_bytes)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} x{value}" for key, value in counts.items()) or "-"


def _family_line(info: dict[str, Any]) -> str:
    from sd_scripts_compat.facts.families import get_family

    if info["family"]:
        return f"{info['family']} ({get_family(info['family']).description})"
    if info["family_candidates"]:
        return "one of " + ", ".join(info["family_candidates"])
    return f"unknown ({info['family_label']})"


def _short(value: str, limit: int = 100) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def _tag_summary(raw: str) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return _short(raw)
    tags: dict[str, int] = {}
    for per_dir in data.values() if isinstance(data, dict) else []:
        for tag, count in (per_dir or {}).items():
            tags[tag] = tags.get(tag, 0) + int(count)
    top = sorted(tags.items(), key=lambda item: -item[1])[:8]
    return f"{len(tags)} tags; top: " + ", ".join(f"{tag} ({count})" for tag, count in top) if tags else "-"


def _export(info: dict[str, Any], out: str) -> None:
    from sd_scripts_compat.facts.errors import UserError
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.network.diffusers_export import export_diffusers_file

    if not info["family"]:
        raise UserError(f"{info['file']}: its model family is not known ({_family_line(info)}), so its modules "
                        "cannot be named for diffusers")
    count = export_diffusers_file(info["file"], out, get_family(info["family"]))
    print(f"wrote {out}: {count} tensors under diffusers' names (load with pipe.load_lora_weights)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from autotune.report.load import run_lora
    from sd_scripts_compat.network.lora_file import TRAINING_FIELDS, describe_lora_file

    info = describe_lora_file(run_lora(Path(args.file)))  # UserError (not a LoRA, corrupt) -> one line, exit 2
    if args.diffusers_out:
        from autotune.own_files import refuse_foreign_lora_copy

        refuse_foreign_lora_copy(Path(args.diffusers_out), Path(info["file"]), "--diffusers-out")
        _export(info, args.diffusers_out)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=False))
        return 0
    console = Console()
    modules = info["modules"]
    te = _counts(modules["text_encoders"])
    summary = Table(title=f"LoRA {info['file']}", show_header=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("family", _family_line(info))
    summary.add_row("modules", f"{modules['total']} (UNet {modules['unet']}, text encoder {te})")
    summary.add_row("conv (LoCon)", f"yes: {modules['unet_conv3x3']} 3x3-conv modules, ranks "
                    f"{_counts(info['conv_ranks'])}" if info["conv"] else "no")
    summary.add_row("rank(s)", _counts(info["ranks"]))
    summary.add_row("alpha(s)", _counts(info["alphas"]))
    summary.add_row("precision", _counts(info["precision"]))
    summary.add_row("parameters", f"{info['parameters']:,}")
    summary.add_row("file size", _size(info["file_size"]))
    summary.add_row("network module", info["network_module"] or "-")
    console.print(summary)

    metadata = info["metadata"]
    if not metadata:
        console.print("no training metadata in this file")
        return 0
    table = Table(title="training metadata")
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    shown = set()
    for label, key in TRAINING_FIELDS:
        if key in metadata:
            table.add_row(label, _short(info["training"][label]))  # times as ISO 8601
            shown.add(key)
    if "ss_tag_frequency" in metadata:
        table.add_row("tags", _tag_summary(metadata["ss_tag_frequency"]))
        shown.add("ss_tag_frequency")
    for key in sorted(set(metadata) - shown):
        table.add_row(key, _short(metadata[key]))
    console.print(table)
    return 0
