"""The layout answers "where is X" and its arrows point one way (README, "How the code is laid
out"): commands use the method, the method uses the engines; formats, networks and adapters
never reach up to the commands; setup.cfg installs every package."""
import ast
import configparser
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]

#: What each layer may import (besides itself). "api" is mars_plugin/__init__.py, "base" the
#: private helpers every layer shares (_checks, _wait_policy, _interrupt).
ALLOWED: Dict[str, Set[str]] = {
    "base": set(),
    "formats": {"base"},
    "engines": {"base", "formats"},
    "method": {"base", "formats", "engines"},
    # the pydensecrf drop-in (issue 34) is built on the engines; nothing imports it back
    "densecrf": {"base", "engines"},
    "networks": {"base", "formats", "engines"},
    "worlds": {"base", "formats"},
    "api": {"base", "method", "engines"},
    "adapters": {"base", "formats", "engines", "method", "networks", "api"},
    # the run machinery (issue 33): a features run's identity names a USS model's files (adapters),
    # a run record the package's version (api)
    "runs": {"base", "formats", "adapters", "api"},
    "pictures": {"base", "formats"},
    "commands": {"base", "formats", "engines", "method", "networks", "worlds", "adapters", "api", "runs", "pictures"},
    "cli": {"base", "formats", "engines", "method", "networks", "worlds", "adapters", "api", "commands", "runs",
            "pictures"},
}


def _layer_of_file(path: Path) -> Tuple[str, str]:
    """(layer, dotted module name) of a source file."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "adapters":
        mod = "mars_plugin." + ".".join(rel.with_suffix("").parts)
        return "adapters", mod.removesuffix(".__init__")
    mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    return _layer_of_module(mod), mod


def _layer_of_module(mod: str) -> str:
    parts = mod.split(".")
    if parts == ["mars_plugin"]:
        return "api"
    sub = parts[1]
    if sub in ("_checks", "_wait_policy", "_interrupt"):
        return "base"
    if sub == "cli":
        return "cli"
    if sub == "adapters":
        return "adapters"
    return sub


def _sources() -> List[Path]:
    return sorted((ROOT / "mars_plugin").rglob("*.py")) + sorted((ROOT / "adapters").rglob("*.py"))


def _imports(path: Path, module: str) -> List[Tuple[int, str]]:
    """Every mars_plugin module a file imports, at any depth (function-level imports too)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "mars_plugin"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] == "mars_plugin":
                found.append((node.lineno, name))
                # `from mars_plugin.<package> import <name>` may import the module <package>.<name>
                found += [(node.lineno, f"{name}.{a.name}") for a in node.names
                          if (ROOT / Path(*f"{name}.{a.name}".split(".")[1:])).with_suffix(".py").exists()]
    return found


def test_the_sources_are_found():
    layers = {_layer_of_file(p)[0] for p in _sources()}
    assert {"method", "engines", "formats", "networks", "commands", "runs", "pictures", "worlds", "adapters", "cli",
            "api"} <= layers


def test_no_import_runs_up_the_layers():
    bad = []
    for path in _sources():
        layer, module = _layer_of_file(path)
        for line, name in _imports(path, module):
            if name.startswith("mars_plugin.adapters"):
                target = "adapters"
            else:
                target = _layer_of_module(name)
            if target != layer and target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {name} ({target})")
    assert not bad, "\n".join(bad)


def test_setup_cfg_installs_every_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {_layer_of_file(p)[1] for p in _sources() if p.name == "__init__.py"}
    assert listed == found, (sorted(found - listed), sorted(listed - found))


def test_every_package_docstring_names_its_modules():
    """Each package's docstring is its table of contents: it names every module in it."""
    missing = []
    for init in [p for p in _sources() if p.name == "__init__.py"]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for mod in sorted(init.parent.glob("*.py")):
            if mod.name != "__init__.py" and mod.name not in doc and mod.parent.name in (
                    "method", "engines", "formats", "networks", "commands", "worlds", "wsss", "uss", "densecrf", "runs",
                    "pictures"):
                missing.append(f"{init.relative_to(ROOT)} does not name {mod.name}")
    assert not missing, "\n".join(missing)


#: The compiled numba kernels are long by nature (one function per loop nest).
KERNELS = {"crf_compiled.py", "kmeans_compiled.py"}
MAX_LINES = 520  # "about 500"


def test_no_module_is_over_about_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _sources() if p.name not in KERNELS
            for n in [len(p.read_text().splitlines())] if n > MAX_LINES]
    assert not long, "\n".join(long)


#: ``mars reproduce`` is a settings record and a few small stages (issue 31, "Shape"); the
#: function length counts the whole def (signature, docstring, nested functions): end_lineno - lineno.
MAX_FUNCTION_LINES = 60


def test_no_reproduce_function_is_over_60_lines():
    long = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno} lines"
            for p in sorted((ROOT / "mars_plugin" / "commands").glob("reproduce*.py"))
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno > MAX_FUNCTION_LINES]
    assert len(list((ROOT / "mars_plugin" / "commands").glob("reproduce*.py"))) >= 6
    assert not long, "\n".join(long)
