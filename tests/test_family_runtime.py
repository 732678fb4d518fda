"""A family runtime is one module plus data: a renamed twin of the UNet runtime and of tiny-sd15, made inside
the test (a module on ``PYTHONPATH``, a JSON in ``SD_COMPAT_FAMILY_PATH``), trains end to end in our engine and
gives tiny-sd15's LoRA bit for bit, plus the one metadata key the twin adds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fixtures.engine_runs import run_engine

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FAMILY_DIR, FAMILY_PATH_ENV
from sd_scripts_compat.network.lora_file import read_lora_file

ROOT = Path(__file__).resolve().parents[1]
UNET_RUNTIME = ROOT / "sd_scripts_compat" / "runtimes" / "unet.py"
TWIN_METADATA = '''

def file_metadata(config):
    return {"ss_twin_runtime": __name__}
'''


def make_twin(tmp_path: Path) -> dict[str, str]:
    """``twin_plugins/twin_unet.py`` (the UNet runtime's source, its metadata replaced) and ``tiny-twin.json``
    (tiny-sd15's data naming that runtime); returns the environment that makes both visible."""
    package = tmp_path / "plugins" / "twin_plugins"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    source = UNET_RUNTIME.read_text(encoding="utf-8")
    head, _, _ = source.partition("\ndef file_metadata(")
    (package / "twin_unet.py").write_text(head + TWIN_METADATA, encoding="utf-8")
    family = json.loads((FAMILY_DIR / "tiny-sd15.json").read_text(encoding="utf-8"))
    family.update(name="tiny-twin", description="a renamed twin of tiny-sd15", runtime="twin_plugins.twin_unet")
    families = tmp_path / "families"
    families.mkdir()
    (families / "tiny-twin.json").write_text(json.dumps(family), encoding="utf-8")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")]),
            FAMILY_PATH_ENV: str(families)}


def values(tmp_path: Path, model: str, out: str) -> dict:
    return {"pretrained_model_name_or_path": model, "train_data_dir": str(ROOT / "examples" / "dataset"),
            "output_dir": str(tmp_path / out), "output_name": "lora", "resolution": "64,64",
            "caption_extension": ".txt", "train_batch_size": 2, "max_train_steps": 3, "network_dim": 4,
            "network_alpha": 4, "learning_rate": 1e-3, "seed": 3, "max_data_loader_n_workers": 0}


@pytest.mark.long
def test_a_runtime_and_a_family_added_from_outside_train_end_to_end(tmp_path):
    result = run_engine("train_network", tmp_path, values(tmp_path, "builtin:tiny-twin", "twin"), name="twin.toml",
                        env=make_twin(tmp_path))
    assert "done: 3 steps" in result.stdout
    run_engine("train_network", tmp_path, values(tmp_path, "builtin:tiny-sd15", "sd15"), name="sd15.toml")
    twin, twin_meta = read_lora_file(tmp_path / "twin" / "lora.safetensors")
    plain, plain_meta = read_lora_file(tmp_path / "sd15" / "lora.safetensors")
    assert twin_meta["ss_twin_runtime"] == "twin_plugins.twin_unet" and "ss_twin_runtime" not in plain_meta
    assert twin.keys() == plain.keys()
    assert all(twin[key].equal(plain[key]) for key in twin)  # same weights, same seed: the same LoRA


def test_a_runtime_that_lacks_a_member_is_one_line(tmp_path, monkeypatch):
    from sd_scripts_compat.runtimes import _import_runtime

    (tmp_path / "halfpkg").mkdir()
    (tmp_path / "halfpkg" / "__init__.py").write_text("")
    (tmp_path / "halfpkg" / "half.py").write_text("LOAD_PRIORITY = 5\n\ndef load(*args, **kwargs):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="halfpkg.half does not define claims_source, encode_prompts, text_cache_key"):
        _import_runtime("halfpkg.half")


def test_a_family_naming_a_runtime_that_is_not_there_is_one_line(tmp_path, monkeypatch):
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.runtimes import runtime_for

    family = json.loads((FAMILY_DIR / "tiny-sd15.json").read_text(encoding="utf-8"))
    family.update(name="tiny-lost", runtime="no_such_plugin.runtime")
    (tmp_path / "tiny-lost.json").write_text(json.dumps(family), encoding="utf-8")
    monkeypatch.setenv(FAMILY_PATH_ENV, str(tmp_path))
    get_family.cache_clear()
    try:
        with pytest.raises(UserError, match="runtime 'no_such_plugin.runtime': cannot import"):
            runtime_for(get_family("tiny-lost"))
    finally:
        get_family.cache_clear()


def test_every_family_our_engine_trains_names_a_runtime_and_no_other_does():
    from sd_scripts_compat.models.detect import all_families
    from sd_scripts_compat.runtimes import RUNTIME_MEMBERS, runtime_for

    assert len(RUNTIME_MEMBERS) == 9  # the protocol's eight functions and LOAD_PRIORITY: each runtime has all
    for family in all_families():
        if family.trained_here:
            runtime = runtime_for(family)  # checked: every member defined
            assert all(hasattr(runtime, member) for member in RUNTIME_MEMBERS), family.name
        else:
            with pytest.raises(UserError, match="does not train it"):
                runtime_for(family)


@pytest.mark.parametrize("text", ["{not json", '{"name": "tiny-bad"}', '{"name": "tiny-bad", "text_encoders": [], '
                                  '"unknown_key": 1}', "[]"])
def test_a_broken_family_file_is_one_line_naming_it(tmp_path, monkeypatch, text):
    """A family file of ``SD_COMPAT_FAMILY_PATH`` is the user's: a broken one is a UserError naming the file."""
    from sd_scripts_compat.facts.families import get_family

    (tmp_path / "tiny-bad.json").write_text(text, encoding="utf-8")
    monkeypatch.setenv(FAMILY_PATH_ENV, str(tmp_path))
    get_family.cache_clear()
    try:
        with pytest.raises(UserError, match="tiny-bad.json: not a family file this version reads"):
            get_family("tiny-bad")
    finally:
        get_family.cache_clear()
