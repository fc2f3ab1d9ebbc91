"""Every command block of the README runs as written, in order, in a fresh copy of the
repository.

The first two bash blocks (create the environment, install, search; install the test
extra and run this suite) are what ``.ci/run`` executes, word for word, so they are not
repeated here (the second would run this test again). Every later ```bash and ```python
block runs here, in README order, in one copy of the repository's tracked files (so a
block can use the files an earlier one wrote, as a reader following the README would),
except blocks whose first line is ``# needs a GPU``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_MARK = "# needs a GPU"
BLOCK_TIMEOUT_S = 900


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every ```bash / ```python block, in order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M)


def test_the_first_screen_has_exactly_two_commands():
    """What a newcomer sees first: what autoplan is, then one block that installs and runs
    the main job and one that runs the tests; .ci/run runs exactly those two."""
    text = (REPO / "README.md").read_text()
    first_screen = text.split("\n---\n", 1)[0]
    blocks = readme_blocks(first_screen)
    assert [lang for lang, _ in blocks] == ["bash", "bash"]
    install, tests = (code for _, code in blocks)
    assert "torch==2.13.0" in install and "pip install -e ." in install and "autoplan search" in install
    assert install.index("torch==2.13.0") < install.index("pip install -e .")   # torch first: no CUDA pull
    assert re.search(r'pip install -e "\.\[test[],]', tests) and "python -m pytest" in tests
    ci = (REPO / ".ci" / "run").read_text()
    assert "blocks[0] + blocks[1]" in ci and "README.md" in ci
    assert "autoplan" in first_screen.split("```")[0]


def _later_blocks() -> list[tuple[str, str]]:
    blocks = readme_blocks((REPO / "README.md").read_text())
    bash = [i for i, (lang, _) in enumerate(blocks) if lang == "bash"]
    return [b for i, b in enumerate(blocks) if i > bash[1] and not b[1].startswith(GPU_MARK)]


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory) -> Path:
    """The repository's tracked files, as a fresh clone has them."""
    dest = tmp_path_factory.mktemp("readme") / "repo"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow
def test_readme_blocks_run_in_order(fresh_copy):
    blocks = _later_blocks()
    assert len(blocks) >= 5, "the README lost its command blocks"
    env = dict(os.environ)
    # `autoplan` and `python` are those of the environment running this suite.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    for i, (lang, code) in enumerate(blocks):
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(cmd, cwd=fresh_copy, env=env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, (f"README block {i + 3} ({lang}) failed with {proc.returncode}:\n{code}\n"
                                      f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    assert (fresh_copy / "run.json").is_file() and (fresh_copy / "timeline.png").is_file()
