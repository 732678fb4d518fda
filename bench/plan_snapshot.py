"""Snapshot `autotune plan` outputs, so a refactor of the planner can be shown to change nothing.

    python bench/plan_snapshot.py OUT_DIR [--dataset examples/dataset]
    python bench/plan_snapshot.py --compare BEFORE AFTER   # TOML byte for byte, JSON outside "settings"

For every full-size family, goals character and style, and the cards ``--vram 6/8/12/16/24/48``,
``--gpu "RTX 3060"``, ``--gpu "RTX 4090"`` and two RTX 3060s, writes ``OUT_DIR/<case>/plan.json``
(``autotune plan ... --json``) and ``OUT_DIR/<case>/out/`` (``--out``: config.toml, dataset.toml and the
JSON printed with it). ``diff -r BEFORE AFTER`` shows every difference; ``--compare`` tells whether two
snapshots agree where a refactor must not change anything: every file the plan wrote byte for byte (JSON
files as data), and each printed plan (exit code included) outside its ``settings`` block.

The CLI runs in-process (342 cases x 2 in about three minutes). ``--cpu-cores 8`` pins the one value that
depends on this machine. Paths under OUT_DIR written into the files are replaced by ``@OUT@``, so
snapshots taken into different folders compare equal; the dataset's own path is left as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FAMILIES = ("anima", "chroma", "flux-dev", "flux-schnell", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b",
            "hunyuan-image-2.1", "lumina2", "qwen-image", "sd15", "sd2", "sd2-v", "sd3.5-large", "sd3.5-medium", "sdxl",
            "wan2.1-t2v-1.3b", "wan2.2-t2v-a14b", "z-image")  # every full-size family
GOALS = ("character", "style")
CARDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    *((f"vram{gb}", ("--vram", str(gb))) for gb in (6, 8, 12, 16, 24, 48)),
    ("rtx3060", ("--gpu", "RTX 3060")),
    ("rtx4090", ("--gpu", "RTX 4090")),
    ("2xrtx3060", ("--gpu", "RTX 3060", "--gpu", "RTX 3060")),
)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``autotune`` in-process: exit code and stdout (stderr lines are appended, marked)."""
    from autotune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = out.getvalue() + "".join(f"stderr: {line}\n" for line in err.getvalue().splitlines())
    return code, text


def normalise(text: str, out_dir: Path) -> str:
    return text.replace(str(out_dir.resolve()), "@OUT@")


def snapshot(out_dir: Path, dataset: Path, families: tuple[str, ...] = FAMILIES) -> int:
    """Write every case; returns the number of cases."""
    cases = 0
    for family in families:
        for goal in GOALS:
            for card, card_args in CARDS:
                case = out_dir / f"{family}-{goal}-{card}"
                base = ["plan", str(dataset), "--model", f"builtin:{family}", "--goal", goal, *card_args,
                        "--cpu-cores", "8", "--json"]
                case.mkdir(parents=True, exist_ok=True)
                code, text = run_cli(base)
                (case / "plan.json").write_text(f"exit {code}\n{normalise(text, out_dir)}", encoding="utf-8")
                code, text = run_cli([*base, "--out", str(case / "out")])
                (case / "out").mkdir(exist_ok=True)
                (case / "out" / "plan.json").write_text(f"exit {code}\n{normalise(text, out_dir)}", encoding="utf-8")
                for path in (case / "out").rglob("*"):  # every file the plan wrote (musubi's too)
                    if path.is_file() and path.name != "plan.json":
                        path.write_text(normalise(path.read_text(encoding="utf-8"), out_dir), encoding="utf-8")
                cases += 1
    return cases


def _json_without_settings(path: Path) -> tuple[str, object]:
    """(exit code, JSON without ``settings``) of a printed plan; a file the plan wrote is compared whole."""
    code, _, text = path.read_text(encoding="utf-8").partition("\n")
    if not code.startswith("exit "):
        return "", json.loads(code + "\n" + text)
    data = json.loads(text)
    if isinstance(data, dict):
        data.pop("settings", None)
    return code, data


def compare(before: Path, after: Path) -> list[str]:
    """Differences between two snapshots, one line each (empty: they agree)."""
    names = sorted({p.relative_to(before) for p in before.rglob("*") if p.is_file()}
                   | {p.relative_to(after) for p in after.rglob("*") if p.is_file()})
    problems = []
    for name in names:
        old, new = before / name, after / name
        if not old.is_file() or not new.is_file():
            problems.append(f"{name}: only in {before if old.is_file() else after}")
        elif name.suffix == ".json":
            if _json_without_settings(old) != _json_without_settings(new):
                problems.append(f"{name}: JSON differs outside the settings block")
        elif old.read_bytes() != new.read_bytes():
            problems.append(f"{name}: bytes differ")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="folder to write the snapshot into")
    parser.add_argument("--dataset", type=Path, default=ROOT / "examples" / "dataset")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="comma-separated builtin families (default: every full-size family)")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                        help="compare two snapshots instead of taking one")
    args = parser.parse_args(argv)
    if args.compare:
        problems = compare(*args.compare)
        for line in problems:
            print(line)
        print(f"{len(problems)} differences" if problems else "snapshots agree")
        return 1 if problems else 0
    if args.out is None:
        parser.error("give OUT_DIR or --compare BEFORE AFTER")
    cases = snapshot(args.out, args.dataset.resolve(), tuple(args.families.split(",")))
    print(f"wrote {cases} cases under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
