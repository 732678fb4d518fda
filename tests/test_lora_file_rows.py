"""A LoRA file's delta lands on the rows every loader adds it to (issue 52, item 1).

sd-scripts and ComfyUI apply a kohya LoRA to the model file's own weights: ``W_file[name] += scale * up @ down``.
Our engine trains on diffusers' modules, some of which order their outputs otherwise than the file (SD3's final
layer and last context modulation: (scale, shift) against the file's (shift, scale)). For each family whose LoRA
names the file's layers (SD3.5 by its table, FLUX.1 and Chroma by BFL's names), a network with random weights:
its file applied to the converted base file, as the loaders apply it, must equal our merged weights converted by
our own model writer (``to_sd3`` / ``to_bfl``, each checked against diffusers' converter elsewhere); and the file
read back into a network gives the same weights (saving, resuming, sampling and ``network_weights`` all read it
that way).
"""

from __future__ import annotations

import pytest
import torch

from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import FusedTargets, create_network, iter_target_modules


def to_file(bundle, state):
    """Our transformer's state dict under the family's file names."""
    if bundle.family.single_file_layout == "sd3":
        from sd_scripts_compat.models.sd3_files import to_sd3

        return to_sd3(state, bundle.family)
    from sd_scripts_compat.models.flux_layout import to_bfl

    return to_bfl(state, bundle.unet.config)


def random_network(bundle, seed: int):
    network = create_network(bundle, network_dim=4, network_alpha=2.0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in network.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return network


def file_names(bundle) -> dict[str, str]:
    """kohya module key -> the file's Linear it names (dots), as our network targets it."""
    names = {}
    for lora_name, part, _, _ in iter_target_modules(bundle, conv=False, text_encoder=False):
        assert part == "unet"
        names[lora_name] = None
    from sd_scripts_compat.models.flux_layout import lora_targets, table_lora_targets

    targets = lora_targets(bundle.unet) if bundle.family.unet_lora_names == "bfl" else \
        table_lora_targets(bundle.unet, bundle.family.lora_layout)
    for kohya_name, _ in targets:
        names["lora_unet_" + kohya_name.replace(".", "_")] = kohya_name
    return names


def merged_state(bundle, network) -> dict[str, torch.Tensor]:
    """Our diffusers weights with every UNet LoRA module's delta merged, rows split over a fused module's parts."""
    state = {k: v.clone() for k, v in bundle.unet.state_dict().items()}
    by_id = {id(module): name for name, module in bundle.unet.named_modules()}
    for lora in network.unet_loras:
        delta = lora.lora_up.weight @ lora.lora_down.weight * (lora.multiplier * lora.scale)
        parts = lora.targets.parts if isinstance(getattr(lora, "targets", None), FusedTargets) else (lora.base,)
        row = 0
        for part in parts:
            rows = part.out_features
            state[f"{by_id[id(part)]}.weight"] += delta[row:row + rows]
            row += rows
    return state


@pytest.mark.parametrize("family", ["tiny-sd3", "tiny-flux", "tiny-chroma"])
def test_the_files_delta_on_the_files_weights_is_our_trained_change(family):
    bundle = build_modules(get_family(family), seed=0)
    network = random_network(bundle, seed=1)
    lora_file = network.kohya_state_dict()
    names = file_names(bundle)
    base = to_file(bundle, bundle.unet.state_dict())
    applied = {k: v.clone() for k, v in base.items()}
    for key in {k.split(".")[0] for k in lora_file if k.startswith("lora_unet_")}:
        down, up = lora_file[f"{key}.lora_down.weight"], lora_file[f"{key}.lora_up.weight"]
        alpha = float(lora_file[f"{key}.alpha"])
        applied[f"{names[key]}.weight"] += up @ down * (alpha / down.shape[0])  # as sd-scripts / ComfyUI add it
    expected = to_file(bundle, merged_state(bundle, network))
    assert applied.keys() == expected.keys()
    touched = 0
    for key, want in expected.items():
        change = (want - base[key]).abs().max()
        error = (applied[key] - want).abs().max()
        assert error <= 1e-5 * max(float(change), 1e-12) + 1e-7, (key, float(error), float(change))
        touched += bool(change > 0)
    assert touched >= len(network.unet_loras)  # every module's change was compared


def test_the_swapped_rows_are_the_last_context_modulation_only():
    from sd_scripts_compat.models.sd3_files import swapped_halves

    for name, last in (("tiny-sd3", 2), ("sd3.5-medium", 23), ("sd3.5-large", 37)):
        assert swapped_halves(get_family(name)) == {"final_layer.adaLN_modulation.1",
                                                    f"joint_blocks.{last}.context_block.adaLN_modulation.1"}
    assert swapped_halves(get_family("tiny-flux")) == swapped_halves(get_family("sdxl")) == frozenset()


def test_a_file_read_back_gives_the_same_network_and_the_rows_are_swapped_in_the_file():
    bundle = build_modules(get_family("tiny-sd3"), seed=0)
    network = random_network(bundle, seed=2)
    lora_file = network.kohya_state_dict()
    key = "lora_unet_joint_blocks_2_context_block_adaLN_modulation_1.lora_up.weight"
    ours = network.state_dict()[key]
    half = ours.shape[0] // 2
    assert torch.equal(lora_file[key][:half], ours[half:]) and torch.equal(lora_file[key][half:], ours[:half])
    other = "lora_unet_joint_blocks_1_context_block_adaLN_modulation_1.lora_up.weight"
    assert torch.equal(lora_file[other], network.state_dict()[other])  # a block that is not the last: as is
    again = create_network(bundle, network_dim=4, network_alpha=2.0)
    again.load_kohya_state_dict(lora_file)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), network.state_dict().values(),
                                                 strict=True))


# ---- the full-size families: shapes on the meta device, one module's weights at a time ------------------------

FULL_SIZE = ["sd3.5-medium", "sd3.5-large", "flux-dev", "chroma"]


def edge_blocks(family) -> tuple[str, ...]:
    """The first and last block of each of the family's block lists, as kohya module-name prefixes."""
    if family.single_file_layout == "sd3":
        lists = (("joint_blocks", int(family.unet["num_layers"])),)
    else:
        lists = (("double_blocks", int(family.unet["num_layers"])),
                 ("single_blocks", int(family.unet["num_single_layers"])))
    return tuple(f"lora_unet_{name}_{i}_" for name, count in lists for i in (0, count - 1))


def full_size_rows_match(name: str, every_module: bool) -> int:
    """Each LoRA module of the full-size ``name`` alone, random weights: its delta as the file stores it, on the
    file's Linear, equals our delta converted by our model writer (the rest of the model stays on the meta device:
    the writers only permute and stack, so each module is checked by its own rows). Returns the modules checked."""
    from sd_scripts_compat.network.lora import file_order

    bundle = build_modules(get_family(name), device="meta")
    network = create_network(bundle, network_dim=4, network_alpha=2.0)
    meta_state, names = bundle.unet.state_dict(), file_names(bundle)
    by_id = {id(module): key for key, module in bundle.unet.named_modules()}
    blocks, generator, checked = edge_blocks(bundle.family), torch.Generator().manual_seed(3), 0
    for lora in network.unet_loras:
        in_block = any(lora.lora_name.startswith(prefix.rsplit("_", 2)[0] + "_") for prefix in blocks)
        if not every_module and in_block and not lora.lora_name.startswith(blocks):
            continue
        down = torch.randn(tuple(lora.lora_down.weight.shape), generator=generator) * 0.1
        up = torch.randn(tuple(lora.lora_up.weight.shape), generator=generator) * 0.1
        ours, row = dict(meta_state), 0
        parts = lora.targets.parts if isinstance(getattr(lora, "targets", None), FusedTargets) else (lora.base,)
        delta = up @ down * lora.scale
        for part in parts:
            ours[f"{by_id[id(part)]}.weight"] = delta[row:row + part.out_features]
            row += part.out_features
        converted = {k: v for k, v in to_file(bundle, ours).items() if v.device.type != "meta"}
        key = f"{lora.lora_name}.lora_up.weight"
        file_up = file_order(bundle.family, {key: up})[key]
        assert list(converted) == [f"{names[lora.lora_name]}.weight"], (lora.lora_name, list(converted))
        want = converted[f"{names[lora.lora_name]}.weight"]
        error = float((file_up @ down * lora.scale - want).abs().max())
        assert error <= 1e-5 * float(want.abs().max()), (lora.lora_name, error)
        checked += 1
    return checked


@pytest.mark.parametrize("family", [pytest.param(name, marks=pytest.mark.long) if name in ("flux-dev", "chroma")
                                    else name for name in FULL_SIZE])
def test_full_size_files_edge_blocks_and_outer_modules(family):
    """Quick: every module outside the blocks and every module of each list's first and last block (where SD3's
    swapped modulation is)."""
    assert full_size_rows_match(family, every_module=False) > 10


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL_SIZE)
def test_full_size_files_every_module(family):
    network_size = {"sd3.5-medium": 24, "sd3.5-large": 38, "flux-dev": 19, "chroma": 19}[family]
    assert full_size_rows_match(family, every_module=True) >= network_size * 4
