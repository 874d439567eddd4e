"""pyproject.toml is the one declaration of the dependencies: requirements.txt agrees with it, and every
third-party module the library imports comes from a declared distribution."""

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

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
    declared = _toml_list(pyproject, "dependencies") + _toml_list(pyproject, "test")
    listed = [
        line.strip()
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert sorted(listed) == sorted(declared)


def _third_party_imports(root: Path) -> set:
    stdlib = set(sys.stdlib_module_names)
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found |= {n.split(".")[0] for n in names}
    return {n for n in found if n not in stdlib and n not in ("icefall_lite", "__future__")}


def test_every_library_import_comes_from_a_declared_distribution():
    declared = {_name(r) for r in _toml_list((REPO / "pyproject.toml").read_text(), "dependencies")}
    providers = importlib.metadata.packages_distributions()
    modules = _third_party_imports(REPO / "icefall_lite")
    assert modules, "the scan found no imports"
    for module in sorted(modules):
        dists = {_name(d) for d in providers.get(module, [])}
        assert dists & declared, (
            f"icefall_lite imports {module} (from {dists or 'nowhere'}), not declared in pyproject.toml"
        )


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
