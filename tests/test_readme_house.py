"""README shows the house first: its first paragraph names every family the tool plans or trains (a family added
without it fails here), the map ("Where things live") comes right after the quickstart, and it says where a new
family and a new engine go."""

from __future__ import annotations

import re
from pathlib import Path

from sd_scripts_compat.models.detect import all_families

README = Path(__file__).resolve().parents[1] / "README.md"
# how the first paragraph names each full-size family (several share a phrase: "SD 2.x", FLUX.2's "klein")
NAMED_AS = {
    "sd15": "SD 1.x", "sd2": "SD 2.x", "sd2-v": "SD 2.x", "sdxl": "SDXL", "sd3.5-medium": "SD3.5 Medium",
    "sd3.5-large": "SD3.5 Medium and Large", "flux-dev": "FLUX.1 dev", "flux-schnell": "FLUX.1 dev and schnell",
    "chroma": "Chroma", "lumina2": "Lumina 2", "hunyuan-image-2.1": "HunyuanImage-2.1", "anima": "Anima",
    "qwen-image": "Qwen-Image", "flux2-dev": "FLUX.2 dev", "flux2-klein-4b": "FLUX.2 dev and klein",
    "flux2-klein-9b": "FLUX.2 dev and klein", "wan2.1-t2v-1.3b": "Wan 2.1", "wan2.2-t2v-a14b": "Wan 2.1 / 2.2",
    "z-image": "Z-Image",
}


def first_paragraph() -> str:
    text = README.read_text(encoding="utf-8")
    return " ".join(text.split("\n\n")[1].split())


def test_the_first_paragraph_names_every_family():
    assert set(NAMED_AS) == {f.name for f in all_families() if not f.tiny}, "a family the README does not name"
    paragraph = first_paragraph()
    assert [name for name, phrase in NAMED_AS.items() if phrase not in paragraph] == []


def test_a_glance_at_every_command_then_the_quickstart_then_the_map_of_where_things_go():
    headings = re.findall(r"^## (.+)$", README.read_text(encoding="utf-8"), flags=re.MULTILINE)
    assert headings[:3] == ["At a glance", "Quickstart", "Where things live"]
    text = README.read_text(encoding="utf-8")
    glance = text[text.index("## At a glance"):text.index("## Quickstart")]  # the first screen: every command
    from autotune.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert [name for name in commands if f"`autotune {name}" not in glance] == []
    assert "autotune/" in glance and "sd_scripts_compat/" in glance and 'not slow and not long' in glance
    house = text[text.index("## Where things live"):text.index("## Where things land")]
    assert "**A new family**" in house and "sd_scripts_compat/runtimes/" in house
    assert "**A new engine**" in house and "autotune/launch/engines.py" in house
