"""Check a dataset before training: every image, caption and bucket, each problem naming its file and the fix.

    autotune doctor DATASET/
    autotune doctor DATASET/ --model builtin:tiny-sd15 --batch 4
    autotune doctor DATASET/ --model model.safetensors --config config.toml [--dataset-config dataset.toml]
    autotune doctor DATASET/ --json > report.json
    autotune doctor DATASET/ --html report.html --strict

Per subset: images, repeats, captions found / missing / orphaned / empty, corrupt or truncated images,
unsupported formats, alpha / palette / 16-bit / CMYK images and what the engine makes of them, EXIF rotation,
decompression bombs (over 89.5 MP: only the header is read), exact duplicates, caption length in CLIP tokens
against max_token_length, class tokens missing from captions, top tags; then the bucket histogram for the
resolution and batch, the images whose bucket is smaller than a batch, and the true steps per epoch.
Images are decoded over every core, with a progress bar on a terminal; --quick reads their headers only.

Exit status: 0 when the report has no errors (warnings allowed), and also with errors unless --strict;
1 with --strict when there is an error; 2 for bad input (no such folder, a bad option).
`autotune run` runs the same checks first and refuses to start on an error (--skip-doctor skips them).
"""

from __future__ import annotations

import argparse

EXIT_ERRORS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("dataset", metavar="DATASET", help="folder of N_name image subfolders (N = repeats)")
    parser.add_argument("--model", default=None, metavar="PATH|builtin:ID",
                        help="the base model: its family sets the bucket rules and default resolution")
    parser.add_argument("--family", default=None, help="model family when it cannot be detected (e.g. sd2-v)")
    parser.add_argument("--resolution", type=int, default=None,
                        help="training resolution in px (default: the model's native size, else 512)")
    parser.add_argument("--batch", type=int, default=None, help="train batch size (default 1)")
    parser.add_argument("--frames", type=int, default=None,
                        help="a video family's clip length (e.g. 33): check the folders' videos, their frame counts "
                        "and lengths, for clips of this many frames")
    parser.add_argument("--caption-extension", default=None,
                        help="caption file extension (default: the one most captions use, as `autotune plan` picks)")
    parser.add_argument("--max-token-length", type=int, choices=(75, 150, 225), default=None,
                        help="kohya's max_token_length (default 75)")
    parser.add_argument("--config", default=None, metavar="config.toml",
                        help="check for the resolution, batch, caption extension and token length this sd-scripts / "
                        "lora-scripts config trains with (read as the engine reads it; flags above still win)")
    parser.add_argument("--dataset-config", default=None, metavar="dataset.toml",
                        help="with --config: its dataset.toml (batch, resolution and captions there win)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object "
                        "(format lora-autotune-doctor/1, see autotune/doctor/render_json.py)")
    parser.add_argument("--html", metavar="REPORT.html", default=None,
                        help="also write a self-contained HTML page: bucket histogram, thumbnails of problem images")
    parser.add_argument("--strict", action="store_true", help="exit 1 when there is an error (warnings never fail)")
    parser.add_argument("--quick", action="store_true",
                        help="read image headers only (sizes, modes, EXIF rotation): seconds for 100,000 images, but a "
                        "truncated or corrupt file, alpha and 16-bit pictures go unseen")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autotune.own_files import refuse_foreign_page, refuse_out_in_dataset

    if args.html:  # said before the images are read, not after
        refuse_foreign_page(Path(args.html), "--html")
        refuse_out_in_dataset(Path(args.html), Path(args.dataset), "--html")
    from autotune.doctor.diagnose import diagnose_options
    from autotune.progress import stderr_progress

    with stderr_progress("checking images") as progress:
        report = diagnose_options(args, progress)
    written = None
    if args.html:
        from autotune.doctor.render_html import write_html

        written = write_html(report, args.html)
    if args.json:
        from autotune.doctor.render_json import to_json

        print(to_json(report))
    else:
        from autotune.doctor.render_text import print_report

        print_report(report)
        if written:
            print(f"HTML report: {written}")
    return EXIT_ERRORS if args.strict and report.errors else 0
