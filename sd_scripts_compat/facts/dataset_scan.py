"""One dataset scan: which files are images, kohya's ``N_name`` folder rule, and what a dataset folder holds.

Every reader of a dataset folder goes through here, so they cannot disagree about it: the engine's
folder convention (``train_data_dir``) and image listing, ``autotune plan`` (counting images and
repeats) and ``autotune run`` (checking the folder before anything heavy). The scan lists each folder once
(``FolderListing``: one ``os.scandir``, whose entries say file or folder without a ``stat`` of their own) and
answers every question from that listing: which files are images, which are hidden, which images have captions.
It never opens a file, so its cost grows with the number of files and nothing else.

The rules (sd-scripts'):

- an image is a file ending in one of ``IMAGE_EXTENSIONS``, in any letter case, whose name does not start
  with ``.`` (sd-scripts' glob skips hidden files, macOS' ``._name.png`` resource forks among them);
- a subfolder ``N_name`` holds images repeated N times per epoch with class tokens ``name``
  (``10_sks dog`` -> 10, "sks dog"); a subfolder whose name does not start with an integer is
  skipped, and so is one with N below 1 (its images would be seen 0 times);
- a caption is the file next to an image with the image's stem and a caption extension (``caption_coverage``
  also says when images have caption files under another extension than the one that will be read).

``scan_dataset_folder`` adds one rule of its own: images directly in the folder, when it has no
``N_name`` subfolders, form one subset with 1 repeat, or with the folder's own repeats and class tokens when
it is itself an ``N_name`` folder (a dataset.toml can point at any folder; sd-scripts' ``train_data_dir``
cannot, so ``DatasetScan.top_level`` says when that is the case).

A clip dataset (a video family's, musubi-tuner's ``video_directory``) is the same scan over videos:
``media=VIDEO_EXTENSIONS``, musubi-tuner's list as it globs it (exact letter case: ``.mp4`` and ``.MP4``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# IMAGE_EXTENSIONS is defined with the dataset spec (the config reads it too) and imported from here by scanners
from sd_scripts_compat.facts.dataset_spec import IMAGE_EXTENSIONS, MIN_REPEATS, parse_repeat_folder
from sd_scripts_compat.facts.errors import UserError

CAPTION_EXTENSIONS = (".txt", ".caption")  # lora-scripts' default first, then sd-scripts' argparse default
# musubi-tuner's dataset/media_utils.VIDEO_EXTENSIONS: it globs each, so only these exact suffixes are read
VIDEO_EXTENSIONS = (".mp4", ".webm", ".avi", ".mkv", ".mov", ".flv", ".wmv", ".m4v", ".mpg", ".mpeg",
                    ".MP4", ".WEBM", ".AVI", ".MKV", ".MOV", ".FLV", ".WMV", ".M4V", ".MPG", ".MPEG")


def media_noun(media: tuple[str, ...]) -> str:
    """What a sample of ``media`` is called in messages: "videos" or "images"."""
    return "videos" if media is VIDEO_EXTENSIONS else "images"


def listed(media: tuple[str, ...]) -> str:
    """The extensions for a message, once each in lower case."""
    return ", ".join(dict.fromkeys(m.lower() for m in media))


def is_image_name(name: str, media: tuple[str, ...] = IMAGE_EXTENSIONS) -> bool:
    """An image (any letter case), or with ``media=VIDEO_EXTENSIONS`` a video as musubi-tuner globs them, by the
    file name's last suffix (as ``Path.suffix`` reads it)."""
    suffix = os.path.splitext(name)[1]
    return (suffix if media is VIDEO_EXTENSIONS else suffix.lower()) in media


@dataclass(frozen=True)
class FolderListing:
    """One folder as one ``os.scandir`` saw it: the names of its files and of its subfolders (links followed, as
    ``Path.is_file`` / ``is_dir`` follow them). Every rule of the scan reads a folder through one of these."""

    folder: Path
    files: frozenset[str]
    folders: tuple[str, ...]  # sorted

    @classmethod
    def read(cls, folder: Path) -> FolderListing:
        files, folders = set(), []
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    if entry.is_file():
                        files.add(entry.name)
                    elif entry.is_dir():
                        folders.append(entry.name)
                except OSError:  # a link to nowhere, or gone since the listing: neither a file nor a folder
                    continue
        return cls(folder, frozenset(files), tuple(sorted(folders)))

    def images(self, media: tuple[str, ...] = IMAGE_EXTENSIONS) -> list[Path]:
        """The images (or videos), sorted by name (so runs never depend on the listing order); hidden files are
        not images, as in sd-scripts."""
        return [self.folder / name for name in sorted(self.files)
                if not name.startswith(".") and is_image_name(name, media)]

    def hidden_images(self, media: tuple[str, ...] = IMAGE_EXTENSIONS) -> int:
        """Image-named files that ``images`` passes over because their name starts with a dot."""
        return sum(1 for name in self.files if name.startswith(".") and is_image_name(name, media))

    def caption_suffixes(self) -> dict[str, list[str]]:
        """Stem -> the caption-like suffixes (``.txt`` / ``.caption`` in any letter case) of its files, sorted."""
        found: dict[str, list[str]] = {}
        for name in sorted(self.files):
            stem, suffix = os.path.splitext(name)
            if suffix.lower() in CAPTION_EXTENSIONS:
                found.setdefault(stem, []).append(suffix)
        return found


@dataclass(frozen=True)
class CaptionCoverage:
    """How many of some images have a caption under ``extension``, and, for those that do not, the other
    caption extensions (letter case included) their caption files have: files the run would never read."""

    extension: str
    images: int
    captioned: int
    elsewhere: dict[str, int]

    def line(self) -> str:
        return f"{self.captioned} of {self.images} images captioned ({self.extension})"

    def problem(self) -> str | None:
        """One line when captions exist under another extension; None otherwise."""
        if not self.elsewhere:
            return None
        other, count = max(self.elsewhere.items(), key=lambda item: item[1])
        return (f"{count} image(s) have no {self.extension} caption but a {other} one beside them, which is not read "
                f"(caption_extension = \"{self.extension}\"); set caption_extension = \"{other}\" or rename the files")


def caption_coverage(images: Iterable[Path], extension: str,
                     listings: Iterable[FolderListing] = ()) -> CaptionCoverage:
    """Captions present under ``extension`` (exact case, as the engine and sd-scripts open them) and the other
    caption-like files (``.txt`` / ``.caption`` in any case) of the images without one. Each folder is read
    once: from ``listings`` when the caller has them, else listed here."""
    known = {listing.folder: listing for listing in listings}
    suffixes: dict[Path, dict[str, list[str]]] = {}
    captioned, total = 0, 0
    elsewhere: dict[str, int] = {}
    for image in images:
        total += 1
        listing = known.get(image.parent)
        if listing is None:
            listing = known[image.parent] = FolderListing.read(image.parent)
        if image.stem + extension in listing.files:
            captioned += 1
            continue
        if listing.folder not in suffixes:
            suffixes[listing.folder] = listing.caption_suffixes()
        for other in suffixes[listing.folder].get(image.stem, [])[:1]:
            elsewhere[other] = elsewhere.get(other, 0) + 1
    return CaptionCoverage(extension=extension, images=total, captioned=captioned, elsewhere=elsewhere)




@dataclass(frozen=True)
class SubsetScan:
    """One image folder: its repeats and class tokens (None when the folder name gives none), its images,
    and the caption files next to them by extension (every extension of the scan is a key)."""

    folder: Path
    num_repeats: int
    class_tokens: str | None
    images: tuple[Path, ...]
    caption_files: dict[str, tuple[Path, ...]] = field(hash=False)
    listing: FolderListing = field(hash=False, repr=False)  # the folder as the scan read it, for its other readers

    @property
    def num_images(self) -> int:
        return len(self.images)

    def caption_extensions(self) -> list[str | None]:
        """Per image (in ``images`` order): the first caption extension, in the scan's order, that it has a
        caption file for; None for an image without one."""
        present = {ext: set(files) for ext, files in self.caption_files.items()}
        return [next((ext for ext, files in present.items() if image.with_suffix(ext) in files), None)
                for image in self.images]


@dataclass(frozen=True)
class DatasetScan:
    """What a dataset folder holds. ``subsets`` is empty when it holds no usable images (see
    ``require_images``); ``warnings`` name every folder skipped and why."""

    root: Path
    subsets: tuple[SubsetScan, ...]
    warnings: tuple[str, ...]
    top_level: bool  # the one subset is ``root`` itself: images directly in the folder, 1 repeat
    listing: FolderListing = field(hash=False, repr=False)  # ``root`` as the scan read it

    @property
    def num_images(self) -> int:
        return sum(s.num_images for s in self.subsets)

    @property
    def views_per_epoch(self) -> int:
        """Images seen in one kohya epoch: each folder's images times its repeats."""
        return sum(s.num_images * s.num_repeats for s in self.subsets)


def _subset(listing: FolderListing, repeats: int, tokens: str | None, images: list[Path],
            caption_extensions: tuple[str, ...]) -> SubsetScan:
    captions = {ext: tuple(listing.folder / name for name in (image.stem + ext for image in images)
                           if name in listing.files)
                for ext in caption_extensions}
    return SubsetScan(folder=listing.folder, num_repeats=repeats, class_tokens=tokens, images=tuple(images),
                      caption_files=captions, listing=listing)


def scan_dataset_folder(path: str | os.PathLike[str], caption_extensions: tuple[str, ...] = CAPTION_EXTENSIONS,
                        media: tuple[str, ...] = IMAGE_EXTENSIONS) -> DatasetScan:
    """Scan a dataset folder the way sd-scripts reads ``--train_data_dir`` (see the module docstring).

    Subfolders are taken in sorted order; hidden ones (``.name``) are passed over silently. A missing
    folder is a one-line UserError; a folder without usable images is not (``subsets`` is empty and
    ``warnings`` say why), so a caller can report everything at once. ``media``: the files a sample is (videos
    for a clip dataset).
    """
    noun = media_noun(media)
    try:
        root = Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop (RuntimeError before Python 3.13)
        raise UserError(f"dataset folder {path}: cannot resolve the path ({error}); give a real folder") from None
    if not root.is_dir():
        raise UserError(f"dataset folder {path} not found; give a folder of images or of N_name subfolders "
                        "(e.g. 10_mychar/)")
    subsets: list[SubsetScan] = []
    warnings: list[str] = []
    repeat_folders = 0
    hidden = 0
    top_listing = FolderListing.read(root)
    for folder in (root / name for name in top_listing.folders if not name.startswith(".")):
        parsed = parse_repeat_folder(folder.name)
        if parsed is None:
            warnings.append(f"{folder.name}/ skipped: not named N_name (N = repeats, e.g. 10_{folder.name}), "
                            "as sd-scripts skips it")
            continue
        repeats, tokens = parsed
        repeat_folders += 1
        if repeats < MIN_REPEATS:
            warnings.append(f"{folder.name}/ skipped: {repeats} repeats means its images are seen 0 times "
                            "(sd-scripts skips it); name it e.g. 1_" + (tokens or "name"))
            continue
        listing = FolderListing.read(folder)
        images = listing.images(media)
        hidden += listing.hidden_images(media)
        if not images:
            warnings.append(f"{folder.name}/ holds no {noun} ({listed(media)}); skipped")
            continue
        subsets.append(_subset(listing, repeats, tokens or None, images, caption_extensions))
    top = top_listing.images(media)
    if top and repeat_folders:
        warnings.append(f"{len(top)} {noun[:-1]}(s) directly in {root.name}/ not used: with N_name subfolders, "
                        f"only their {noun} are read")
    top_level = bool(top) and not repeat_folders
    if top_level:
        hidden += top_listing.hidden_images(media)
        repeats, own_tokens = _own_repeats(root)
        subsets.append(_subset(top_listing, repeats, own_tokens, top, caption_extensions))
    if hidden:
        warnings.append(f"{hidden} hidden {noun[:-1]} file(s) skipped (names starting with '.', such as macOS ._ "
                        "files), as sd-scripts skips them")
    return DatasetScan(root=root, subsets=tuple(subsets), warnings=tuple(warnings), top_level=top_level,
                       listing=top_listing)


def _own_repeats(folder: Path) -> tuple[int, str | None]:
    """An ``N_name`` folder given itself keeps its repeats and class tokens (1 and None for any other name)."""
    parsed = parse_repeat_folder(folder.name)
    if parsed is None or parsed[0] < MIN_REPEATS:
        return 1, None
    return parsed[0], parsed[1] or None


def require_images(scan: DatasetScan, media: tuple[str, ...] = IMAGE_EXTENSIONS) -> DatasetScan:
    """``scan`` itself, or a one-line UserError when it found no images (videos) to train on."""
    if scan.subsets:
        return scan
    noun = media_noun(media)
    why = f" ({'; '.join(scan.warnings)})" if scan.warnings else ""
    raise UserError(f"dataset folder {scan.root} holds no {noun} in N_name subfolders{why}; put {noun} "
                    f"({listed(media)}) in e.g. {scan.root / '10_mychar'}")
