"""The house's rules: which rooms may import which, and that the dependencies declared are the ones imported.

Rooms (see docs/development.md):

    pipeline.core        the contract and what both halves share (shard format, loader, tokenizer, ...)
    pipeline.sample      the embedded sample and its judge
    pipeline.vqgan       images <-> codes, and training a small VQGAN
    pipeline.preprocess  the organiser's stages; of the project's code only the CLI and the demo reach into them
                         (bench/ and tests/ may import anything)
    training             floors, each importing only from the floors below it (training/__init__.py):
                         config; model, optimizer, metrics; checkpoint, auth; the run spec; swarm, audit (side by
                         side); calc; peer and monitor (side by side: neither imports the other)
    inference            the generator: from pipeline/ the core, the VQGAN codec (and its grids) and the sample judge;
                         from training/ the config, the model and checkpoints

ALLOWED states these rules; a new import that breaks them fails the first test.

hivemind's door: training/swarm/ is the only room that touches hivemind's internals (its underscored names, and the
tables it patches), and each one it touches is listed, with the hivemind line it relies on, in
docs/design/hivemind-overrides.md; peer/, monitor/ and calc/ do not import hivemind at all (they hold a `SwarmMember`,
training/swarm/member.py, and hivemind's DHT through its public methods).
"""

import ast
import functools
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("pipeline", "training", "inference", "cli", "data_cards")
CORE_DISTRIBUTIONS = {"numpy", "pyarrow", "torch", "click", "rich", "tqdm"}

# The floors of training/ below the swarm, and what the generator uses of training/.
TRAINING_BASE = ["pipeline.core", "training.config", "training.model", "training.optimizer", "training.metrics"]
INFERENCE_TRAINING = ["training.config", "training.model", "training.checkpoint"]
# Importing module (or room) -> the project modules (or rooms) it may import; the longest matching name wins.
ALLOWED = {
    "pipeline": [],
    "pipeline.core": ["pipeline.core"],
    "pipeline.sample": ["pipeline.core", "pipeline.sample"],
    "pipeline.vqgan": ["pipeline.core", "pipeline.sample", "pipeline.vqgan"],
    "pipeline.preprocess": ["pipeline.core", "pipeline.sample", "pipeline.vqgan", "pipeline.preprocess"],
    "pipeline.inspect_dataset": ["pipeline.core", "pipeline.sample", "pipeline.vqgan"],
    "training": ["pipeline.core", "training"],
    "training.config": ["pipeline.core", "training.config"],
    "training.model": ["training.config", "training.model"],
    "training.optimizer": ["training.config", "training.optimizer"],
    "training.metrics": ["training.metrics"],
    "training.checkpoint": ["pipeline.core", "training.config", "training.model", "training.checkpoint"],
    # hivemind's token protocol and key wrapper, which auth needs, sit with the other overrides in swarm/.
    "training.auth": [
        "pipeline.core", "training.config", "training.metrics", "training.auth", "training.swarm.authorizer"
    ],  # fmt: skip
    "training.spec": ["pipeline.core", "training.config", "training.auth", "training.spec"],
    "training.swarm": [*TRAINING_BASE, "training.auth", "training.swarm"],
    "training.swarm.authorizer": ["training.auth.tokens", "training.swarm.authorizer"],
    "training.audit": [*TRAINING_BASE, "training.audit"],
    "training.calc": [*TRAINING_BASE, "training.swarm", "training.audit", "training.calc"],
    "training.peer": [*TRAINING_BASE, "training.checkpoint", "training.auth", "training.spec", "training.swarm",
                      "training.audit", "training.calc", "training.peer"],  # fmt: skip
    # The run's monitor draws previews of the sample's prompts from its checkpoints with the generator.
    "training.monitor": [*TRAINING_BASE, "training.checkpoint", "training.auth", "training.spec", "training.swarm",
                         "training.audit", "training.calc", "training.monitor", "inference.generate",
                         "inference.sample_quality"],  # fmt: skip
    "inference": [
        "pipeline.core",
        "pipeline.vqgan.codec",
        "pipeline.vqgan.grid",
        "pipeline.sample",  # the judge, and the sample's constants (its default port, which the demo serves it on)
        *INFERENCE_TRAINING,
        "inference",
    ],
    "inference.demo": [
        "pipeline.core",
        "pipeline.preprocess.options",
        "pipeline.preprocess.run",
        "pipeline.sample.tokenizer",
        *INFERENCE_TRAINING,
        "inference",
    ],
    "cli": list(PROJECT),
}
# Declared, but never imported by name: what each is for.
RUNTIME_ONLY = {
    "bokeh": "Dask's dashboard",
    "jinja2": "huggingface_hub renders the data card template with it",
    "einops": "taming imports it without declaring it",
    "pytest-timeout": "a pytest plugin",
    "pytest-xdist": "a pytest plugin: `make test` runs the tests in parallel workers",
    "ruff": "the linter `make test` runs",
    "setuptools": "the build backend of the wheel the monitor builds (training/monitor/wheel.py)",
    "tomli": "the allowlist's TOML reader on Python 3.10 (installed there only; tomllib from 3.11)",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules(*folders: str) -> dict[str, Path]:
    found = {}
    for folder in folders:
        paths = [ROOT / folder] if folder.endswith(".py") else sorted((ROOT / folder).rglob("*.py"))
        found.update({module_name(path): path for path in paths})
    return found


def imports(path: Path, module_level_only: bool = False) -> set[str]:
    """Absolute module names `path` imports (inside functions too, unless `module_level_only`)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pipeline.sample import judge`
        elif is_import_module_call(node):  # importlib.import_module("taming.models.vqgan")
            names.add(node.args[0].value)
    return names


def is_import_module_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def is_within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def allowed_rooms(module: str) -> list[str]:
    rooms = [room for room in ALLOWED if is_within(module, room)]
    return ALLOWED[max(rooms, key=len)]


def project_imports(path: Path) -> set[str]:
    """Project modules `path` imports; `from pipeline.sample import X` counts as pipeline.sample.X when that is one."""
    known = source_modules("pipeline", "training", "inference", "cli.py")
    found = set()
    for name in imports(path):
        if name.split(".")[0] not in PROJECT:
            continue
        parent = name.rsplit(".", 1)[0]
        found.add(name if name in known or parent not in known else parent)
    return found


@pytest.mark.parametrize("module", sorted(source_modules("pipeline", "training", "inference", "cli.py")))
def test_each_room_imports_only_the_rooms_it_may(module):
    path = source_modules("pipeline", "training", "inference", "cli.py")[module]
    allowed = allowed_rooms(module)
    wrong = sorted(name for name in project_imports(path) if not any(is_within(name, room) for room in allowed))
    assert not wrong, f"{module} imports {wrong}; it may import only {allowed}"


def declared() -> dict[str, set[str]]:
    """Extra ("" for the core) -> the distributions pyproject.toml declares in it (normalised names)."""
    groups: dict[str, set[str]] = {}
    for requirement in importlib.metadata.requires("ttt") or []:
        name, extras = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", requirement).groups()
        extra = re.search(r'extra == "([^"]+)"', requirement)
        names = {name} | set((extras or "").split(",")) - {""}
        if name == "ttt":  # an extra made of other extras (all, monitor): their packages are declared there
            continue
        groups.setdefault(extra.group(1) if extra else "", set()).update(normalise(n) for n in names)
    return groups


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party(names: set[str]) -> set[str]:
    tops = {name.split(".")[0] for name in names}
    ours = PROJECT + ("conftest", "tests", "bench")
    return {top for top in tops if top not in sys.stdlib_module_names and top not in ours}


def distributions(tops: set[str]) -> dict[str, str]:
    """Top-level module -> the distribution that provides it."""
    providers = importlib.metadata.packages_distributions()
    return {top: normalise(providers[top][0]) for top in tops if top in providers}


def test_every_imported_package_is_declared_and_every_declared_one_is_used():
    groups = declared()
    runtime = set().union(*(v for k, v in groups.items() if k != "dev"))
    code = set().union(*(imports(p) for p in source_modules("pipeline", "training", "inference", "cli.py").values()))
    checks = set().union(*(imports(p) for p in source_modules("tests", "bench").values()))
    code_distributions = distributions(third_party(code))
    undeclared = {top: dist for top, dist in code_distributions.items() if dist not in runtime}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    check_distributions = distributions(third_party(checks))
    assert set(check_distributions.values()) <= runtime | groups["dev"]
    used = set(code_distributions.values()) | set(check_distributions.values())
    unused = (runtime | groups["dev"]) - used - set(RUNTIME_ONLY)
    assert not unused, f"declared but never imported: {sorted(unused)}; remove them or say why in RUNTIME_ONLY"


@pytest.mark.parametrize("module", sorted(source_modules("pipeline/core")))
def test_the_core_imports_only_core_dependencies_at_module_level(module):
    """The contract imports with the core install; anything else (pandas, huggingface_hub) only where it is used."""
    path = source_modules("pipeline/core")[module]
    extra = set(distributions(third_party(imports(path, module_level_only=True))).values()) - CORE_DISTRIBUTIONS
    assert not extra, f"{module} imports {sorted(extra)} at module level"


SWARM = "training/swarm"
OVERRIDES = ROOT / "docs" / "design" / "hivemind-overrides.md"
WITHOUT_HIVEMIND = ("training/peer", "training/monitor", "training/calc")


@functools.cache
def hivemind_private_names() -> frozenset[str]:
    """Every underscored name hivemind defines (not dunders): functions, classes, attributes, module-level names."""
    package = Path(importlib.util.find_spec("hivemind").origin).parent
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = node.name
            elif isinstance(node, ast.Attribute | ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.attr if isinstance(node, ast.Attribute) else node.id
            else:
                continue
            if name.startswith("_") and not name.startswith("__") and name != "_":
                names.add(name)
    return frozenset(names)


def hivemind_privates_used(path: Path) -> set[str]:
    """hivemind's private names that `path` uses: attributes read or set, methods overridden, names imported."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            used.add(node.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hivemind"):
            used |= {alias.name for alias in node.names}
    return used & hivemind_private_names()


def code_outside_the_swarm() -> dict[str, Path]:
    modules = source_modules("pipeline", "training", "inference", "cli.py", "bench")
    return {name: path for name, path in modules.items() if not path.is_relative_to(ROOT / SWARM)}


def test_only_the_swarm_room_touches_hivemind_internals():
    found = {name: sorted(hivemind_privates_used(path)) for name, path in code_outside_the_swarm().items()}
    leaks = {name: names for name, names in found.items() if names}
    assert not leaks, f"hivemind's internals outside {SWARM}/ (move them behind its interface): {leaks}"


def listed_overrides() -> set[str]:
    """The private names the overrides page lists in a bullet that gives a hivemind line (`file.py:123` or `:123`)."""
    bullets = re.split(r"\n(?=- |## |\| )", OVERRIDES.read_text())
    with_lines = [bullet for bullet in bullets if re.search(r"(?:\.py)?:\d+", bullet)]
    return {name for bullet in with_lines for name in re.findall(r"`[\w.]*?(_\w+)[^`]*`", bullet)}


def test_every_hivemind_internal_the_swarm_touches_is_listed_with_the_line_it_relies_on():
    listed = listed_overrides()
    used = {name: hivemind_privates_used(path) for name, path in source_modules(SWARM).items()}
    missing = {module: sorted(names - listed) for module, names in used.items() if names - listed}
    assert not missing, f"not listed in {OVERRIDES.relative_to(ROOT)}: {missing}"


@pytest.mark.parametrize("module", sorted(source_modules(*WITHOUT_HIVEMIND)))
def test_peer_monitor_and_calc_reach_hivemind_only_through_the_swarm_room(module):
    path = source_modules(*WITHOUT_HIVEMIND)[module]
    direct = sorted(name for name in imports(path) if name.split(".")[0] == "hivemind")
    assert not direct, f"{module} imports {direct}: ask training/swarm/ (its SwarmMember, its dht module) instead"
