"""The checks on one image file: readable, whole, not a decompression bomb, and what the engine's loader
will make of its mode (alpha, palette, 16-bit, CMYK) and of its EXIF rotation.

"What the engine will do" is not guessed: for every mode that may go wrong the doctor runs the engine's own
loader (``sd_scripts_compat.dataset.train_dataset.load_image_rgb``, Pillow's ``convert("RGB")``) and
compares its picture with a faithful 8-bit one, so once the loader is fixed these errors disappear by
themselves. A hostile file must never crash the doctor: anything Pillow raises becomes a problem naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.doctor.report import ERROR, WARNING, Problem

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import PIL.Image

# Pillow's own default Image.MAX_IMAGE_PIXELS (a quarter GiB of 24-bit pixels, ~9459 x 9459). Past it Pillow
# warns of a decompression bomb and decoding costs ~0.3 GB of RAM per image; past twice it Pillow refuses to
# open the file at all. No bucket needs a twentieth of it (2048 x 2048 is 4.2 MP), so the doctor reads only
# the header of a larger file and never decodes it: a tiny PNG can claim 20000 x 20000.
BOMB_LIMIT_PIXELS = 89_478_485
HIGH_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
# modes whose convert("RGB") is exact, or is checked by a rule below
PLAIN_MODES = ("1", "L", "RGB", "RGBX", "YCbCr", "P", "CMYK", *ALPHA_MODES, *HIGH_BIT_MODES)
WRONG_LEVELS = 32  # mean grey difference (of 255) at which the engine's RGB is a different picture
EXIF_ORIENTATION = 0x0112
ROTATIONS = {2: "mirrored", 3: "upside down", 4: "upside down and mirrored", 5: "on its side and mirrored",
             6: "on its side", 7: "on its side and mirrored", 8: "on its side"}
REPLACE = "replace it with a PNG or JPEG that opens in an image viewer, or delete it"


@dataclass(frozen=True)
class ImageCheck:
    """One image: its stored size and mode (None when unreadable) and what is wrong with it."""

    path: Path
    size: tuple[int, int] | None
    mode: str | None
    problems: tuple[Problem, ...]
    file_bytes: int | None = None  # its length on disk (the duplicate check compares only files of equal length)

    @property
    def usable(self) -> bool:
        """It would reach the buckets: readable and without an error."""
        return self.size is not None and not any(p.severity == ERROR for p in self.problems)


def check_image(path: Path, rel: str, quick: bool = False) -> ImageCheck:
    """All checks on one file; ``rel`` is its name in problems. Decodes it only below BOMB_LIMIT_PIXELS, and not
    at all when ``quick`` (the header alone: size, mode, EXIF rotation; a truncated or corrupt body, alpha and
    16-bit pictures are not looked at)."""
    length = path.stat().st_size
    if length == 0:
        return ImageCheck(path, None, None, (Problem(ERROR, "empty-file", rel, "the file is empty (0 bytes); the "
                                                     "engine stops when it reaches it", REPLACE),), length)
    header = _read_header(path, rel)
    if isinstance(header, Problem):
        return ImageCheck(path, None, None, (header,), length)
    size, mode, orientation = header
    if size[0] * size[1] > BOMB_LIMIT_PIXELS:
        return ImageCheck(path, size, mode, (_bomb(rel, size),), length)
    if not quick:
        problems, orientation = _decode_problems(path, rel, orientation)
        if problems:
            return ImageCheck(path, size, mode, problems, length)
    try:
        found = _mode_problems(path, rel, mode, decode=not quick)
    except Exception as exc:  # it decoded, yet a conversion failed: the engine's would too
        return ImageCheck(path, size, mode, (Problem(ERROR, "mode-unsupported", rel, f"mode {mode}: converting it "
                                                     f"fails ({exc.__class__.__name__})", REPLACE),), length)
    if orientation in ROTATIONS:
        found.append(Problem(WARNING, "exif-rotation", rel,
                             f"EXIF says it is stored {ROTATIONS[orientation]} (orientation {orientation}); the "
                             "engine ignores EXIF, so it trains that way, in the bucket of its stored shape",
                             "save it upright (e.g. PIL.ImageOps.exif_transpose) without the orientation tag"))
    return ImageCheck(path, size, mode, tuple(found), length)


def _bomb(rel: str, size: tuple[int, int] | None, claimed: str = "") -> Problem:
    pixels = f"{size[0]} x {size[1]} = {size[0] * size[1] / 1e6:.0f} MP" if size else claimed
    return Problem(ERROR, "bomb", rel,
                   f"{pixels} is over the decompression-bomb limit of {BOMB_LIMIT_PIXELS / 1e6:.1f} MP (Pillow's "
                   "default); not decoded: it could exhaust memory, and past twice the limit Pillow refuses it",
                   "downscale it (a long side of 2048 px is plenty for any bucket), or delete it")


def _read_header(path: Path, rel: str) -> tuple[tuple[int, int], str, int] | Problem:
    """(size, mode, EXIF orientation) from the header alone, or the problem that stops it."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DecompressionBombWarning: the doctor applies its own limit
        try:
            with Image.open(path) as image:
                return image.size, image.mode, _orientation(image)
        except Image.DecompressionBombError as exc:
            claimed = _unchecked_header(path)
            return (*claimed, 1) if claimed else _bomb(rel, None, str(exc).split(",")[0])
        except Exception as exc:  # a hostile file may make Pillow raise anything
            what = "Pillow cannot identify it as an image" if isinstance(exc, Image.UnidentifiedImageError) \
                else f"Pillow cannot read its header ({exc.__class__.__name__}: {exc})"
            return Problem(ERROR, "unreadable", rel, f"{what}; the engine stops when it reaches it", REPLACE)


def _orientation(image: PIL.Image.Image, loaded: bool = False) -> int:
    """The EXIF orientation known so far. Pillow's PNG reader decodes the whole picture to look for an eXIf chunk
    after it, so an unloaded PNG answers from the chunks before its pixels (``_decode_problems`` asks again)."""
    if image.format == "PNG" and not loaded and "exif" not in image.info:
        return 1
    try:
        return int(image.getexif().get(EXIF_ORIENTATION, 1))
    except Exception:  # a broken EXIF block only means we cannot tell the rotation
        return 1


def _unchecked_header(path: Path) -> tuple[tuple[int, int], str] | None:
    """The size and mode a too-large file claims, read by its format's Pillow plugin directly (``Image.open``
    refuses it before saying); None when the extension does not name the format."""
    from PIL import Image

    name = Image.registered_extensions().get(path.suffix.lower())
    factory = Image.OPEN.get(name) if name else None
    if factory is None:
        return None
    try:
        with open(path, "rb") as handle:
            image = factory[0](handle, path.name)
            return (int(image.size[0]), int(image.size[1])), str(image.mode)
    except Exception:  # only the size is wanted; the file is reported as a bomb either way
        return None


def _decode_problems(path: Path, rel: str, orientation: int) -> tuple[tuple[Problem, ...], int]:
    """Pillow's integrity check (verify) and a full decode (load), which is what catches a truncated JPEG; and the
    EXIF orientation as the decoded file tells it (a PNG's eXIf chunk may follow its pixels)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stage in ("verify", "load"):
            try:
                with Image.open(path) as image:
                    getattr(image, stage)()
                    if stage == "load" and image.format == "PNG":
                        orientation = _orientation(image, loaded=True)
            except Exception as exc:  # a hostile file may make Pillow raise anything
                truncated = "truncated" in str(exc).lower()
                when = "while caching latents or at the first step that draws it" if stage == "load" \
                    else "when it reads the image sizes"
                what = "it is truncated (the file ends early)" if truncated else \
                    f"it is corrupt ({exc.__class__.__name__}: {exc})"
                return (Problem(ERROR, "truncated" if truncated else "corrupt", rel,
                                f"{what}; the engine stops {when}", REPLACE),), orientation
    return (), orientation


def _mode_problems(path: Path, rel: str, mode: str, decode: bool = True) -> list[Problem]:
    """What the engine's RGB conversion does to this mode, where it is not simply right (without ``decode``, only
    what the mode alone says)."""
    if mode in HIGH_BIT_MODES:
        return _high_bit(path, rel, mode) if decode else []
    found = _alpha(path, rel, mode) if decode else []
    if mode == "P":
        found.append(Problem(WARNING, "palette", rel, "palette image: the engine converts it to RGB faithfully, "
                             "but the LoRA learns its few colours (banding, dithering), fine only for pixel art",
                             "use the full-colour original if there is one"))
    if mode == "CMYK":
        found.append(Problem(WARNING, "cmyk", rel, "CMYK image: the engine converts it to RGB with Pillow's naive "
                             "formula, ignoring any colour profile, so its colours shift",
                             "convert it to sRGB in an image editor and save it as PNG or JPEG"))
    if mode not in PLAIN_MODES and decode:
        found += _engine_fails(path, rel, mode)
    return found


def _engine_rgb(path: Path) -> npt.NDArray[np.uint8]:
    """The engine's picture of the file, as a uint8 (H, W, 3) array."""
    import numpy as np

    from sd_scripts_compat.dataset.train_dataset import load_image_rgb

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(load_image_rgb(path))


def _high_bit(path: Path, rel: str, mode: str) -> list[Problem]:
    """A 16-bit or float greyscale image: compare the engine's RGB with the faithful 8-bit picture."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        values = np.asarray(image).astype(np.float64)
    top = float(values.max()) if values.size else 0.0
    full = 1.0 if mode == "F" and top <= 1.0 else 65535.0 if top > 255 else 255.0
    faithful = float((values * (255.0 / full)).clip(0, 255).mean())
    engine = float(_engine_rgb(path).mean())
    if abs(engine - faithful) < WRONG_LEVELS:
        return []
    shade = "nearly white" if engine > faithful else "nearly black"
    depth = "32-bit float" if mode == "F" else "16-bit"
    return [Problem(ERROR, "high-bit-depth", rel,
                    f"{depth} greyscale ({mode}): the engine's RGB conversion clips instead of scaling, so it trains "
                    f"as a {shade} image (mean grey {engine:.0f} where the picture's is {faithful:.0f})",
                    "save it as an 8-bit image (e.g. PIL: Image.fromarray((array / 257).astype('uint8')))")]


def _alpha(path: Path, rel: str, mode: str) -> list[Problem]:
    """Transparent pixels: the engine drops alpha (no alpha_mask) and trains the colour stored under it."""
    import numpy as np
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(path) as image:
            if mode not in ALPHA_MODES and "transparency" not in image.info:
                return []
            alpha = np.asarray(image.convert("RGBA"))[..., 3]
    clear = alpha < 255
    share = float(clear.mean()) if alpha.size else 0.0
    if share == 0.0:
        return []
    under = tuple(int(v) for v in _engine_rgb(path)[clear].mean(axis=0).round())
    return [Problem(WARNING, "alpha", rel,
                    f"{share:.0%} of its pixels are (partly) transparent; the engine drops the alpha channel "
                    f"(no alpha_mask), so they train as the colour stored under them (mean RGB {under})",
                    "flatten it onto the background you want the LoRA to learn (e.g. white) and save it as RGB")]


def _engine_fails(path: Path, rel: str, mode: str) -> list[Problem]:
    try:
        _engine_rgb(path)
    except Exception as exc:  # an exotic mode may fail anywhere in Pillow
        return [Problem(ERROR, "mode-unsupported", rel, f"mode {mode}: the engine cannot convert it to RGB "
                        f"({exc.__class__.__name__})", "save it as an 8-bit RGB PNG or JPEG")]
    return []
