"""kohya --dataset_config files: schema, strictness and subset > dataset > [general] > args > defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sd_scripts_compat.config.dataset_config import load_dataset_config
from sd_scripts_compat.config.training_config import dataset_args, load_training_config
from sd_scripts_compat.facts.dataset_spec import SubsetSpec
from sd_scripts_compat.facts.errors import UserError

DATA = Path(__file__).parent / "data"


def write(tmp_path: Path, text: str, name: str = "dataset.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path, args: dict | None = None) -> str:
    with pytest.raises(UserError) as caught:
        load_dataset_config(path, args or {}, default_resolution=(512, 512))
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


def args_from(*argv: str) -> dict:
    return dataset_args(load_training_config(list(argv), sdxl=False))


def test_precedence_across_subset_dataset_general_args_and_defaults():
    args = args_from("--caption_extension", ".cap", "--keep_tokens", "9", "--caption_dropout_rate", "0.1",
                     "--train_batch_size", "3", "--resolution", "1024,1024", "--prior_loss_weight", "0.7",
                     "--enable_bucket")
    group = load_dataset_config(DATA / "dataset_precedence.toml", args)
    first, second = group.datasets
    hoge, fuga, reg = first.subsets
    # keep_tokens: subset (3) > dataset (2) > [general] (1) > command line (9)
    assert (hoge.keep_tokens, fuga.keep_tokens, reg.keep_tokens) == (2, 3, 2)
    assert second.subsets[0].keep_tokens == 1
    # caption_extension: subset > [general] > command line
    assert (hoge.caption_extension, fuga.caption_extension) == (".txt", ".caption")
    # flip_aug only in [general], overridden by a subset's false
    assert (hoge.flip_aug, reg.flip_aug, second.subsets[0].flip_aug) == (True, False, True)
    # command-line layer: caption_dropout_rate given nowhere in the file
    assert all(s.caption_dropout_rate == 0.1 for s in (hoge, fuga, reg))
    # defaults: nothing sets these
    assert hoge.num_repeats == 1 and fuga.num_repeats == 5 and hoge.color_aug is False
    assert hoge.caption_tag_dropout_rate == SubsetSpec.__dataclass_fields__["caption_tag_dropout_rate"].default
    assert (hoge.is_reg, reg.is_reg) == (False, True)
    assert (hoge.class_tokens, reg.class_tokens) == ("hoge girl", "human")
    # dataset-level keys: [[datasets]] > command line
    assert first.resolution == (768, 768) and second.resolution == (640, 512)
    assert first.batch_size == 4 and second.batch_size == 3
    assert first.network_multiplier == 0.5 and second.network_multiplier == 1.0
    assert first.enable_bucket and first.prior_loss_weight == 0.7
    assert second.subsets[0].face_crop_aug_range == (2.0, 4.0)


def test_resolution_comes_from_args_or_family_default_or_is_an_error(tmp_path):
    path = write(tmp_path, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "a"\n')
    assert load_dataset_config(path, args_from("--resolution", "640,384")).datasets[0].resolution == (640, 384)
    assert load_dataset_config(path, {}, default_resolution=(1024, 1024)).datasets[0].resolution == (1024, 1024)
    with pytest.raises(UserError, match="no resolution"):
        load_dataset_config(path, {})


@pytest.mark.parametrize("text, expected", [
    ('[[datasets]]\n[[datasets.subsets]]\nimage_dir = "a"\nflip_agu = true\n',
     "extra keys not allowed: 'flip_agu' in [[datasets.subsets]] #1 of [[datasets]] #1; did you mean 'flip_aug'?"),
    ('[general]\nshufle_caption = true\n', "'shufle_caption' in [general]; did you mean 'shuffle_caption'?"),
    ('[[datasets]]\n[[datasets.subsets]]\nimage_dir = "a"\nbatch_size = 2\n',
     "'batch_size' belongs in [general] or [[datasets]]"),
    ('[general]\nis_reg = true\n', "'is_reg' belongs in [[datasets.subsets]]"),
    ('[general]\nlearning_rate = 1e-4\n', "'learning_rate' is a training option"),
    ('[generl]\n', "did you mean 'general'?"),
    ('[[dataset]]\nresolution = 512\n', "did you mean 'datasets'?"),
])
def test_unknown_and_misplaced_keys(tmp_path, text, expected):
    assert expected in error_of(write(tmp_path, text))


@pytest.mark.parametrize("text, expected", [
    ('[[datasets]]\nnetwork_multiplier = 1\n[[datasets.subsets]]\nimage_dir = "a"\n',
     "network_multiplier in [[datasets]] #1: expected a float (write 1.0, not 1), got integer 1"),
    ('[general]\nvalidation_split = 0\n', "expected a float (write 1.0, not 1)"),
    ('[general]\nface_crop_aug_range = [2, 4]\n', "expected two floats"),
    ('[general]\nresolution = "512,512"\n', "expected an integer or [width, height]"),
    ('[general]\nbatch_size = 2.0\n', "expected an integer, got float 2.0"),
    ('[general]\nflip_aug = 1\n', "expected true or false, got integer 1"),
    ('[general]\nnum_repeats = "10"\n', "expected an integer, got string '10'"),
    ('[general]\nresize_interpolation = "fancy"\n', "is not one of lanczos"),
])
def test_strict_types(tmp_path, text, expected):
    assert expected in error_of(write(tmp_path, text))


def test_int_accepted_where_kohya_takes_any_number(tmp_path):
    path = write(tmp_path, '[general]\ncaption_dropout_rate = 0\ntoken_warmup_step = 2\n'
                           '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "a"\n')
    subset = load_dataset_config(path, {}, default_resolution=(512, 512)).datasets[0].subsets[0]
    assert subset.caption_dropout_rate == 0.0 and isinstance(subset.caption_dropout_rate, float)
    assert subset.token_warmup_step == 2.0


def test_subset_rules(tmp_path):
    assert "needs image_dir" in error_of(write(tmp_path, '[[datasets]]\n[[datasets.subsets]]\nnum_repeats = 2\n'))
    assert "has no [[datasets.subsets]]" in error_of(write(tmp_path, '[[datasets]]\nresolution = 512\n'))
    mixed = '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "a"\n[[datasets.subsets]]\nmetadata_file = "m.json"\n'
    assert "mixes DreamBooth subsets" in error_of(write(tmp_path, mixed))
    # class_tokens is a DreamBooth key: not allowed in a fine-tuning dataset
    ft_bad = '[[datasets]]\nclass_tokens = "x"\n[[datasets.subsets]]\nmetadata_file = "m.json"\n'
    assert "'class_tokens'" in error_of(write(tmp_path, ft_bad))


def test_finetune_subset_is_read_and_flagged_as_not_implemented(tmp_path, caplog):
    path = write(tmp_path, '[[datasets]]\n[[datasets.subsets]]\nmetadata_file = "meta.json"\nimage_dir = "imgs"\n')
    with caplog.at_level("WARNING", logger="sd_scripts_compat.config.dataset_config"):
        group = load_dataset_config(path, {}, default_resolution=(512, 512))
    assert group.datasets[0].subsets[0].metadata_file == "meta.json"
    assert any("metadata_file" in r.getMessage() and "does not implement" in r.getMessage() for r in caplog.records)


def test_malformed_toml_names_file_and_line(tmp_path):
    path = write(tmp_path, '[general]\nflip_aug = true\ncaption_extension = ".txt\n')
    assert error_of(path).startswith(f"{path}:3: malformed TOML")


def test_json_dataset_config(tmp_path):
    config = {"general": {"shuffle_caption": True},
              "datasets": [{"resolution": [512, 512], "subsets": [{"image_dir": "a", "num_repeats": 4}]}]}
    path = write(tmp_path, json.dumps(config), name="dataset.json")
    subset = load_dataset_config(path, {}).datasets[0].subsets[0]
    assert subset.shuffle_caption and subset.num_repeats == 4


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="dataset config not found"):
        load_dataset_config(tmp_path / "nope.toml", {})
