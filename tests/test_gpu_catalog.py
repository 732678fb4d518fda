"""The GPU catalogue: every entry sane, lookups exact / normalised / by VRAM / unknown."""

from __future__ import annotations

import pytest
import toml

from autotune.hardware.gpu_catalog import CATALOG_PATH, GpuSpec, find_gpu, load_catalog, lookup_gpu, normalize_gpu_name
from sd_scripts_compat.facts.errors import UserError


@pytest.fixture(scope="module")
def catalog() -> list[GpuSpec]:
    return load_catalog()


# Every card issue 2 asks for, as a user might type it -> the entry it must be.
REQUIRED = {
    "GTX 1060 6GB": "GTX 1060 6GB", "GTX 1070": "GTX 1070", "GTX 1080": "GTX 1080", "GTX 1080 Ti": "GTX 1080 Ti",
    "RTX 2060": "RTX 2060", "RTX 2060 12GB": "RTX 2060 12GB", "RTX 2070": "RTX 2070", "RTX 2080": "RTX 2080",
    "RTX 2080 Ti": "RTX 2080 Ti", "RTX 3050 8GB": "RTX 3050 8GB", "RTX 3060 12GB": "RTX 3060 12GB",
    "RTX 3060 Ti": "RTX 3060 Ti", "RTX 3070": "RTX 3070", "RTX 3080 10GB": "RTX 3080 10GB",
    "RTX 3080 12GB": "RTX 3080 12GB", "RTX 3080 Ti": "RTX 3080 Ti", "RTX 3090": "RTX 3090",
    "RTX 3090 Ti": "RTX 3090 Ti", "RTX 4060": "RTX 4060", "RTX 4060 Ti 8GB": "RTX 4060 Ti 8GB",
    "RTX 4060 Ti 16GB": "RTX 4060 Ti 16GB", "RTX 4070": "RTX 4070", "RTX 4070 Ti": "RTX 4070 Ti",
    "RTX 4070 Ti Super": "RTX 4070 Ti Super", "RTX 4080": "RTX 4080", "RTX 4080 Super": "RTX 4080 Super",
    "RTX 4090": "RTX 4090", "RTX 5060 Ti 16GB": "RTX 5060 Ti 16GB", "RTX 5070": "RTX 5070",
    "RTX 5070 Ti": "RTX 5070 Ti", "RTX 5080": "RTX 5080", "RTX 5090": "RTX 5090", "RTX A4000": "RTX A4000",
    "RTX A4500": "RTX A4500", "RTX A5000": "RTX A5000", "RTX A6000": "RTX A6000", "RTX 6000 Ada": "RTX 6000 Ada",
    "T4": "T4", "V100 16GB": "V100 PCIe 16GB", "V100 32GB": "V100 PCIe 32GB", "A10": "A10", "L4": "L4",
    "A100 40GB": "A100 40GB", "A100 80GB": "A100 80GB", "H100 PCIe": "H100 PCIe", "H100 SXM": "H100 SXM",
    "H200": "H200", "AMD Radeon RX 7900 XTX": "Radeon RX 7900 XTX",
}


@pytest.mark.parametrize("query, expected", sorted(REQUIRED.items()))
def test_required_cards_present(catalog, query, expected):
    assert lookup_gpu(query, catalog=catalog).name == expected


@pytest.mark.parametrize("query", ["RTX 3060", "3060", "rtx3060", "NVIDIA GeForce RTX 3060", "GeForce RTX 3060",
                                   "  nvidia geforce rtx-3060 ", "RTX_3060_12GB", "rtx 3060 12 GB"])
def test_spellings_of_one_card(catalog, query):
    assert lookup_gpu(query, catalog=catalog).name == "RTX 3060 12GB"


@pytest.mark.parametrize("query, vram, expected", [
    ("4060 Ti 16GB", None, "RTX 4060 Ti 16GB"),
    ("NVIDIA GeForce RTX 4060 Ti", 15.99, "RTX 4060 Ti 16GB"),  # NVML's name plus its total memory
    ("4060 Ti", None, "RTX 4060 Ti 8GB"),  # ambiguous: least VRAM, a plan for it fits both
    ("NVIDIA GeForce RTX 3080", 12.0, "RTX 3080 12GB"),
    ("NVIDIA GeForce RTX 3080", 10.0, "RTX 3080 10GB"),
    ("Tesla V100-SXM2-32GB", None, "V100 SXM2 32GB"),
    ("Tesla V100-PCIE-16GB", 15.77, "V100 PCIe 16GB"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100 80GB"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100 40GB"),
    ("NVIDIA H100 80GB HBM3", 79.6, "H100 SXM"),
    ("NVIDIA H100 PCIe", 79.6, "H100 PCIe"),
    ("H100", None, "H100 PCIe"),  # ambiguous: the slower card
    ("NVIDIA H200", 140.4, "H200"),
    ("NVIDIA RTX 6000 Ada Generation", 47.5, "RTX 6000 Ada"),
    ("NVIDIA RTX A4000", 15.7, "RTX A4000"),
    ("Tesla T4", 14.75, "T4"),
    ("NVIDIA A10", 22.49, "A10"),  # ECC on: 1/16 reserved
    ("NVIDIA GeForce GTX 1080 Ti", 11.0, "GTX 1080 Ti"),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", 16.0, "RTX 4070 Ti Super"),
])
def test_vram_picks_the_variant(catalog, query, vram, expected):
    assert lookup_gpu(query, vram_gb=vram, catalog=catalog).name == expected


@pytest.mark.parametrize("query, suggestion", [
    ("4090x", "RTX 4090"),
    ("RTX 3065", "RTX 3060 12GB"),
    ("3060 8GB", "RTX 3060 12GB"),  # no 8 GB 3060 in the catalogue: an error, not the 12 GB card's figures
    ("A6001", "RTX A6000"),
])
def test_unknown_name_lists_close_matches(catalog, query, suggestion):
    with pytest.raises(UserError) as caught:
        lookup_gpu(query, catalog=catalog)
    message = str(caught.value)
    assert "\n" not in message and query in message and "close matches" in message and suggestion in message


def test_nonsense_name(catalog):
    with pytest.raises(UserError, match="no close match"):
        lookup_gpu("nonsense", catalog=catalog)
    assert find_gpu("nonsense", catalog=catalog) is None
    assert find_gpu("NVIDIA GeForce RTX 3050", vram_gb=6.0, catalog=catalog) is None  # the 6 GB 3050 is not listed


def test_normalize():
    assert normalize_gpu_name("NVIDIA GeForce RTX 4060 Ti 16GB") == ("4060ti", 16.0)
    assert normalize_gpu_name("Tesla V100-SXM2-32GB") == ("v100sxm2", 32.0)
    assert normalize_gpu_name("NVIDIA RTX A4000") == ("rtxa4000", None)
    assert normalize_gpu_name("AMD Radeon RX 7900 XTX") == ("7900xtx", None)


def test_every_entry_is_complete_and_sane(catalog):
    assert len(catalog) >= len(set(REQUIRED.values()))
    for spec in catalog:
        where = spec.name
        assert spec.vendor in ("nvidia", "amd"), where
        assert 4 <= spec.vram_gb <= 200, where
        assert 100 <= spec.memory_bandwidth_gbs <= 10_000, where
        assert 1 <= spec.fp32_tflops <= 200, where
        assert spec.source and spec.architecture and spec.aliases, where
        if spec.fp16_tensor_tflops is not None:
            assert spec.fp32_tflops <= spec.fp16_tensor_tflops <= 2000, where
        if spec.bf16:
            assert spec.bf16_tensor_tflops is not None and spec.bf16_tensor_tflops > 0, where
        else:
            assert spec.bf16_tensor_tflops is None, where
        if spec.vendor == "nvidia":
            cc = spec.cc_tuple
            assert cc is not None and spec.gfx_arch is None, where
            assert spec.bf16 == (cc >= (8, 0)), where
            assert spec.fp8 == (cc >= (8, 9)), where
            assert (spec.fp16_tensor_tflops is not None) == (cc >= (7, 0)), where
        else:
            assert spec.compute_capability is None and spec.gfx_arch, where


def test_every_name_and_alias_resolves_to_its_own_entry(catalog):
    for spec in catalog:
        for text in (spec.name, *spec.aliases):
            assert find_gpu(text, vram_gb=spec.vram_gb, catalog=catalog) is spec, text


def test_catalogue_is_data_read_with_toml(catalog):
    raw = toml.load(CATALOG_PATH)
    assert [entry["name"] for entry in raw["gpu"]] == [spec.name for spec in catalog]
    assert load_catalog() == catalog  # plain data: two reads give equal entries


def test_malformed_catalogue_names_the_file(tmp_path):
    path = tmp_path / "gpus.toml"
    path.write_text('[[gpu]]\nname = "X"\naliases = []\nvendor = "nvidia"\n')
    with pytest.raises(UserError, match=r"gpus\.toml.*\(X\): missing key\(s\) architecture"):
        load_catalog(path)
    path.write_text(CATALOG_PATH.read_text().replace('bf16 = true', 'bf16 = true\nbf17 = true', 1))
    with pytest.raises(UserError, match="unknown key.*bf17"):
        load_catalog(path)
    path.write_text("[[gpu\n")
    with pytest.raises(UserError, match="cannot read the GPU catalogue"):
        load_catalog(path)
