"""What a writer may replace: only what autotune wrote, and never inside the dataset.

Every writer of the CLI (``report --html``, ``doctor --html``, ``plan --out``, ``run --out``, ``inspect
--diffusers-out``) asks here first and says one line instead of writing over a LoRA, a config or any file the
user made; a folder inside the dataset is refused because the next scan would read what was written there as
training data. Written by hand: "is this file ours" is a mark each writer puts in its own files, which no library
knows.
"""

from __future__ import annotations

from pathlib import Path

from autotune.layout import CONFIG, DATASET_CONFIG, DECISIONS_JSONL, EVENTS_DIR, LOCK_FILE, PLAN_FILE, RUN_STATE
from sd_scripts_compat.facts.errors import UserError

HTML_MARK = '<meta name="generator" content="lora-autotune">'  # in the head of every page autotune writes
RUN_TRACES = (RUN_STATE, DECISIONS_JSONL, EVENTS_DIR, LOCK_FILE)


def refuse_foreign_page(target: Path, option: str) -> None:
    """``option TARGET`` may replace an HTML page autotune wrote, nothing else."""
    if not _exists(target, option):
        return
    try:
        with open(target, "rb") as file:
            head = file.read(4096)
    except OSError as error:
        raise UserError(f"{option} {target}: cannot be read ({error.strerror}); name another file") from None
    if HTML_MARK.encode() not in head:
        raise UserError(f"{option} {target}: a file autotune did not write ({_kind(target)}); name a new file, "
                        "it is not replaced")


def refuse_foreign_lora_copy(target: Path, source: Path, option: str) -> None:
    """``option TARGET`` may replace a diffusers copy autotune wrote, nothing else (the LoRA itself is refused
    by ``export_diffusers_file``, with its own line)."""
    if not _exists(target, option) or target.resolve() == source.resolve():
        return
    try:
        from safetensors import safe_open

        from sd_scripts_compat.network.diffusers_export import COPY_MARK

        with safe_open(str(target), framework="pt") as file:
            metadata = file.metadata() or {}
        ours = all(metadata.get(key) == value for key, value in COPY_MARK.items())
    except Exception:  # noqa: BLE001 (any file safetensors cannot open is not ours)
        ours = False
    if not ours:
        raise UserError(f"{option} {target}: a file autotune did not write ({_kind(target)}); name a new file, "
                        "it is not replaced")


def refuse_foreign_out(out: Path, option: str = "--out") -> None:
    """``plan --out OUT`` writes config.toml, dataset.toml and the plan: refused over a run (its config is what
    trained) and over configs autotune did not plan."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"{option} {out}: a file, not a folder; choose another {option}")
    traces = run_traces(out)
    if traces:
        raise UserError(f"{option} {out}: holds a run ({traces[0]}); its config.toml is what trained it: plan into "
                        "a new folder")
    refuse_foreign_configs(out, option)


def run_traces(out: Path) -> list[str]:
    """What in ``out`` shows that a run trained there (its state, decisions, events, lock or a LoRA)."""
    return [name for name in RUN_TRACES if (out / name).exists()] + [p.name for p in out.glob("*.safetensors")]


def refuse_foreign_configs(out: Path, option: str = "--out") -> None:
    """A folder holding a config.toml / dataset.toml that autotune did not plan (no autotune_plan.json beside it)
    is the user's: not written over."""
    configs = [name for name in (CONFIG, DATASET_CONFIG) if (out / name).is_file()]
    if configs and not (out / PLAN_FILE).is_file():
        raise UserError(f"{option} {out}: holds a {configs[0]} autotune did not write (no {PLAN_FILE}); choose "
                        "a new folder")


def refuse_out_in_dataset(out: Path, dataset: Path, option: str = "--out") -> None:
    """Outputs never go into the dataset: the next scan would read them (samples, captions, state) as images."""
    try:
        where, images = out.expanduser().resolve(), dataset.expanduser().resolve()
    except (OSError, RuntimeError):
        raise UserError(f"{option} {out}: cannot be resolved (a symlink loop?); choose another {option}") from None
    if where == images or images in where.parents:
        raise UserError(f"{option} {out}: inside the dataset {dataset}, whose next scan would read what is written "
                        f"there; choose a folder outside it")


def _exists(target: Path, option: str) -> bool:
    from sd_scripts_compat.facts.atomic import refuse_non_regular

    try:
        refuse_non_regular(target)
        return target.exists()
    except (OSError, RuntimeError):
        raise UserError(f"{option} {target}: cannot be resolved (a symlink loop?); name another file") from None


def _kind(target: Path) -> str:
    if target.suffix == ".safetensors":
        return "a .safetensors file, such as a LoRA"
    if target.suffix == ".toml":
        return "a config"
    return f"a {target.suffix or 'plain'} file"
