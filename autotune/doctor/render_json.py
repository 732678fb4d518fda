"""`autotune doctor --json`: the report as one stable JSON object.

Format ``lora-autotune-doctor/1``. Keys are only ever added within a format version; a removed or renamed
key bumps it. Paths are relative to ``dataset`` with ``/`` separators ("." is the folder itself).

    {
      "format": "lora-autotune-doctor/1",
      "dataset": "/abs/path",
      "ok": true,                        # no errors (what `autotune run` needs)
      "summary": {"errors": 0, "warnings": 2, "images": 12, "usable_images": 12,
                  "views_per_epoch": 120, "steps_per_epoch": 120},
      "settings": {"family": "sd15" | null, "resolution": 512, "batch_size": 1, "bucket_reso_steps": 64,
                   "min_bucket_reso": 256, "max_bucket_reso": 1024, "bucket_no_upscale": true,
                   "caption_extension": ".txt", "max_token_length": 75, "bomb_limit_pixels": 89478485,
                   "frames": 1, "quick": false},
      "subsets": [{"folder": "10_name", "num_repeats": 10, "class_tokens": "name" | null, "images": 4,
                   "usable_images": 4, "captions": {"found": 4, "missing": 0, "orphaned": 0, "empty": 0},
                   "modes": {"RGB": 4}, "top_tags": [["name", 4], ...]}],
      "buckets": [{"width": 512, "height": 512, "images": 4, "views": 40, "batches": 40, "last_batch": 1}],
      "problems": [{"severity": "error" | "warning", "code": "...", "file": "10_name/a.png",
                    "message": "...", "fix": "..."}]      # errors first, then by file
    }

Problem codes: images: empty-file, unreadable, corrupt, truncated, bomb, high-bit-depth, mode-unsupported (errors),
alpha, palette, cmyk, exif-rotation (warnings); captions: caption-empty, caption-not-utf8, caption-unreadable (errors),
caption-blank, caption-multiline, caption-missing, caption-none, caption-orphan, caption-other-extension,
caption-too-long, trigger-missing; folders: no-images (error), folder-skipped, top-level-ignored,
unsupported-format; duplicate; buckets: too-small (error), small, bucket-under-batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from autotune.doctor.report import DoctorReport

FORMAT = "lora-autotune-doctor/1"


def report_dict(report: DoctorReport) -> dict[str, Any]:
    subsets = [{"folder": s.folder, "num_repeats": s.num_repeats, "class_tokens": s.class_tokens, "images": s.images,
                "usable_images": s.usable_images,
                "captions": {"found": s.captions_found, "missing": s.captions_missing,
                             "orphaned": s.captions_orphaned, "empty": s.captions_empty},
                "modes": dict(s.modes), "top_tags": [list(tag) for tag in s.top_tags],
                **({"clips": s.clips} if s.clips else {})} for s in report.subsets]
    return {
        "format": FORMAT,
        "dataset": report.root,
        "ok": report.ok,
        "summary": {"errors": len(report.errors), "warnings": len(report.warnings), "images": report.num_images,
                    "usable_images": sum(s.usable_images for s in report.subsets),
                    "views_per_epoch": report.views_per_epoch, "steps_per_epoch": report.steps_per_epoch},
        "settings": asdict(report.settings),
        "subsets": subsets,
        "buckets": [asdict(row) for row in report.buckets],
        "problems": [asdict(problem) for problem in report.problems],
    }


def to_json(report: DoctorReport) -> str:
    return json.dumps(report_dict(report), indent=2, ensure_ascii=False)
