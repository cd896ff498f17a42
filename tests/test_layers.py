"""The package's layers (docs/architecture.md's table): every import, module-level or inside a function, points from a
layer to the same layer or one above it in that table, read from the source with `ast` (nothing is imported)."""
import ast
import pathlib

import megajax

PACKAGE = pathlib.Path(megajax.__file__).parent
# rank by the first name under megajax.: a module may import only ranks below its own, or its own package
RANKS = {"errors": 0, "platform": 0, "cli": 1, "outputs": 1, "parallel": 2, "data": 2, "checkpoint": 2, "models": 3,
         "config": 4, "training": 5, "evaluation": 5, "tools": 6, "convert": 6, "configs": 7,
         "api": 7, "info": 7, "comm_report": 7, "scaling": 7, "lm_eval": 7, "__init__": 7}
# the named exceptions (docs/architecture.md): the deprecated alias megajax.checkpoint.load_model imports
# config/load.py when first used; within training/evaluation only the loop's validation reaches evaluation
ALLOWED = {("checkpoint", "config"), ("training", "evaluation")}


def _imports(text: str, module: str, is_package: bool) -> set[str]:
    """The megajax modules that the source `text` of `module` imports, absolute, wherever the statement sits."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{target}.{alias.name}" for alias in node.names} if target == "megajax" else {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] == "megajax"}


def _layer(module: str) -> str:
    return (module.split(".") + ["__init__"])[1]


def _against_layers(module: str, targets: set[str]) -> list[str]:
    source = _layer(module)
    bad = []
    for target in sorted(map(_layer, targets)):
        assert target in RANKS, f"megajax.{target} has no layer in this test's table"
        if target != source and (source, target) not in ALLOWED and RANKS[target] >= RANKS[source]:
            bad.append(f"{module} -> megajax.{target}")
    return bad


def test_imports_point_one_way():
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) > 90
    upward = []
    for path in paths:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        upward += _against_layers(module, _imports(path.read_text(), module, is_package))
    assert not upward, "imports against the layers (docs/architecture.md):\n" + "\n".join(upward)


def test_the_check_catches_an_upward_import():
    """Relative imports resolve, and a primitive or a model importing from above is reported."""
    code = "from ..models import gpt\ndef f():\n    from megajax.training import loop\n"
    targets = _imports(code, "megajax.parallel.layers", is_package=False)
    assert targets == {"megajax.models", "megajax.training"}
    assert _against_layers("megajax.parallel.layers", targets) == ["megajax.parallel.layers -> megajax.models",
                                                                   "megajax.parallel.layers -> megajax.training"]
    assert _against_layers("megajax.evaluation.runner", {"megajax.training.step"}) != []


# Where a config.model ConfigDict may be a parameter: the assembly layer that resolves it, the command-line
# plumbing (with mesh.auto's expansion into the config's fields before train.py resolves it, as --mesh's), the entry
# points, and the library's two ways in (``megajax.train`` / ``training.loop.setup``)
CONFIG_READERS = {"config", "cli", "api", "info", "comm_report", "scaling", "lm_eval", "configs"}
CONFIG_ENTRIES = {("training.loop", "train"), ("training.loop", "setup"), ("convert.__main__", "*"),
                  ("tools.auto_plan", "*")}


def _config_parameters(text: str) -> list[str]:
    """The functions in ``text`` with a parameter annotated as a ConfigDict."""
    return [node.name for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and any("ConfigDict" in ast.unparse(a.annotation) for a in (*node.args.args, *node.args.kwonlyargs)
                    if a.annotation is not None)]


def test_below_the_entry_points_nothing_takes_the_config():
    """Issue 34: the config is resolved once at the top (``config.resolve`` -> ``RunSpec``, a checkpoint's as a
    ``StoredRun``); every function below takes the run or its parts, never the ConfigDict."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if _layer(f"megajax.{module}") in CONFIG_READERS:
            continue
        for name in _config_parameters(path.read_text()):
            if (module, name) not in CONFIG_ENTRIES and (module, "*") not in CONFIG_ENTRIES:
                bad.append(f"megajax.{module}.{name}")
    assert not bad, bad
    assert _config_parameters("def f(c: ml_collections.ConfigDict): pass") == ["f"]  # the check can fail
