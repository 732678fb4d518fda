"""``diagnose``: every check on a dataset folder, before training, as one DoctorReport.

The folder is listed by the engine's one scan (``scan_dataset_folder``), the caption extension is the one
the planner will write (``autotune.planning.dataset.summarise``), the buckets are the planner's rules on the
engine's bucket code. Everything the doctor finds becomes a problem naming a file; only input the user must
fix before anything can be said (a missing folder, a bad --resolution/--batch) is a UserError.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.doctor.buckets import DEFAULT_RESOLUTION, STAND_IN_FAMILY, BucketItem, bucket_config, plan_buckets
from autotune.doctor.captions import CaptionReader, TokenCounter, check_captions, shipped_token_counter, top_tags
from autotune.doctor.duplicates import duplicate_problems
from autotune.doctor.file_facts import FileFacts, cached_captions, cached_checks, cached_sha256
from autotune.doctor.folders import scan_problems, unsupported_files
from autotune.doctor.image_pool import Progress
from autotune.doctor.images import BOMB_LIMIT_PIXELS, ImageCheck
from autotune.doctor.report import (
    ERROR,
    DoctorReport,
    DoctorSettings,
    Problem,
    SubsetFacts,
    rel_name,
    sort_problems,
)
from autotune.doctor.videos import check_video, clip_summary
from sd_scripts_compat.dataset.buckets import BucketConfig
from sd_scripts_compat.facts.dataset_scan import (
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    DatasetScan,
    SubsetScan,
    scan_dataset_folder,
)
from sd_scripts_compat.facts.dataset_spec import caption_extension_problem, normalize_caption_extension
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec

TOP_TAGS = 10


def resolve_family(model: str | None, family: str | None) -> FamilySpec | None:
    """The model's family (from headers and configs, no weights), the stated one, or None."""
    from sd_scripts_compat.models.detect import detect_family, known_family

    if model:
        return detect_family(model, family)
    return known_family(family) if family else None


def diagnose(dataset_dir: str | os.PathLike[str], *, family: FamilySpec | None = None,
             resolution: int | None = None, batch: int | None = None, caption_extension: str | None = None,
             max_token_length: int | None = None, count_tokens: TokenCounter | None = None,
             buckets: BucketConfig | None = None, frames: int | None = None,
             quick: bool = False, progress: Progress | None = None) -> DoctorReport:
    """Check a dataset folder for everything that would silently shrink it, crash the run or train garbage.

    ``family`` (the caller's detected ``FamilySpec``: ``resolve_family`` at the edge) picks the bucket rules and the
    default resolution (the family's native size, else 512 px); ``batch`` (default 1) decides which buckets are
    smaller than a batch; ``caption_extension`` defaults to the planner's choice; ``max_token_length`` is kohya's
    (None = 75). ``count_tokens`` replaces the shipped CLIP tokenizer (callers that check many datasets load it
    once). ``buckets``: a config's own bucketing keys (``options_from_config``) instead of the planner's for the
    resolution. ``frames`` above 1: a clip dataset of a video family, its videos checked instead
    (``videos.check_video``). ``quick``: image headers only (no decode: a truncated or corrupt body, alpha and
    16-bit pictures go unseen). ``progress(done, total)`` is told as the images are checked (over the cores:
    ``image_pool``).
    """
    from autotune.planning.dataset import summarise
    from autotune.planning.request import validate_resolution
    from sd_scripts_compat.models.detect import known_family
    from sd_scripts_compat.models.text_encoding import check_max_token_length

    frames = _clip_frames(frames, family)
    scan = scan_dataset_folder(dataset_dir, media=VIDEO_EXTENSIONS if frames > 1 else IMAGE_EXTENSIONS)
    side = resolution if resolution is not None else (family.resolution if family else DEFAULT_RESOLUTION)
    if side <= 0:
        raise UserError(f"--resolution {side}: must be a positive number of pixels (e.g. 512)")
    if family and buckets is None:  # a pinned --resolution, as the planner checks it (FLUX: multiples of 16, ...)
        validate_resolution(resolution, family)
    batch = 1 if batch is None else batch
    if batch < 1:
        raise UserError(f"--batch {batch}: must be 1 or more")
    if caption_extension is not None:
        caption_extension = normalize_caption_extension(caption_extension)  # "txt" -> ".txt", as sd-scripts
        problem = caption_extension_problem(caption_extension, IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)
        if problem:
            raise UserError(f"--caption-extension {caption_extension}: {problem}")
    limit = check_max_token_length(max_token_length)
    config = buckets if buckets is not None else bucket_config(family or known_family(STAND_IN_FAMILY), side)
    extension = caption_extension or summarise(scan).caption_extension
    settings = DoctorSettings(family=family.name if family else None, resolution=side, batch_size=batch,
                              bucket_reso_steps=config.bucket_reso_steps, min_bucket_reso=config.min_bucket_reso,
                              max_bucket_reso=config.max_bucket_reso, bucket_no_upscale=config.bucket_no_upscale,
                              caption_extension=extension, max_token_length=limit,
                              bomb_limit_pixels=BOMB_LIMIT_PIXELS, frames=frames, quick=quick)
    problems: list[Problem] = scan_problems(scan)
    clips = {}
    if frames > 1:
        assert family is not None  # _clip_frames: clips only for a video family
        clips = {v: check_video(v, rel_name(v, scan.root), frames, family.temporal_stride)
                 for s in scan.subsets for v in s.images}
    with FileFacts.open() as kept:  # what earlier commands learned of these files
        checks = {v: check for v, (check, _) in clips.items()} or \
            cached_checks(kept, [i for s in scan.subsets for i in s.images], scan.root, quick, progress)
        problems += duplicate_problems([(rel_name(image, scan.root), check) for image, check in checks.items()],
                                       lambda paths: cached_sha256(kept, paths))
        counter = count_tokens or (shipped_token_counter() if scan.subsets else (lambda captions: []))
        subsets, items = [], []
        for subset in scan.subsets:
            facts, found = _subset(scan, subset, checks, extension, counter, limit,
                                   lambda paths: cached_captions(kept, paths, scan.root))
            subsets.append(facts)
            problems += found
            items += [BucketItem(rel_name(i, scan.root), checks[i].size, subset.num_repeats)  # type: ignore[arg-type]
                      for i in subset.images if checks[i].usable]
    rows, bucket_problems, steps = plan_buckets(items, config, batch)
    problems += bucket_problems
    failed = {p.file for p in problems if p.severity == ERROR}
    subsets = [replace(facts, usable_images=sum(rel_name(i, scan.root) not in failed for i in subset.images),
                       clips=clip_summary([f for v in subset.images if (f := clips[v][1])]) if clips else None)
               for facts, subset in zip(subsets, scan.subsets)]
    return DoctorReport(root=str(scan.root), settings=settings, subsets=tuple(subsets), buckets=rows,
                        steps_per_epoch=steps, views_per_epoch=sum(r.views for r in rows),
                        problems=sort_problems(problems))


def _clip_frames(frames: int | None, spec: FamilySpec | None) -> int:
    """The clip length to check for: ``frames`` where given (only for a video family), else 1 (images)."""
    if frames is None or frames == 1:
        return 1
    if spec is None or not (spec.musubi or {}).get("video"):
        raise UserError(f"--frames {frames}: clips are for a video family; add --model builtin:wan2.1-t2v-1.3b "
                        "(or your Wan file), or drop --frames")
    from autotune.planning.request import validate_frames

    validate_frames(frames, spec)
    return frames


def _subset(scan: DatasetScan, subset: SubsetScan, checks: dict[Path, ImageCheck], extension: str,
            counter: TokenCounter, limit: int, reader: CaptionReader) -> tuple[SubsetFacts, list[Problem]]:
    """One folder's facts and problems: its images' checks, its captions, its unsupported files."""
    problems = [p for image in subset.images for p in checks[image].problems]
    problems += unsupported_files(subset, scan.root)
    captions = check_captions(subset, scan.root, extension, counter, limit, reader)
    problems += captions.problems
    modes = Counter(checks[image].mode or "unknown" for image in subset.images)
    facts = SubsetFacts(folder=rel_name(subset.folder, scan.root) if subset.folder != scan.root else ".",
                        num_repeats=subset.num_repeats, class_tokens=subset.class_tokens, images=subset.num_images,
                        usable_images=0,  # known once the buckets are made (an image too small for any)
                        captions_found=captions.found, captions_missing=captions.missing,
                        captions_orphaned=captions.orphaned, captions_empty=captions.empty,
                        modes=tuple(sorted(modes.items())), top_tags=top_tags(captions.captions, TOP_TAGS))
    return facts, problems


def options_from_config(config: str | os.PathLike[str], dataset_config: str | os.PathLike[str] | None, *,
                        family: FamilySpec | None,
                        dataset_dir: str | os.PathLike[str] | None = None) -> dict[str, object]:
    """The doctor's options as a training config resolves them, read by the engine's own reader (kohya's
    precedence: dataset.toml over config.toml): resolution (the longer side), batch, caption extension,
    max_token_length. Without ``dataset_config`` the images are ``dataset_dir``'s, as `autotune run` trains."""
    from sd_scripts_compat.config.resolved_run import settings_from_files

    script = family.script if family else "train_network"
    default = (family.resolution, family.resolution) if family else (DEFAULT_RESOLUTION, DEFAULT_RESOLUTION)
    resolved = settings_from_files(Path(config), Path(dataset_config) if dataset_config is not None else None,
                                   script=script, default_resolution=default,
                                   train_data_dir=_train_data_dir(dataset_dir))
    extensions = {subset.caption_extension for subset in resolved.dataset.subsets}
    return {"resolution": max(resolved.settings.resolution), "batch": resolved.settings.train_batch_size,
            "caption_extension": extensions.pop() if len(extensions) == 1 else None,
            "max_token_length": resolved.config.max_token_length, "buckets": BucketConfig.of(resolved.dataset)}


def _train_data_dir(dataset_dir: str | os.PathLike[str] | None) -> str | None:
    """The folder as train_data_dir, or its parent for an N_name folder given itself (its settings are the same)."""
    from sd_scripts_compat.facts.dataset_spec import parse_repeat_folder

    if dataset_dir is None:
        return None
    path = Path(dataset_dir).resolve()
    return str(path.parent if parse_repeat_folder(path.name) and scan_dataset_folder(path).top_level else path)


def check_before_training(dataset_dir: str | os.PathLike[str], *, family: FamilySpec | None,
                          **options: object) -> list[str]:
    """For `autotune run` and the wizard: the brief lines to show, or a one-line UserError on errors.
    ``family`` is the caller's detected family (None: a full-size family's bucket rules)."""
    from autotune.doctor.report import brief

    report = diagnose(dataset_dir, family=family, **options)  # type: ignore[arg-type]
    if report.errors:
        first = report.errors[0]
        more = f" (and {len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise UserError(f"{Path(report.root) / first.file}: {first.message}{more}; run `autotune doctor "
                        f"{report.root}` for every problem and its fix, or pass --skip-doctor")
    return brief(report)


def diagnose_options(args: argparse.Namespace, progress: Progress | None = None) -> DoctorReport:
    """The report for ``autotune doctor``'s parsed options (the CLI and the web app's ``POST /api/doctor``)."""
    family = resolve_family(args.model, args.family)  # detected once, for the config's reading and the checks
    given: dict[str, Any] = {"resolution": args.resolution, "batch": args.batch, "frames": args.frames,
                                "caption_extension": args.caption_extension, "max_token_length": args.max_token_length}
    if args.config:
        configured = options_from_config(args.config, args.dataset_config, family=family, dataset_dir=args.dataset)
        if args.resolution is None:  # the config's bucketing, unless --resolution asks for the planner's
            given["buckets"] = configured["buckets"]
        given = {key: value if value is not None else configured.get(key) for key, value in given.items()}
    elif args.dataset_config:
        raise UserError("--dataset-config needs --config (the training config it belongs to)")
    return diagnose(args.dataset, family=family, quick=args.quick, progress=progress, **given)
