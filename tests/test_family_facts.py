"""Each family fact lives once, in the engine's family data, and every reader agrees with it.

For every family: the swap counts the engine accepts (its config reader, then the model's own family rule, as
``training/recipe.py`` applies them) are exactly the ones the planner may choose and the OOM ladder may step to;
a pinned ``--resolution`` is refused by the planner exactly when the engine refuses that size, and every size the
planner or the ladder proposes trains in the engine. Pure functions: nothing loads.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from autotune.planning.goals import GOAL_PROFILES
from autotune.planning.request import validate_resolution
from autotune.planning.search import ladder, start_point
from autotune.recovery.ladder import LadderLimits, _rungs
from sd_scripts_compat.config.training_config import load_training_config
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import family_names, get_family
from sd_scripts_compat.training.block_swap import check_blocks_to_swap
from sd_scripts_compat.training.recipe import _check_size_steps

FAMILIES = family_names()
SWAP_RANGE = range(0, 61)


def engine_accepts_swap(family: str, blocks: int) -> bool:
    spec = get_family(family)
    argv = ["--blocks_to_swap", str(blocks)] if blocks else []  # SD scripts take no such option at all
    try:
        # a family sd-scripts trains for us: its swap rule alone (the engine reads no config of it)
        config = load_training_config(argv, script=spec.engine_module.split(".")[-1]) if spec.trained_here \
            else SimpleNamespace(blocks_to_swap=blocks)
        check_blocks_to_swap(spec, config.blocks_to_swap)
    except UserError:
        return False
    return True


def planner_swaps(family: str) -> set[int]:
    """Every swap count the planner's search may reach from its start point (0 included)."""
    spec = get_family(family)
    start = start_point(spec, side=spec.resolution, rank=16, optimizer="AdamW", precision="bf16", train_te=False,
                        effective=1, attention="sdpa")
    points = ladder(start, spec, GOAL_PROFILES["character"], fp8_ok=True)
    return {0} | {point.blocks_to_swap for _, point in points}


def oom_ladder_swaps(family: str) -> set[int]:
    """Every swap count the OOM ladder's block-swap rung may step to from a run without swap."""
    spec = get_family(family)
    limits = LadderLimits.for_family(spec, budget_mib=1.0, fp8_supported=True, te_cache_allowed=True)
    settings = start_point(spec, side=spec.resolution, rank=16, optimizer="AdamW", precision="bf16",
                           train_te=False, effective=4, attention="sdpa")
    rung = next(candidates for name, candidates, _ in _rungs(settings, limits) if name == "block swap")
    return {0} | {s.blocks_to_swap for s in rung}


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_planner_and_ladder_accept_the_same_swap_counts(family: str) -> None:
    engine = {n for n in SWAP_RANGE if engine_accepts_swap(family, n)}
    assert engine == set(range(get_family(family).max_blocks_to_swap + 1))
    assert planner_swaps(family) == engine
    assert oom_ladder_swaps(family) == engine


def engine_accepts_size(family: str, side: int) -> bool:
    spec = SimpleNamespace(resolution=(side, side), enable_bucket=False, bucket_reso_steps=64)
    try:
        _check_size_steps(spec, get_family(family))
    except UserError:
        return False
    return True


def planner_accepts_size(family: str, side: int) -> bool:
    try:
        validate_resolution(side, get_family(family))
    except UserError:
        return False
    return True


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pinned_resolution_is_refused_by_the_planner_exactly_when_the_engine_refuses_it(family: str) -> None:
    spec = get_family(family)
    sides = range(8, 4 * spec.resolution + 65, 8)
    engine = {side for side in sides if engine_accepts_size(family, side)}
    assert engine, family
    assert {side for side in sides if planner_accepts_size(family, side)} == engine


@pytest.mark.parametrize("family", FAMILIES)
def test_every_size_the_planner_or_the_ladder_proposes_trains_in_the_engine(family: str) -> None:
    spec = get_family(family)
    start = start_point(spec, side=spec.resolution, rank=16, optimizer="AdamW", precision="bf16", train_te=False,
                        effective=4, attention="sdpa")
    planned = {point.resolution for _, point in ladder(start, spec, GOAL_PROFILES["character"],
                                                       fp8_ok=True)} | {start.resolution}
    limits = LadderLimits.for_family(spec, budget_mib=1.0, fp8_supported=False, te_cache_allowed=True)
    stepped = {s.resolution for name, candidates, _ in _rungs(replace(start, train_batch_size=2), limits)
               for s in candidates}
    for width, height in planned | stepped:
        assert engine_accepts_size(family, width) and engine_accepts_size(family, height), (family, width, height)
