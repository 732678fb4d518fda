"""Static checks of the structure: no import cycle among the engine's modules, no import of the tuner by the
engine, every option the engine claims to implement read by its code, no two sibling folders of either package
importing each other and each package's declared layer order, and no path of one machine in the tree.

The import graph is read from the source with ``ast`` (imports inside functions and under
``TYPE_CHECKING`` included), so a cycle hidden behind a deferred import is caught too.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "sd_scripts_compat"
PACKAGE = "sd_scripts_compat"


def engine_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every module of the engine."""
    modules = {}
    for path in sorted(ENGINE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def imported_names(module: str, path: Path, is_package: bool) -> set[str]:
    """Every dotted name ``module`` imports, wherever the import statement is (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Engine module -> the engine modules it imports (``from pkg import mod`` points at ``pkg.mod``)."""
    modules = engine_modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        targets = set()
        for imported in imported_names(name, path, is_package):
            if imported in modules:
                targets.add(imported)
            elif imported.rpartition(".")[0] in modules:  # from module import attribute
                targets.add(imported.rpartition(".")[0])
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None when the graph is acyclic (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_the_cycle_finder_names_a_cycle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # dataset/train_dataset.py reads cache files through dataset/cache_entries.py; latent_cache imports the dataset
    assert "sd_scripts_compat.dataset.cache_entries" in graph["sd_scripts_compat.dataset.train_dataset"]
    assert "sd_scripts_compat.dataset.train_dataset" in graph["sd_scripts_compat.caching.latent_cache"]
    # train_network.main imports the recipe inside the function
    assert "sd_scripts_compat.training.recipe" in graph["sd_scripts_compat.train_network"]


def test_engine_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cache_entry_format_depends_on_no_other_dataset_or_caching_module():
    """The caches write it and the dataset reads it: it stands below both, on its own."""
    imports = import_graph()["sd_scripts_compat.dataset.cache_entries"]
    assert not {m for m in imports if m.startswith(("sd_scripts_compat.dataset", "sd_scripts_compat.caching"))}, \
        imports


def test_engine_never_imports_autotune_in_its_source():
    offenders = sorted(
        f"{name} imports {imported}"
        for name, (path, is_package) in engine_modules().items()
        for imported in imported_names(name, path, is_package)
        if imported == "autotune" or imported.startswith("autotune.")
    )
    assert not offenders, offenders


def test_importing_the_entry_point_and_every_engine_module_loads_no_autotune_module():
    """A real interpreter: the entry point first, then every module of the engine (their top-level imports)."""
    code = ("import importlib, sys\n"
            "import sd_scripts_compat.train_network\n"
            f"for name in {sorted(engine_modules())!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'autotune' or m.startswith('autotune.')))")
    assert last_line_of(code) == "[]"


def last_line_of(code: str) -> str:
    """The last line ``code`` prints in a fresh interpreter with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


# ---- every option the engine claims to implement is read by its code ---------------------------------

CONFIG_NAMES = ("config", "cfg")  # what the engine calls a TrainingConfig
# Keys whose only correct handling is a check in the config reader: the engine does one thing (trains
# networks.lora, writes safetensors) and any other value is an error there; config_file is the file itself.
CHECKED_BY_THE_READER = {"network_module", "save_model_as", "config_file", "model_type", "split_mode"}


def config_reads(source: str) -> set[str]:
    """Keys a module's source reads from a config: ``config.key`` / ``cfg.key``, ``getattr(x, "key")``,
    ``self.key`` inside ``class TrainingConfig``, and the names listed in ``dataset_args``."""
    keys: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name) \
                and node.value.id in CONFIG_NAMES:
            keys.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            keys.add(str(node.args[1].value))
        elif isinstance(node, ast.ClassDef) and node.name == "TrainingConfig":
            keys.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name) and n.value.id == "self")
        elif isinstance(node, ast.FunctionDef) and node.name == "dataset_args":
            keys.update(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return keys


def literals_in_function(source: str, function: str) -> set[str]:
    """The string constants inside one top-level function of ``source``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    raise AssertionError(f"no function {function}")


def test_config_reads_sees_attributes_getattr_and_dataset_args():
    source = ("def f(config, cfg, other):\n    config.alpha; cfg.beta; other.gamma; getattr(config, 'delta')\n"
              "    config.epsilon = 1\n"
              "def dataset_args(cfg):\n    names = ('zeta',)\n")
    assert config_reads(source) == {"alpha", "beta", "delta", "zeta"}


NORMALIZERS = ("_normalize", "_normalize_legacy", "_normalize_values", "_normalize_network", "_normalize_outputs",
               "_normalize_flux")  # the reader's checks, one concern each


def test_every_implemented_option_is_read_by_the_engine():
    from sd_scripts_compat.config.training_config import ALIASES, IMPLEMENTED

    read: set[str] = set()
    for path in sorted(ENGINE.rglob("*.py")):
        read |= config_reads(path.read_text(encoding="utf-8"))
    reader = (ENGINE / "config" / "training_config.py").read_text(encoding="utf-8")
    in_normalize = set().union(*(literals_in_function(reader, name) for name in NORMALIZERS))
    in_reader = in_normalize | literals_in_function(reader, "load_training_config") | \
        literals_in_function(reader, "_read_config_file")
    read |= ALIASES & in_normalize  # deprecated spellings are mapped to their keys there
    read |= CHECKED_BY_THE_READER & in_reader
    unread = sorted(IMPLEMENTED - read)
    assert not unread, f"IMPLEMENTED keys no engine code reads (implement them or drop them from IMPLEMENTED): {unread}"


# ---- no path of one development machine in the tree --------------------------------------------------

MACHINE_PATH = re.compile(r"(?<![\w.])/(?:root|home/\w+|work)/")


def test_no_tracked_file_names_a_machine_path():
    """Local-only resources come from environment variables (tests/fixtures/local.py), the reference facts
    from ``../shared/reference`` relative to the repository."""
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    offenders = []
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".json", ".tsv", ".txt", ""} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                offenders.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


# ---- layers: no two sibling folders import each other; the tuner's folders in a declared order --------------

# Lowest first: a folder may import only folders listed before it (and the engine). ``cli.py`` sits on top and
# reaches the commands by name only.
TUNER_LAYERS = ("hardware", "estimate", "calibration", "measure", "planning", "doctor", "recovery", "report",
                "launch", "wizard", "ui", "commands")
ENGINE_LAYERS = ("data", "facts", "models", "config", "dataset", "caching", "network", "runtimes", "training")


def folder_graph(package: str) -> dict[str, set[str]]:
    """Sub-folder of ``package`` -> the sibling sub-folders its modules import (anywhere in the module)."""
    root = ROOT / package
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    graph: dict[str, set[str]] = {name: set() for name in folders}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            for name in imported_names(module, path, is_package):
                bits = name.split(".")
                if len(bits) > 1 and bits[0] == package and bits[1] in graph and bits[1] != folder:
                    graph[folder].add(bits[1])
    return graph


def layer_violations(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    rank = {name: index for index, name in enumerate(layers)}
    problems = [f"{folder} is not in the declared layers" for folder in graph if folder not in rank]
    problems += [f"{folder} imports {target} (declared above it)" for folder, targets in sorted(graph.items())
                 for target in sorted(targets) if folder in rank and target in rank and rank[target] > rank[folder]]
    return problems


def two_way_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, ())})


def test_layer_checks_catch_a_pair_and_an_upward_import():
    graph = {"low": {"high"}, "high": {"low"}}
    assert two_way_pairs(graph) == [("high", "low")]
    assert layer_violations(graph, ("low", "high")) == ["low imports high (declared above it)"]


def module_graph(package: str) -> dict[str, set[str]]:
    """Module of ``package`` -> the modules of ``package`` it imports (anywhere in the file; a name imported from
    a module counts as that module)."""
    modules: dict[str, Path] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        for name in imported_names(module, path, path.name == "__init__.py"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and modules[name].name != "__init__.py":
                graph[module].add(name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.append(sorted(members))
    return cycles


def test_the_cycle_check_finds_a_cycle_put_back():
    graph = module_graph("autotune")
    cycles = import_cycles({**graph, "autotune.recovery.decisions": {"autotune.recovery.watchdog"}})
    assert len(cycles) == 1 and {"autotune.recovery.decisions", "autotune.recovery.watchdog"} <= set(cycles[0])


def test_no_file_import_cycle():
    for package in ("autotune", PACKAGE):
        assert import_cycles(module_graph(package)) == [], package


def test_no_two_sibling_folders_import_each_other():
    for package in ("autotune", PACKAGE):
        assert two_way_pairs(folder_graph(package)) == [], package


def test_the_tuner_and_the_engine_keep_their_declared_layer_order():
    assert layer_violations(folder_graph("autotune"), TUNER_LAYERS) == []
    assert layer_violations(folder_graph(PACKAGE), ENGINE_LAYERS) == []


# ---- the facts the tuner reads from the engine (sd_scripts_compat/facts/) import no torch ----------------------

HEAVY_LIBRARIES = ("torch", "diffusers", "transformers")


def heavy_libraries_after_importing(modules: list[str], first_on_path: Path = ROOT) -> list[str]:
    """Which of torch, diffusers and transformers a fresh interpreter holds after importing ``modules``."""
    code = (f"import importlib, sys\nsys.path.insert(0, {str(first_on_path)!r})\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            f"print(sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY_LIBRARIES!r})))")
    return ast.literal_eval(last_line_of(code))


def test_the_facts_subpackage_imports_no_torch_diffusers_or_transformers():
    folder = ROOT / PACKAGE / "facts"
    modules = [f"{PACKAGE}.facts"] + [f"{PACKAGE}.facts.{path.stem}" for path in sorted(folder.glob("*.py"))
                                      if path.stem != "__init__"]
    assert len(modules) > 10  # families, settings, their space, the contract, the kohya TOML, the scan, errors...
    assert heavy_libraries_after_importing(modules) == []


def test_the_torch_free_check_finds_torch_put_back(tmp_path):
    (tmp_path / "facts_with_torch.py").write_text("import sd_scripts_compat.facts.families\nimport torch\n")
    assert heavy_libraries_after_importing(["facts_with_torch"], tmp_path) == ["torch"]


# ---- the calibration tracers (fake-tensor traces, fits) serve bench/ and tests, never a run ---------------

def test_no_product_module_imports_the_calibration_tracers():
    graph = module_graph("autotune")
    importers = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                       if target.startswith("autotune.calibration") and not module.startswith("autotune.calibration"))
    assert importers == []


def test_planning_and_the_engine_load_no_calibration_module(tmp_path):
    """A real interpreter: ``autotune plan`` in-process, then the engine's modules; what got imported."""
    code = ("import importlib, sys, contextlib, io\n"
            "from autotune.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['plan', {str(ROOT / 'examples' / 'dataset')!r}, '--model', 'builtin:tiny-sd15',"
            f" '--vram', '8', '--out', {str(tmp_path / 'plan')!r}]) == 0\n"
            "import sd_scripts_compat.training.recipe, sd_scripts_compat.runtimes.unet\n"
            "print(sorted(m for m in sys.modules if m.startswith('autotune.calibration')))")
    assert last_line_of(code) == "[]"


# ---- an engine is chosen in one place: the registry (autotune/launch/engines.py) -------------------------------

ENGINE_HOMES = {  # the registry, and each engine's own modules (reached through the registry's hooks)
    "autotune/launch/engines.py", "autotune/launch/kohya_job.py", "autotune/launch/musubi_run.py",
    "autotune/recovery/sd_scripts.py", "autotune/recovery/musubi.py"}
ENGINE_MODULES = ("autotune.recovery.sd_scripts", "autotune.recovery.musubi", "autotune.launch.musubi_run",
                  "autotune.launch.kohya_job")


def engine_choices(source: str, engines: set[str]) -> list[str]:
    """Where code picks an engine itself: an engine's ``NAME=`` prefix or name compared or matched (a family's
    ``trainer`` too: what the planner needs of a trainer is ``family.trains_with``, facts in the family data), or
    an engine's module imported."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute)
                                               and node.func.attr in ("startswith", "partition", "split")):
            continue
        if isinstance(node, (ast.Compare, ast.Call)):
            parts = list(ast.walk(node))
            literals = {p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)}
            if literals & (engines | {f"{name}=" for name in engines}):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [f"imports {name}" for name in (node.module, *(f"{node.module}.{a.name}" for a in node.names))
                      if name in ENGINE_MODULES]
        elif isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name in ENGINE_MODULES]
    return found


def test_the_engine_choice_check_finds_one_put_back():
    engines = {"sd-scripts", "musubi-tuner"}
    assert engine_choices('if str(args.engine).startswith("musubi-tuner="):\n    pass', engines)
    assert engine_choices('if kind == "sd-scripts":\n    pass', engines)
    assert engine_choices("from autotune.recovery.musubi import find_install", engines)
    assert engine_choices("from autotune.recovery import sd_scripts", engines)
    assert not engine_choices('print("--engine sd-scripts=PATH")', engines)
    assert engine_choices('if family.trainer == "musubi-tuner":\n    pass', engines)
    assert not engine_choices("if family.trains_with.caches_apart:\n    pass", engines)


def test_no_engine_is_chosen_outside_the_registry():
    from autotune.launch.engines import OURS, registered_engines

    engines = set(registered_engines()) - {OURS}
    found = [f"{path.relative_to(ROOT)}: {line}" for path in sorted((ROOT / "autotune").rglob("*.py"))
             if str(path.relative_to(ROOT)) not in ENGINE_HOMES
             for line in engine_choices(path.read_text(encoding="utf-8"), engines)]
    assert found == []


# ---- the LoRAs a user's trainer writes stay its own ------------------------------------------------------

SAFETENSORS_WRITERS = ("save_file", "save_lora_file", "write_part_file")
# the one place the tuner rewrites a trainer's LoRA: musubi-tuner's resumed attempt, relabelled as one run
LORA_REWRITERS = {"autotune/recovery/musubi.py"}


def safetensors_writes(source: str) -> list[str]:
    """The calls of a safetensors writer in ``source`` (by name, however imported)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in SAFETENSORS_WRITERS:
                found.append(f"{name} (line {node.lineno})")
    return found


def test_the_writer_check_finds_a_write_put_back():
    assert safetensors_writes("from safetensors.torch import save_file\nsave_file(t, path)\n") == [
        "save_file (line 2)"]
    assert safetensors_writes("import safetensors.torch as st\nst.save_file(t, p)\n") == ["save_file (line 2)"]
    assert safetensors_writes("print('save_file')\n") == []


def test_the_tuner_rewrites_no_lora_of_sd_scripts_lumina_hunyuan_or_anima():
    """Lumina 2, HunyuanImage-2.1 and Anima LoRAs are written by the user's sd-scripts and left as written (the slow
    wrapper test checks the bytes of a supervised Lumina run); only musubi-tuner's resumed LoRA is relabelled."""
    found = [f"{path.relative_to(ROOT)}: {call}" for path in sorted((ROOT / "autotune").rglob("*.py"))
             if str(path.relative_to(ROOT)) not in LORA_REWRITERS
             for call in safetensors_writes(path.read_text(encoding="utf-8"))]
    assert found == []


# ---- small parts: every function of the product and of bench/ at most 80 lines ---------------------------

FUNCTION_LINES = 80


def long_functions(source: str, limit: int = FUNCTION_LINES) -> list[str]:
    """``name (lines)`` of each function (methods and nested ones included) longer than ``limit`` lines."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1})" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (node.end_lineno or node.lineno) - node.lineno + 1 > limit]


def test_the_length_check_finds_a_long_function_put_back():
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    assert long_functions(f"def grown():\n{body}\n") == [f"grown ({FUNCTION_LINES + 1})"]
    assert long_functions(f"def fine():\n{body[: body.rindex(chr(10))]}\n") == []


def test_no_function_longer_than_80_lines():
    found = [f"{path.relative_to(ROOT)}: {name}" for folder in ("autotune", "sd_scripts_compat", "bench")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for name in long_functions(path.read_text(encoding="utf-8"))]
    assert found == []


# ---- what a trained family does its own way lives in its runtime (sd_scripts_compat/runtimes) -------------

RUNTIMES = ENGINE / "runtimes"
FAMILY_KEYS = ("kohya_script", "runtime")  # family data that names who trains it and how


def family_branches(source: str, families: set[str]) -> list[str]:
    """Comparisons that branch on which family this is: a family's ``kohya_script`` or ``runtime`` against a
    literal, or a literal family name against family data (a ``.name``, anything named ``family``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        parts = [part for side in (node.left, *node.comparators) for part in ast.walk(side)]
        literals = {p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)}
        attributes = {p.attr for p in parts if isinstance(p, ast.Attribute)}
        names = {p.id for p in parts if isinstance(p, ast.Name)} | attributes
        on_family = "name" in attributes or any("family" in n for n in names)
        if (literals and attributes & set(FAMILY_KEYS)) or (literals & families and on_family):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_family_branch_check_finds_one_put_back():
    from sd_scripts_compat.facts.families import family_names

    families = set(family_names())
    assert family_branches('if model.family.kohya_script == "sd3_train_network.py":\n    pass', families)
    assert family_branches('if spec.name in ("sdxl", "tiny-sdxl"):\n    pass', families)
    assert family_branches('ok = family == "flux-dev"', families)
    assert not family_branches('if layout == "sdxl" or out["model_type"] == "chroma":\n    pass', families)


def test_no_family_branch_outside_the_runtimes():
    from sd_scripts_compat.facts.families import family_names

    families = set(family_names())
    found = [f"{path.relative_to(ROOT)}:{line}" for package in (ENGINE, ROOT / "autotune")
             for path in sorted(package.rglob("*.py")) if RUNTIMES not in path.parents
             for line in family_branches(path.read_text(encoding="utf-8"), families)]
    assert found == []


def test_the_wizard_starts_runs_through_the_function_autotune_run_uses():
    """The wizard never calls the whole command line again (``cli.main``), nor any command module."""
    graph = import_graph_of(ROOT / "autotune" / "wizard")
    assert not {m for m in graph if m == "autotune.cli" or m.startswith("autotune.commands")}, graph
    assert "autotune.launch.run" in graph


def import_graph_of(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        names |= imported_names(".".join(parts[:-1] if is_package else parts), path, is_package)
    return names


# ---- past the edge a family is a FamilySpec (the CLI, wizard, web app and config reader convert it once) -----

# where a name is right: detection and the doctor's resolve_family turn the user's word into the object, and the
# estimate models' inputs are records keyed by name, as their calibration JSON and the published rows are
FAMILY_NAME_TAKERS = {"resolve_family", "family_calibration", "dit_family_calibration", "of_trace",
                      "activation_tokens", "lycoris_tensor_sizes"}
DETECTION = ENGINE / "models" / "detect.py"  # the converter itself: a stated name against the model's files
BENCH_TOOLS = ROOT / "autotune" / "calibration"  # the tracers bench/ drives: their inputs are its command line


def family_names_taken(source: str) -> list[str]:
    """``function(parameter)`` for each parameter named like a family whose annotation lets a ``str`` in."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in FAMILY_NAME_TAKERS:
            continue
        for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if arg.arg in ("family", "stated") and re.search(r"\bstr\b", annotation):
                found.append(f"{node.name}({arg.arg}: {annotation})")
    return found


def test_the_family_name_check_finds_one_put_back():
    assert family_names_taken("def load(text: str, *, family: str | None = None):\n    pass") == [
        "load(family: str | None)"]
    assert family_names_taken("def plan(stated: str | FamilySpec):\n    pass") == ["plan(stated: str | FamilySpec)"]
    assert not family_names_taken("def load(spec: str | os.PathLike[str], family: FamilySpec | None):\n    pass")
    assert not family_names_taken("def resolve_family(model: str, family: str):\n    pass")


def test_past_the_edge_a_family_is_a_familyspec():
    found = [f"{path.relative_to(ROOT)}: {taken}" for package in (ENGINE, ROOT / "autotune")
             for path in sorted(package.rglob("*.py")) if BENCH_TOOLS not in path.parents and path != DETECTION
             for taken in family_names_taken(path.read_text(encoding="utf-8"))]
    assert found == []
