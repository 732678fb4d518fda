"""Our LoRA files' metadata against what sd-scripts itself wrote for the same options (issue 52, item 5).

``fixtures/sd_scripts_run_metadata.json`` was recorded by ``bench/equivalence.py --record`` from real sd-scripts runs
(its commit is in each entry): a random-weight full-size model file (FLUX.1 and SD3.5 Medium: their files with the
transformer at full width and one or two blocks, and a one-layer T5-XXL), a one-image dataset, each case's
config.toml.
Here our engine trains the family's tiny twin, saved under the same file name, on the same one-image dataset with
the same config, and every ``ss_*`` and ``modelspec.*`` key of the final file and of each step save must equal the
recorded one, but for what depends on
the run or on the model file's bytes rather than the options (times, session id, hashes) and the one value we
write on purpose (``ss_sd_scripts_commit_hash``: sd-scripts writes its git commit, we name this engine).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import toml
from test_valid_inputs import metadata

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "sd_scripts_run_metadata.json").read_text())
TINY = {"sd15": "tiny-sd15", "sdxl": "tiny-sdxl", "flux-dev": "tiny-flux", "sd3.5-medium": "tiny-sd3"}
NOT_FROM_OPTIONS = {"ss_training_started_at", "ss_training_finished_at", "ss_session_id", "modelspec.date",
                    "sshs_model_hash", "sshs_legacy_hash", "ss_sd_model_hash", "ss_new_sd_model_hash",
                    "modelspec.implementation_version"}
OURS_ON_PURPOSE = {"ss_sd_scripts_commit_hash"}
CAPTION = "a photo of sks dog"


def _work(root: Path, family: str) -> None:
    """The recorded run's folder layout: the model file under its recorded name, the one-image dataset."""
    from PIL import Image

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.flux_files import save_flux_files
    from sd_scripts_compat.models.sd3_files import save_sd3_files
    from sd_scripts_compat.models.single_file import save_single_file
    from sd_scripts_compat.models.t5_tokenizer import TINY_T5_TOKENIZER_DIR

    bundle, name = build_modules(get_family(TINY[family]), seed=0), f"{family}-random.safetensors"
    if family == "flux-dev":  # sd-scripts' four files in a folder of that name, the T5 tokenizer beside them
        save_flux_files(bundle, root / name)
        shutil.copytree(TINY_T5_TOKENIZER_DIR, root / name / "t5_tokenizer")
    elif family == "sd3.5-medium":  # the model file under the recorded name, its text encoders beside it
        written = save_sd3_files(bundle, root / name, text_encoders_inside=False)
        written["pretrained_model_name_or_path"].rename(root / name / f"{family}.safetensors")
        shutil.copytree(TINY_T5_TOKENIZER_DIR, root / name / "t5_tokenizer")
    else:
        save_single_file(bundle, root / name)
    folder = root / "dataset" / "1_sks dog"
    folder.mkdir(parents=True)
    Image.new("RGB", (64, 64), (120, 80, 40)).save(folder / "img.png")
    (folder / "img.txt").write_text(CAPTION, encoding="utf-8")


def test_the_recording_covers_sd15_sdxl_flux_and_sd35_with_eight_option_sets():
    families = {entry["family"] for entry in RECORDED.values()}
    assert len(RECORDED) >= 8 and families >= {"sd15", "sdxl", "flux-dev", "sd3.5-medium"}
    for entry in RECORDED.values():
        assert entry["sd_scripts_commit"] != "unknown" and len(entry["metadata"]) > 60


@pytest.mark.long
# sd15-lora and sdxl-lora are option sets that sd15-options and sdxl-lora-te hold and add to: slow, for CI's time
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in ("sd15-lora", "sdxl-lora")
                                  else case for case in sorted(RECORDED)])
def test_our_metadata_equals_what_sd_scripts_wrote_for_the_same_options(case, tmp_path):
    entry = RECORDED[case]
    _work(tmp_path, entry["family"])
    config = {key: value.replace("<work>", str(tmp_path)) if isinstance(value, str) else value
              for key, value in entry["config"].items() if key != "network_weights"}  # its keys are full-size
    config_file = tmp_path / "config.toml"
    config_file.write_text(toml.dumps(config), encoding="utf-8")
    out = tmp_path / case / "ours"
    done = subprocess.run([sys.executable, "-m", f"sd_scripts_compat.{entry['script']}", "--config_file",
                           str(config_file), "--output_dir", str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(path.name for path in out.glob("lora-*.safetensors")) == sorted(entry["saves"])
    for name, theirs in [("lora.safetensors", entry["metadata"]), *entry["saves"].items()]:
        ours = {key: value.replace(str(tmp_path), "<work>") for key, value in metadata(out / name).items()}
        compared = sorted((set(ours) | set(theirs)) - NOT_FROM_OPTIONS - OURS_ON_PURPOSE)
        differing = {key: (ours.get(key), theirs.get(key)) for key in compared if ours.get(key) != theirs.get(key)}
        assert not differing, (name, differing)
        assert len(compared) > 60 and set(ours) >= OURS_ON_PURPOSE | {"ss_training_finished_at"}


def test_the_recording_has_a_step_save():  # sd-scripts names it after the run and stamps its finish time
    saves = [saved for entry in RECORDED.values() for saved in entry["saves"].values()]
    assert saves and all(saved["ss_output_name"] == "lora" and "ss_training_finished_at" in saved for saved in saves)
