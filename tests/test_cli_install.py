"""dspark installed as a package (not run from a source checkout): `dspark eval` finds the bundled
evaluation sets and the shipped drafter as package data. benchmarks/check_install.sh does the same
with a fresh virtualenv and `pip install .` (dependencies included), output committed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """`pip install .` (no dependencies: those of this environment serve) into a folder of its own."""
    where = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(where), str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    return where


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))  # ahead of this environment's editable dspark
    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def test_the_install_holds_the_evaluation_sets_and_the_drafter(installed):
    sets = sorted(p.name for p in (installed / "dspark" / "eval" / "data").glob("*.jsonl"))
    assert sets == ["gsm8k.jsonl", "humaneval.jsonl", "math500.jsonl", "mbpp.jsonl", "mt-bench.jsonl"]
    assert (installed / "dspark" / "drafters" / "smollm2-135m-instruct" / "model.safetensors").is_file()


@pytest.mark.slow
def test_dspark_eval_runs_from_an_install_in_another_directory(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = subprocess.run([sys.executable, "-c", "import dspark; print(dspark.__file__)"], cwd=elsewhere,
                           env=dict(os.environ, PYTHONPATH=str(installed)), capture_output=True, text=True)
    assert probe.stdout.strip().startswith(str(installed)), probe.stdout  # the installed copy, not the checkout
    done = run_installed(installed, elsewhere, "eval", "--drafter", "auto", "--limit", "1", "--max-new-tokens", "8",
                         "--out", "out")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((elsewhere / "out" / "results.json").read_text())
    assert results["config"]["datasets"] == {name: 1 for name in ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")}
