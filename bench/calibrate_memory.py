"""Regenerate ``autotune/data/memory_calibration.json`` from fake-tensor traces and print the check table.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/calibrate_memory.py            # trace, fit, write, print
    HF_HUB_OFFLINE=1 .venv/bin/python bench/calibrate_memory.py --reuse    # refit from saved traces

``--reuse`` traces only the configurations missing from ``bench/results/memory_traces.jsonl`` (the
tiny families take seconds each; SDXL minutes) and counts FLOPs only for families the JSON lacks, so
adding a family -- as tiny-sd15 / tiny-sdxl were -- never re-traces the full-size ones.
    HF_HUB_OFFLINE=1 .venv/bin/python bench/calibrate_memory.py --families tiny-sd15,tiny-sdxl
re-traces and refits only the named families (after a change to their geometry) and copies every other
row of the shipped JSON unchanged; it needs no saved traces.
    HF_HUB_OFFLINE=1 .venv/bin/python bench/calibrate_memory.py --check    # fresh traces vs the shipped JSON
    HF_HUB_OFFLINE=1 .venv/bin/python bench/calibrate_memory.py --families sd15,sdxl --reuse
refits SD1.5 and SDXL (and SD2, which borrows SD1.5's terms) from the rows of
``autotune/data/memory_fit_configs.json``, tracing only those missing from the saved traces (~50 traces,
~10 min on this CPU from scratch), and prints the fit and check tables.

Traces (``autotune.calibration.memtrace``) are the ground truth; the analytic model (``autotune.estimate.memory_model``)
is what the planner uses. "fit" rows are the traces the coefficients come from, "held-out" rows are
configurations the fit never saw (other resolutions, ranks, optimizers, dtypes).

Traces run under CUDA autocast's op lists (``--rules cuda``, the default: ``autotune.calibration.cuda_autocast``;
layer_norm, softmax, exp and pow in fp32 as on a GPU) and their coefficients are each family's own, what GPU plans
read; ``--rules cpu`` traces under CPU autocast's and writes each refitted family's ``cpu_rules`` (what a CPU plan
reads) only. Each rule set keeps its own traces file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRACES = {"cpu": ROOT / "bench" / "results" / "memory_traces.jsonl",  # raw traces (ignored by git), for --reuse
          "cuda": ROOT / "bench" / "results" / "memory_traces_cuda.jsonl"}
RULE_KEYS = ("activations", "fp8_extra", "text_encoder_train_per_sample", "vae_encode_per_image_pixel")
FIT_CONFIGS = ROOT / "autotune" / "data" / "memory_fit_configs.json"  # full-size fit and check rows
NATIVE = {"sd15": 512, "sd2": 768, "sdxl": 1024, "tiny-sd15": 256, "tiny-sdxl": 256}
TINY = ("tiny-sd15", "tiny-sdxl")
# Resolutions whose core traces (BASE settings) enter the activation fit. The full-size families are
# fitted at their native size only (each SDXL trace costs minutes); the tiny ones trace in seconds, so
# two resolutions pin the per-latent-pixel slope independently of the constant (16x16 and 32x32 latents:
# their VAEs downsample 8x, like the full-size ones).
FIT_RESOLUTIONS = {"sd15": (256, 512), "sdxl": (512, 1024), "tiny-sd15": (128, 256), "tiny-sdxl": (128, 256)}
TINY_FLOP_RESOLUTIONS = (128, 256, 512)  # three: the FLOP fit gets a constant (see fit_flops)
TINY_RANKS = (8, 32)
BASE = {"optimizer": "AdamW", "weight_dtype": "fp16", "train_text_encoder": False, "cache_latents": True,
        "cache_text_encoder_outputs": True, "attention": "sdpa"}


def config(family: str, resolution: int | None = None, batch_size: int = 1, rank: int = 16, gc: bool = True,
           **overrides: object) -> dict[str, object]:
    return {"family": family, "resolution": resolution or NATIVE[family], "batch_size": batch_size, "rank": rank,
            "gradient_checkpointing": gc, **BASE, **overrides}


def full_size_grid(kind: str) -> list[dict[str, object]]:
    """The full-size configurations of ``kind`` ("fit" or "check") from ``autotune/data/memory_fit_configs.json``.

    Kept in a data file so the fit is reproducible and the test of the bound reads the same check rows. SDXL
    and SD1.5 are each traced at two resolutions with batch 1-8 and rank 8-128 per GC setting, so the
    per-sample and per-rank terms are their own (not borrowed), plus trained-text-encoder rows (and for
    SD1.5 fp8 and uncached latents). Each SDXL trace is ~20 s alone on this CPU.
    """
    data = json.loads(FIT_CONFIGS.read_text(encoding="utf-8"))["families"]
    out = []
    for family, kinds in data.items():
        for row in kinds[kind]:
            row = dict(row)
            gc = bool(row.pop("gc"))
            out.append(config(family, gc=gc, **row))
    return out


def fit_grid() -> list[dict[str, object]]:
    """The traces the coefficients come from, SDXL first (slowest)."""
    return full_size_grid("fit") + tiny_fit_grid()


def tiny_fit_grid() -> list[dict[str, object]]:
    """The tiny families' traces (seconds each): res x batch x rank x GC in fp16 (autocast) and fp32 --
    the CPU plan trains them in fp32, so fp32 gets its own coefficients instead of the assumed factor --
    plus the auxiliary traces at rank 16 (trained text encoder, uncached latents, fp8)."""
    grid = [config(f, res, batch_size=bs, rank=r, gc=gc, weight_dtype=dtype)
            for f in TINY for dtype in ("fp16", "fp32") for res in FIT_RESOLUTIONS[f] for gc in (False, True)
            for bs in (1, 4) for r in TINY_RANKS]
    for f in TINY:
        grid += [config(f, gc=gc, train_text_encoder=True, cache_text_encoder_outputs=False) for gc in (False, True)]
        grid += [config(f, gc=True, weight_dtype="fp8"), config(f, gc=True, cache_latents=False)]
    return grid


def held_out_grid() -> list[dict[str, object]]:
    """Configurations no fit uses: other resolutions (768 px), batches, ranks, bf16, 8-bit / Prodigy state."""
    return full_size_grid("check") + tiny_held_out_grid()


def tiny_held_out_grid() -> list[dict[str, object]]:
    """Resolutions, batches and ranks the tiny fit never saw, in each precision the planner uses."""
    out: list[dict[str, object]] = []
    for f in TINY:
        out += [config(f, 192, batch_size=2, rank=16, gc=False, weight_dtype="fp32"),
                config(f, 192, batch_size=2, rank=16, gc=True, weight_dtype="bf16", optimizer="AdamW8bit"),
                config(f, 384, batch_size=3, rank=16, gc=True, weight_dtype="fp32"),
                config(f, 256, batch_size=2, rank=16, gc=False, weight_dtype="fp32", optimizer="AdamW8bit",
                       train_text_encoder=True, cache_text_encoder_outputs=False)]
    return out


def key(cfg: dict[str, object]) -> str:
    return json.dumps(cfg, sort_keys=True)


def load_traces(rules: str = "cuda") -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    if TRACES[rules].is_file():
        for line in TRACES[rules].read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out[key(row["config"])] = row["result"]
    return out


def run_traces(configs: list[dict[str, object]], known: dict[str, dict[str, object]], fresh: bool,
               rules: str = "cuda") -> None:
    from autotune.calibration.memtrace import trace_training_step

    TRACES[rules].parent.mkdir(parents=True, exist_ok=True)
    for cfg in configs:
        if not fresh and key(cfg) in known:
            continue
        cfg_args = {k: v for k, v in cfg.items() if k not in ("family", "gradient_checkpointing")}
        result = trace_training_step(cfg["family"], gradient_checkpointing=cfg["gradient_checkpointing"],
                                     autocast_rules=rules, **cfg_args).to_dict()
        known[key(cfg)] = result
        with TRACES[rules].open("a") as fh:
            fh.write(json.dumps({"config": cfg, "result": result}) + "\n")
        print(f"traced {cfg['family']} {cfg['resolution']}px bs{cfg['batch_size']} r{cfg['rank']} "
              f"gc={int(cfg['gradient_checkpointing'])} {cfg['optimizer']} {cfg['weight_dtype']} "
              f"te={int(cfg['train_text_encoder'])} latents_cached={int(cfg['cache_latents'])} {cfg['attention']}: "
              f"peak {result['peak_bytes'] / 2**30:.3f} GiB in {result['seconds']:.1f} s", flush=True)


def _inputs(cfg: dict[str, object], rules: str = "cuda"):  # noqa: ANN202
    from autotune.estimate.memory_model import MemoryInputs

    return MemoryInputs(autocast_rules=rules, family=cfg["family"], resolution=cfg["resolution"],
                        batch_size=cfg["batch_size"],
                        rank=cfg["rank"], gradient_checkpointing=cfg["gradient_checkpointing"],
                        optimizer=cfg["optimizer"], weight_dtype=cfg["weight_dtype"],
                        train_text_encoder=cfg["train_text_encoder"], cache_latents=cfg["cache_latents"],
                        cache_text_encoder_outputs=cfg["cache_text_encoder_outputs"], attention=cfg["attention"])


def _is_core(cfg: dict[str, object], weight_dtype: str = "fp16") -> bool:
    """A trace of the activation fit: BASE settings (in ``weight_dtype``) at one of the fit resolutions."""
    base = {**BASE, "weight_dtype": weight_dtype}
    return (all(cfg[k] == v for k, v in base.items())
            and cfg["resolution"] in FIT_RESOLUTIONS.get(cfg["family"], (NATIVE[cfg["family"]],)))


def _latent_pixels(cfg: dict[str, object], arch: dict[str, object]) -> int:
    """Latent pixels of a square ``cfg["resolution"]``; the VAE's downsampling comes from the architecture."""
    return (cfg["resolution"] // arch.get("latent_downsample", 8)) ** 2


def fit(known: dict[str, dict[str, object]], architectures: dict[str, dict[str, object]],
        base: dict[str, object] | None = None) -> dict[str, object]:
    """Least-squares fit of the activation coefficients, then the auxiliary terms (see memory_model).

    Only the families in ``architectures`` are fitted. With ``base`` (the shipped calibration) every other
    family's entry and the shared factors are copied from it unchanged, so refitting the tiny families
    neither needs nor touches the full-size families' traces (SD1.5's entry is still read: the tiny
    families borrow its fp8 ratio between the GC settings).
    """
    import copy

    from autotune.estimate.memory_model import predict_memory

    fit_keys = {key(c) for c in fit_grid()}  # check rows never enter the fit, whatever their settings
    rows = [(json.loads(k), v) for k, v in known.items() if json.loads(k)["family"] in architectures and k in fit_keys]
    families: dict[str, dict[str, object]] = {}
    if base is not None:
        families.update(copy.deepcopy({f: e for f, e in base["families"].items() if f not in architectures}))
    for family, arch in architectures.items():
        families[family] = {"architecture": arch}
    # Assumed unless traced: without autocast every saved activation is fp32 instead of fp16 (x2);
    # math attention saves the fp32 softmax output (4 B) and its fp16 copy for the second matmul (2 B).
    shared: dict[str, object] = {"fp32_activation_factor": {"no_gc": 2.0, "gc": 2.0},
                                 "math_attention_bytes_per_score": {"no_gc": 6.0, "gc": 6.0},
                                 "assumed": ["fp32_activation_factor", "math_attention_bytes_per_score"]}
    if base is not None:
        shared = copy.deepcopy({k: base[k] for k in shared})
    fitted = [f for f in NATIVE if f in architectures]
    _fit_activations(rows, families, sorted(fitted, key=lambda f: f != "sd15"))  # SD1.5 first: others borrow
    # auxiliary terms: differences against the fitted base prediction of the same configuration
    calibration = {"families": families, **shared}

    def base_act(cfg: dict[str, object]) -> float:
        plain = {**cfg, **BASE}
        return predict_memory(_inputs(plain), calibration).components["activations"]

    for cfg, res in rows:
        family, gc_name = cfg["family"], "gc" if cfg["gradient_checkpointing"] else "no_gc"
        entry = families[family]
        changed = {k for k, v in BASE.items() if cfg[k] != v}
        if cfg["resolution"] != NATIVE[family] or cfg["rank"] != 16 or cfg["batch_size"] != 1:
            continue
        if changed == {"weight_dtype"} and cfg["weight_dtype"] == "fp32" and "activations_fp32" in entry:
            continue  # fitted on its own above
        act = res["activations_peak_bytes"]
        if changed == {"train_text_encoder", "cache_text_encoder_outputs"}:
            # with GC the peak comes before the text encoders' backward: their LoRA grads (counted as
            # persistent) do not exist yet and the difference can come out slightly negative
            entry["text_encoder_train_per_sample"][gc_name] = max(0.0, act - base_act(cfg))
        elif changed == {"cache_latents"}:
            persistent_no_grads = res["weights_bytes"] + res["lora_param_bytes"] + res["optimizer_state_bytes"]
            entry["vae_encode_per_image_pixel"] = (res["phase_peaks"]["vae_encode"] - persistent_no_grads) / (
                cfg["batch_size"] * cfg["resolution"] ** 2)
        elif changed == {"weight_dtype"} and cfg["weight_dtype"] == "fp8":
            entry["fp8_extra"][gc_name] = act - base_act(cfg)
        elif changed == {"weight_dtype"} and cfg["weight_dtype"] == "fp32":
            shared["fp32_activation_factor"][gc_name] = act / base_act(cfg)
            shared["assumed"] = [k for k in shared["assumed"] if k != "fp32_activation_factor"]
        elif changed == {"attention"}:
            arch = entry["architecture"]
            pixels = _latent_pixels(cfg, arch)
            if cfg["gradient_checkpointing"]:
                scores = arch["attn_self_max_layer_per_pixel2"] * pixels**2
            else:
                scores = arch["attn_self_scores_per_pixel2"] * pixels**2 + arch["attn_cross_scores_per_pixel"] * pixels
            shared["math_attention_bytes_per_score"][gc_name] = (act - base_act(cfg)) / scores
            shared["assumed"] = [k for k in shared["assumed"] if k != "math_attention_bytes_per_score"]
    calibration.update(shared)
    _borrow_untraced(families, fitted)
    for family in architectures:
        if family not in NATIVE:
            same = next(f for f in NATIVE if architectures[f]["unet"] == architectures[family]["unet"]
                        and architectures[f]["text_encoders"] == architectures[family]["text_encoders"])
            families[family]["calibrated_as"] = same
    return calibration


def _fit_activations(rows: list[tuple[dict[str, object], dict[str, object]]], families: dict[str, dict[str, object]],
                     order: list[str]) -> None:
    """Activation coefficients per family and GC setting, in ``order`` (SD1.5 first: others borrow from it)."""
    import numpy as np

    for family in order:
        entry = families[family]
        entry.update(activations={}, fp8_extra={}, text_encoder_train_per_sample={}, borrowed=[])
        arch = entry["architecture"]
        for gc_name, gc in (("no_gc", False), ("gc", True)):
            # fp32 (no autocast) gets coefficients of its own where traced (the tiny families: their
            # CPU plans train in fp32), else the shared fp32 factor applies to the fp16 ones
            fp32 = [(c, r) for c, r in rows
                    if c["family"] == family and _is_core(c, "fp32") and c["gradient_checkpointing"] == gc]
            if _full_grid(fp32):
                entry.setdefault("activations_fp32", {})[gc_name] = _fit_full(fp32, arch)
            core = [(c, r) for c, r in rows
                    if c["family"] == family and _is_core(c) and c["gradient_checkpointing"] == gc]
            if _full_grid(core):
                coef = _fit_full(core, arch)
            elif len(core) >= 2:
                # rank terms from SD1.5 scaled by LoRA size (c1: per-rank parameter count; b: module
                # count), then c0 and a fitted: act - c1*r - bs*P*b*r = c0 + bs*P*a
                y = np.array([r["activations_peak_bytes"] for _, r in core], dtype=float)
                ref = families["sd15"]["activations"][gc_name]
                ref = ref["phases"]["forward"] if "phases" in ref else ref
                ref_arch = families["sd15"]["architecture"]
                c1 = ref["c1"] * _per_rank(arch) / _per_rank(ref_arch)
                b = ref["b"] * _modules(arch) / _modules(ref_arch)
                x = np.array([[1.0, c["batch_size"] * _latent_pixels(c, arch)] for c, _ in core])
                rest = y - np.array([c1 * c["rank"] + b * c["batch_size"] * _latent_pixels(c, arch) * c["rank"]
                                     for c, _ in core])
                c0, a = np.linalg.lstsq(x, rest, rcond=None)[0]
                coef = {"c0": float(c0), "c1": float(c1), "a": float(a), "b": float(b)}
                entry["borrowed"].append(f"activations.{gc_name} rank terms (sd15 x LoRA size)")
            else:  # no traces (SD2): SD1.5's coefficients per latent pixel (near-identical UNet)
                coef = dict(families["sd15"]["activations"][gc_name])
                entry["borrowed"].append(f"activations.{gc_name} (sd15)")
            entry["activations"][gc_name] = coef


def _borrow_untraced(families: dict[str, dict[str, object]], fitted: list[str]) -> None:
    """Terms traced on some families / GC settings only are borrowed: the other GC setting scaled by
    SD1.5's ratio between the two, or SD1.5's value scaled by the size of what the term depends on.
    fp8 without GC when untraced: every upcast fp16 weight copy is saved for backward (2 B/element)."""
    ref = families["sd15"]
    if "no_gc" not in ref["fp8_extra"]:
        ref["fp8_extra"]["no_gc"] = 2.0 * ref["architecture"]["unet"]["fp8_elements"]
        ref["borrowed"].append("fp8_extra.no_gc (assumed: all upcast fp16 weights saved)")
    sizes = {"fp8_extra": lambda a: a["unet"]["fp8_elements"],
             "text_encoder_train_per_sample": lambda a: sum(t["float_elements"] for t in a["text_encoders"])}
    for family in fitted:
        entry = families[family]
        for term, size in sizes.items():
            for gc_name, other in (("no_gc", "gc"), ("gc", "no_gc")):
                if gc_name in entry[term]:
                    continue
                if other in entry[term] and family != "sd15":
                    entry[term][gc_name] = entry[term][other] * ref[term][gc_name] / ref[term][other]
                    entry["borrowed"].append(f"{term}.{gc_name} ({family} {other} x sd15 ratio)")
                else:
                    entry[term][gc_name] = ref[term][gc_name] * size(entry["architecture"]) / size(ref["architecture"])
                    entry["borrowed"].append(f"{term}.{gc_name} (sd15 x size)")
        if "vae_encode_per_image_pixel" not in entry:
            entry["vae_encode_per_image_pixel"] = ref["vae_encode_per_image_pixel"]  # same VAE
            entry["borrowed"].append("vae_encode_per_image_pixel (sd15, same VAE)")


def _full_grid(core: list[tuple[dict[str, object], dict[str, object]]]) -> bool:
    """Enough traces for all four activation coefficients: two ranks and two batch sizes at least."""
    return len(core) >= 4 and len({c["rank"] for c, _ in core}) >= 2 and len({c["batch_size"] for c, _ in core}) >= 2


PHASES = ("forward", "backward")  # the tracer's phase peaks fitted one by one (the optimizer's is exact)


def _design(core: list[tuple[dict[str, object], dict[str, object]]], arch: dict[str, object],
            per_sample: bool) -> list[list[float]]:
    """Columns 1, r, bs*P, bs*P*r (P: latent pixels) and, with ``per_sample``, bs (a per-image term)."""
    rows = []
    for c, _ in core:
        bs, pixels, rank = c["batch_size"], _latent_pixels(c, arch), c["rank"]
        rows.append([1.0, rank, bs * pixels, bs * pixels * rank] + ([float(bs)] if per_sample else []))
    return rows


def _fit_full(core: list[tuple[dict[str, object], dict[str, object]]], arch: dict[str, object]) -> dict[str, object]:
    """Activation coefficients from the traces: per phase where they span two resolutions, else one plane.

    Per phase (traces at two resolutions or more, six at least): each phase's peak over the persistent bytes
    without gradients (weights, LoRA, optimizer state) is fitted as c0 + c1*r + bs*(d + P*(a + b*r)); the
    forward's is a plane to the byte, the checkpointed backward's is not (gradients appear block by block while
    one block is recomputed), so each plane's c0 is raised by its largest residual over the fit rows: the
    upper envelope, recorded as ``envelope_bytes``. The model takes the highest phase and the optimizer's
    transient (see memory_model). Else (legacy tables): one plane c0 + c1*r + bs*P*(a + b*r) of the whole peak.
    """
    import numpy as np

    if len({c["resolution"] for c, _ in core}) < 2 or len(core) < 6:
        x = np.array(_design(core, arch, per_sample=False))
        y = np.array([r["activations_peak_bytes"] for _, r in core], dtype=float)
        solved = np.linalg.lstsq(x, y, rcond=None)[0]
        return dict(zip(("c0", "c1", "a", "b"), (float(v) for v in solved), strict=True))
    x = np.array(_design(core, arch, per_sample=True))
    phases: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        y = np.array([r["phase_peaks"][phase] - r["weights_bytes"] - r["lora_param_bytes"]
                      - r["optimizer_state_bytes"] for _, r in core], dtype=float)
        solved = np.linalg.lstsq(x, y, rcond=None)[0]
        coef = dict(zip(("c0", "c1", "a", "b", "d"), (float(v) for v in solved), strict=True))
        shift = max(0.0, float(np.max(y - x @ solved)))
        coef["c0"] += shift
        coef["envelope_bytes"] = shift
        phases[phase] = coef
    return {"phases": phases}


def _per_rank(arch: dict[str, object]) -> int:
    """UNet LoRA parameters per unit of rank."""
    return sum((int(a) + int(b)) * n for shape, n in arch["lora_modules"]["unet"]["linear"].items()
               for a, b in [shape.split("x")])


def _modules(arch: dict[str, object]) -> int:
    return sum(arch["lora_modules"]["unet"]["linear"].values())


def with_rules(shipped: dict[str, object], calibration: dict[str, object], fitted: list[str],
               rules: str) -> dict[str, object]:
    """The file to write: under CUDA's rules the new fit with each family's ``cpu_rules`` carried over from the
    shipped file; under CPU's the shipped file with the ``fitted`` families' ``cpu_rules`` replaced by the fit."""
    import copy

    if rules == "cpu":
        out = copy.deepcopy(shipped)
        for family in fitted:
            new = calibration["families"][family]
            out["families"][family]["cpu_rules"] = {k: new[k] for k in RULE_KEYS if k in new}
        return out
    for family, entry in calibration["families"].items():
        old = shipped.get("families", {}).get(family, {})
        if "cpu_rules" in old:
            entry["cpu_rules"] = old["cpu_rules"]
    return calibration


def write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def print_table(rows: list[tuple[dict[str, object], dict[str, object]]], calibration: dict[str, object],
                title: str, rules: str = "cuda") -> float:
    from autotune.estimate.memory_model import predict_memory

    print(f"\n{title}")
    print("| family | res | bs | rank | GC | optimizer | dtype | TE trained | latents cached | attn | trace GiB "
          "| predicted GiB | error | trace s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for cfg, res in rows:
        pred = predict_memory(_inputs(cfg, rules), calibration).tensor_peak_bytes
        err = (pred - res["peak_bytes"]) / res["peak_bytes"] * 100
        worst = max(worst, abs(err))
        print(f"| {cfg['family']} | {cfg['resolution']} | {cfg['batch_size']} | {cfg['rank']} | "
              f"{'on' if cfg['gradient_checkpointing'] else 'off'} | {cfg['optimizer']} | {cfg['weight_dtype']} | "
              f"{'yes' if cfg['train_text_encoder'] else 'no'} | {'yes' if cfg['cache_latents'] else 'no'} | "
              f"{cfg['attention']} | {res['peak_bytes'] / 2**30:.3f} | {pred / 2**30:.3f} | {err:+.1f}% | "
              f"{res['seconds']:.0f} |")
    print(f"worst |error|: {worst:.1f}%")
    return worst


def refit_families(selected: list[str], reuse: bool = False, rules: str = "cuda") -> int:
    """Fresh traces, FLOP counts and fits for ``selected`` only, merged into the shipped JSON.

    Every other family's entry and FLOP fit, the shared factors and the other families' trace rows are
    copied from the shipped file as they are: changing a tiny family's geometry costs a minute of tiny
    traces instead of re-tracing SDXL (minutes per trace), and the full-size calibration stays byte-identical.
    """
    import torch

    from autotune.calibration.flops import fit_flops
    from autotune.calibration.memtrace import architecture_facts
    from autotune.estimate.memory_model import CALIBRATION_PATH, load_calibration

    unknown = [f for f in selected if f not in NATIVE]
    if unknown or not selected:
        raise SystemExit(f"--families {','.join(selected)}: choose among {', '.join(NATIVE)}")
    shipped = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
    if torch.__version__ != shipped["torch"]:
        print(f"note: shipped calibration is from torch {shipped['torch']}, these traces from {torch.__version__}")
    started = time.perf_counter()
    wanted = {key(c) for c in fit_grid() + held_out_grid() if c["family"] in selected}
    known = {k: v for k, v in load_traces(rules).items() if k in wanted} if reuse else {}
    run_traces([c for c in fit_grid() + held_out_grid() if c["family"] in selected], known, fresh=not reuse,
               rules=rules)
    print(f"tracing took {time.perf_counter() - started:.0f} s")
    # SD2 borrows SD1.5's activation terms: refitting SD1.5 re-derives them
    dependents = [f for f in ("sd2", "sd2-v") if "sd15" in selected and f not in selected]
    calibration = fit(known, {f: architecture_facts(f) for f in [*selected, *dependents]}, base=shipped)
    # FLOPs depend on the geometry only: recounted for the tiny families (seconds) or where missing
    flops = {**shipped["flops"], **{f: fit_flops(f, TINY_FLOP_RESOLUTIONS if f in TINY else None) for f in selected
                                    if f in TINY or f not in shipped["flops"]}}
    fit_keys = {key(c) for c in fit_grid()}
    rows = [(json.loads(k), v) for k, v in known.items()]
    traces = [t for t in shipped["traces"] if t["config"]["family"] not in selected]
    traces += [{"config": c, "peak_bytes": r["peak_bytes"], "seconds": r["seconds"], "used_for_fit": key(c) in fit_keys}
               for c, r in rows]
    calibration.update(flops=flops, generated_by=shipped["generated_by"], torch=shipped["torch"], traces=traces)
    calibration = with_rules(shipped, calibration, [*selected, *dependents], rules)
    write_json(CALIBRATION_PATH, calibration)
    load_calibration.cache_clear()
    print(f"wrote {CALIBRATION_PATH} ({', '.join(selected)} refitted under {rules} rules, every other row as shipped)")
    worst_fit = print_table([r for r in rows if key(r[0]) in fit_keys], calibration, "Fit traces vs analytic model",
                            rules)
    worst_held = print_table([r for r in rows if key(r[0]) not in fit_keys], calibration,
                             "Held-out traces vs analytic model", rules)
    return 0 if max(worst_fit, worst_held) <= 10 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="reuse traces in bench/results/memory_traces.jsonl")
    parser.add_argument("--check", action="store_true", help="fresh traces of the held-out and a few fit rows "
                        "against the shipped calibration, without rewriting it")
    parser.add_argument("--trace-only", action="store_true")
    parser.add_argument("--flops-only", action="store_true", help="recount the FLOP fits (meta device) only")
    parser.add_argument("--part", default="0/1", help="I/N: trace only every N-th configuration from I "
                        "(run N processes side by side)")
    parser.add_argument("--families", default=None, help="comma-separated, e.g. tiny-sd15,tiny-sdxl: trace, count "
                        "and refit only these; every other family's rows stay as shipped (see refit_families)")
    parser.add_argument("--rules", choices=("cuda", "cpu"), default="cuda",
                        help="whose autocast op lists the traces follow (cpu: writes each family's cpu_rules)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.families is not None:
        return refit_families([f.strip() for f in args.families.split(",") if f.strip()], reuse=args.reuse,
                              rules=args.rules)
    known = load_traces(args.rules) if args.reuse else {}
    started = time.perf_counter()
    from autotune.calibration.memtrace import architecture_facts
    from autotune.estimate.memory_model import CALIBRATION_PATH, load_calibration

    shipped_flops = load_calibration().get("flops", {}) if CALIBRATION_PATH.is_file() else {}
    missing = [f for f in NATIVE if f not in shipped_flops]
    if args.flops_only or (missing and not args.trace_only and not args.check):
        from autotune.calibration.flops import fit_flops

        started = time.perf_counter()
        # the tiny families: three resolutions, so the fit has a constant (see fit_flops)
        flops = {**shipped_flops, **{f: fit_flops(f, TINY_FLOP_RESOLUTIONS if f in TINY else None)
                                     for f in (NATIVE if args.flops_only else missing)}}
        data = json.loads(CALIBRATION_PATH.read_text()) if CALIBRATION_PATH.is_file() else {"families": {}}
        data["flops"] = flops
        write_json(CALIBRATION_PATH, data)
        load_calibration.cache_clear()
        print(f"counted FLOPs in {time.perf_counter() - started:.0f} s")
        for f, fits in flops.items():
            print(f, {k: [round(v / 1e12, 3) for v in vals] for k, vals in fits["counted"].items()},
                  "at", fits["counted_at"])
        if args.flops_only:
            return 0
    if args.check:  # fresh traces against the shipped table
        calibration = load_calibration()
        configs = held_out_grid() + [c for c in fit_grid() if _is_core(c) and c["batch_size"] == 4][:4]
        fresh: dict[str, dict[str, object]] = {}
        run_traces(configs, fresh, fresh=True, rules=args.rules)
        worst = print_table([(json.loads(k), v) for k, v in fresh.items()], calibration,
                            "Shipped calibration vs fresh traces", args.rules)
        return 0 if worst <= 10 else 1
    index, parts = (int(x) for x in args.part.split("/"))
    run_traces((fit_grid() + held_out_grid())[index::parts], known, fresh=not args.reuse, rules=args.rules)
    print(f"tracing took {time.perf_counter() - started:.0f} s")
    if args.trace_only:
        return 0
    import torch

    architectures = {f: architecture_facts(f) for f in ("sd15", "sd2", "sd2-v", "sdxl", *TINY)}
    calibration = fit(known, architectures)
    fit_keys = {key(c) for c in fit_grid()}
    rows = [(json.loads(k), v) for k, v in known.items()]
    calibration["flops"] = load_calibration()["flops"]
    calibration["generated_by"] = "bench/calibrate_memory.py"
    calibration["torch"] = torch.__version__
    calibration["traces"] = [{"config": c, "peak_bytes": r["peak_bytes"], "seconds": r["seconds"],
                              "used_for_fit": key(c) in fit_keys} for c, r in rows]
    shipped = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
    write_json(CALIBRATION_PATH, with_rules(shipped, calibration, list(architectures), args.rules))
    load_calibration.cache_clear()
    print(f"wrote {CALIBRATION_PATH} ({args.rules} rules)")
    calibration = load_calibration()
    worst_fit = print_table([r for r in rows if key(r[0]) in fit_keys], calibration, "Fit traces vs analytic model",
                            args.rules)
    worst_held = print_table([r for r in rows if key(r[0]) not in fit_keys], calibration,
                             "Held-out traces vs analytic model", args.rules)
    return 0 if max(worst_fit, worst_held) <= 10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
