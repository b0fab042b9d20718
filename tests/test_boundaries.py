"""The architecture's import boundaries (STYLE.md), and ruff, hold over the whole tree."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", files("jaxserve/pallas_kernels"), ids=lambda p: p.name)
def test_kernels_import_jax_and_numpy_only(path):
    roots = {name.split(".")[0] for name in imported_modules(path) if not name.startswith(".")}
    assert roots <= {"jax", "numpy", "functools", "math", "dataclasses", "__future__"}, roots


@pytest.mark.parametrize("path", files("jaxserve/models"), ids=lambda p: p.name)
def test_models_know_nothing_of_requests(path):
    forbidden = ("jaxserve.host.scheduler", "jaxserve.host.engine", "jaxserve.host.request",
                 "server")
    assert not [m for m in imported_modules(path) if m.startswith(forbidden)]


@pytest.mark.parametrize("path", files("server"), ids=lambda p: p.name)
def test_server_does_not_touch_jax(path):
    assert not [m for m in imported_modules(path) if m.split(".")[0] in ("jax", "flax")]


# what the server may not import: the device side, and the host side's working parts
ENGINE_INTERNALS = ("jaxserve.device", "jaxserve.host.scheduler", "jaxserve.host.page_allocator",
                    "jaxserve.host.engine")


@pytest.mark.parametrize("path", files("server"), ids=lambda p: p.name)
def test_server_sees_the_engine_only_through_its_client(path):
    """The server asks `jaxserve.serving.EngineClient`; it neither imports the engine's
    parts nor reaches them through an attribute."""
    assert not [m for m in imported_modules(path) if m.startswith(ENGINE_INTERNALS)]
    reached = {
        node.attr for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("llm", "scheduler", "runner")
    }
    assert not reached


@pytest.mark.parametrize("path", files("jaxserve/device"), ids=lambda p: p.name)
def test_the_device_side_holds_no_request_records(path):
    """The device side takes plain data (a StepPlan) and answers with plain data: it never
    imports the request record, the scheduler or the engine."""
    forbidden = ("jaxserve.host.request", "jaxserve.host.scheduler", "jaxserve.host.engine")
    assert not [m for m in imported_modules(path) if m.startswith(forbidden)]


HOST_MODULES = [f"host.{p.stem}" for p in files("jaxserve/host") if p.stem != "__init__"]
HOST_MODULES += ["planner", "serving"]


def test_the_host_side_imports_no_jax():
    """The request record, the scheduler and the rest of the host side load without jax,
    directly or through anything they import."""
    modules = ", ".join(f"jaxserve.{m}" for m in HOST_MODULES)
    check = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.split('.')[0] "
    check += "in ('jax', 'jaxlib', 'flax')))"
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_gateway_imports_no_engine():
    """The gateway speaks HTTP to replicas: it loads without jax, flax or torch, and none
    of its modules imports the engine's side (host, device, models)."""
    check = ("import sys, gateway.app; print(sorted(m for m in sys.modules if m.split('.')[0] "
             "in ('jax', 'jaxlib', 'flax', 'torch')))")
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    engine = ("jaxserve.host", "jaxserve.device", "jaxserve.models", "jaxserve.serving",
              "jaxserve.llm")
    for path in files("gateway"):
        assert not [m for m in imported_modules(path) if m.startswith(engine)], path


def test_ruff_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "jaxserve", "server", "gateway", "tests",
         "bench", "examples"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
