"""pyproject.toml is the one declaration of the dependencies: requirements.txt agrees with it, and every
third-party module the library and the studies import comes from a declared distribution. The library
never imports the studies, and names none of the recipe's scripts as the writer of anything."""

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]


def _toml_list(text: str, key: str) -> list:
    """The strings of ``key = [ ... ]`` in pyproject.toml (comments dropped)."""
    match = re.search(rf"^{key} = \[(.*?)\]", text, re.S | re.M)
    assert match, f"no {key} list in pyproject.toml"
    body = "\n".join(line.split("#", 1)[0] for line in match.group(1).splitlines())
    return re.findall(r'"([^"]+)"', body)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement, 1)[0].lower().replace("_", "-")


def test_requirements_txt_agrees_with_pyproject():
    pyproject = (REPO / "pyproject.toml").read_text()
    declared = [r for key in ("dependencies", "test", "studies", "gpu") for r in _toml_list(pyproject, key)]
    listed = [
        line.strip()
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert sorted(listed) == sorted(declared)


PACKAGES = ("icefall_lite", "studies")  # pyproject's [tool.setuptools.packages.find] include


def _imports(path: Path) -> set:
    """The top-level names of the absolute imports of a Python file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names}
    return found


def _third_party_imports(root: Path, skip: Sequence[Path] = ()) -> set:
    stdlib = set(sys.stdlib_module_names)
    found = set().union(*(_imports(path) for path in root.rglob("*.py") if path not in skip))
    return {n for n in found if n not in stdlib and n not in (*PACKAGES, "__future__")}


# The library's modules that may import the ``gpu`` extra (Triton), which no other library module imports.
GPU_MODULES = ("icefall_lite/nn/mutual_information_triton.py",)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_comes_from_a_declared_distribution(package):
    """The library draws on the dependencies only (and its GPU modules on the ``gpu`` extra); the studies on
    those and the ``studies`` extra."""
    pyproject = (REPO / "pyproject.toml").read_text()
    extras = ["studies"] if package == "studies" else []
    declared = {_name(r) for key in ["dependencies", *extras] for r in _toml_list(pyproject, key)}
    providers = importlib.metadata.packages_distributions()
    root = REPO / package
    modules = _third_party_imports(root, skip=[REPO / m for m in GPU_MODULES])
    assert modules, "the scan found no imports"
    for module in sorted(modules):
        dists = {_name(d) for d in providers.get(module, [])}
        assert dists & declared, f"{package} imports {module} (from {dists or 'nowhere'}), undeclared in pyproject"


def test_only_the_gpu_modules_need_the_gpu_extra_and_the_library_imports_them_only_where_triton_may_be_missing():
    pyproject = (REPO / "pyproject.toml").read_text()
    gpu = {_name(r) for r in _toml_list(pyproject, "gpu")}
    providers = importlib.metadata.packages_distributions()
    for module in GPU_MODULES:
        needs = {_name(d) for m in _imports(REPO / module) for d in providers.get(m, [])}
        assert needs & gpu, f"{module} no longer needs the gpu extra: move it back among the others"
        dotted = module.removesuffix(".py").replace("/", ".")
        importers = [
            str(p.relative_to(REPO))
            for p in (REPO / "icefall_lite").rglob("*.py")
            if str(p.relative_to(REPO)) not in GPU_MODULES and any(i.startswith(dotted) for i in _dotted_imports(p))
        ]
        assert not importers, (
            f"{importers} import {dotted} outside a try that catches its absence: the library would need Triton"
        )


def _catches_a_missing_module(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ModuleNotFoundError", "ImportError") for n in names)


def _dotted_imports(path: Path) -> set:
    """The modules ``path`` imports, but those imported in the body of a ``try`` that catches
    ModuleNotFoundError or ImportError (an import that may fail)."""
    tree = ast.parse(path.read_text())
    optional = {
        id(n)
        for t in ast.walk(tree)
        if isinstance(t, ast.Try) and any(_catches_a_missing_module(h) for h in t.handlers)
        for stmt in t.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_packages_are_the_ones_pyproject_installs():
    include = _toml_list((REPO / "pyproject.toml").read_text(), "include")
    assert include == [f"{p}*" for p in PACKAGES]
    assert all((REPO / p / "__init__.py").is_file() for p in PACKAGES)


def _code_strings(path: Path) -> list:
    """The string constants of a Python file that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_the_library_imports_no_study_and_names_no_recipe_script():
    """The studies import the library, never the other way round; no library code names a recipe script
    (``lstm_transducer_stateless/<script>.py``: the studies name the scripts they run)."""
    library = sorted((REPO / "icefall_lite").rglob("*.py"))
    assert library
    importers = [str(p.relative_to(REPO)) for p in library if "studies" in _imports(p)]
    assert not importers
    script = re.compile(r"lstm_transducer_stateless\d*/\w+\.py")
    naming = [str(p.relative_to(REPO)) for p in library if any(script.search(s) for s in _code_strings(p))]
    assert not naming
    assert any(script.search(s) for s in _code_strings(REPO / "studies/ablation/execute.py")), "the check finds one"
    assert "studies" in _imports(REPO / "egs/librispeech/ASR/lstm_transducer_stateless/ablation.py")


def test_no_tracked_file_refers_to_documents_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"DESIGN\.md|shared/reference")
    offenders = [
        f
        for f in tracked
        if f.endswith((".py", ".md", ".sh", ".toml", ".txt"))
        and f != "tests/test_packaging.py"
        and outside.search((REPO / f).read_text(errors="replace"))
    ]
    assert not offenders
