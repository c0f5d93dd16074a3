"""Every Python and shell block of the README and of docs/*.md runs as written.

The README's blocks run in their order in one scratch folder, as a reader would type them:
``mars demo`` writes ``mars_demo/``, then the commands and the "Three calls" program run on
its world; blocks on ``sample_<tree>/`` run on the trees of ``mars sample`` (random-weight model
files in a codebase's layout). A block that cannot run here (the set-up itself, the test
command, released checkpoints) carries ``<!-- readme-test: skip (why) -->`` on the line before its fence; it is
still checked for syntax. Where a block's result can be checked cheaply, it is (see CHECKS).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>python|bash)\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>.*\S.*)\) -->")


@dataclass
class Block:
    file: Path
    line: int
    section: str
    lang: str
    code: str
    skip: Optional[str]

    @property
    def id(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> List[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()]
        line = before.count("\n") + 1
        prev = [l for l in before.split("\n") if l.strip()][-1:]  # the last non-empty line
        skip = SKIP.search(prev[0]) if prev else None
        if prev and "readme-test" in prev[0] and skip is None:
            raise AssertionError(f"{path.name}:{line}: malformed directive {prev[0]!r}; "
                                 "expected <!-- readme-test: skip (why) -->")
        headings = re.findall(r"^#+ (.*)$", before, flags=re.M)
        indent = len(m.group("indent"))
        code = "\n".join(l[indent:] for l in m.group("body").split("\n"))
        out.append(Block(path, line, headings[-1] if headings else "", m.group("lang"), code,
                         skip.group("why") if skip else None))
    return out


BLOCKS = [b for f in FILES for b in _blocks(f)]


# --------------------------------------------------------------------------------------------
# what some blocks must have produced, beyond running without an error
# --------------------------------------------------------------------------------------------
def _check_demo(cwd: Path, scope: dict) -> None:
    metrics = json.loads((cwd / "mars_demo" / "metrics.json").read_text())
    assert metrics, "mars demo wrote an empty metrics.json"
    assert (cwd / "mars_demo" / "world" / "train" / "features").is_dir()


def _check_commands(cwd: Path, scope: dict) -> None:
    """The README says these commands give the demo table's columns (a) and (b) exactly."""
    world, scratch = cwd / "mars_demo" / "world", cwd / "scratch"
    metrics = json.loads((cwd / "mars_demo" / "metrics.json").read_text())
    assert (scratch / "V.pt").is_file()
    val = sorted(p.stem for p in (world / "val" / "labels").glob("*.png"))
    assert sorted(p.stem for p in (scratch / "debiased_val").glob("*.png")) == val
    for name, column in (("a.json", "(a) WSSS pseudo"), ("b.json", "(b) debiased")):
        got, want = json.loads((scratch / name).read_text()), metrics["scores"][column]
        for key in ("iou", "fp", "fn"):
            assert np.allclose(got[key], want[key], rtol=0, atol=1e-12, equal_nan=True), (column, key)
    report = json.loads((scratch / "report" / "report.json").read_text())
    assert report["ranking"][:2] == ["boat", "train"]  # the README's sentence about the ranking


def _check_three_calls(cwd: Path, scope: dict) -> None:
    n = len(scope["stems"])
    assert n > 0 and len(list((cwd / "scratch" / "three_calls" / "debiased").glob("*.png"))) == n
    assert math.isfinite(scope["loss"].item())
    assert not (scope["y_co"] == -1).any()  # every biased pixel was filled


def _check_crf(cwd: Path, scope: dict) -> None:
    Q, U = scope["Q"], scope["U"]
    assert Q.shape == (21, 120, 160) and Q.dtype == torch.float32
    torch.testing.assert_close(Q.sum(0), torch.ones(120, 160), rtol=0, atol=1e-4)
    assert U.shape == (21, 120, 160)


def _check_sample_crf(cwd: Path) -> None:
    """`mars crf` wrote one file per image of the sample tree: labels (PNG) or (21, H, W) marginals."""
    from PIL import Image

    for tree, out, ext in (("irnet", "result/ir_label", ".png"), ("seam", "out_cam_probs", ".npy"),
                           ("seam", "probs_crf", ".png")):
        folder, images = cwd / f"sample_{tree}" / out, cwd / f"sample_{tree}" / "JPEGImages"
        if not folder.is_dir():  # a block before the one that writes it
            continue
        stems = sorted(p.stem for p in images.glob("*.jpg"))
        assert stems and sorted(p.stem for p in folder.glob(f"*{ext}")) == stems, folder
        for stem in stems:
            size = Image.open(images / f"{stem}.jpg").size[::-1]
            got = np.load(folder / f"{stem}{ext}").shape if ext == ".npy" else Image.open(folder / f"{stem}{ext}").size[::-1]
            assert tuple(got) == ((21,) + size if ext == ".npy" else size), (folder, stem, got)


def _check_dropin(cwd: Path, scope: dict) -> None:
    """The drop-in's block gives pydensecrf's Q (where the crf extra is installed), as it says."""
    if "Q" not in scope:  # another block of the section: `mars crf` on the sample trees
        _check_sample_crf(cwd)
        return
    Q, d = scope["Q"], scope["d"]
    assert Q.shape == (21,) + scope["img"].shape[:2] and Q.dtype == np.float32
    assert np.allclose(Q.sum(0), 1, atol=1e-4)
    try:
        import pydensecrf.densecrf as reference
    except ImportError:
        return
    H, W = scope["img"].shape[:2]
    ref = reference.DenseCRF2D(W, H, 21)
    ref.setUnaryEnergy(np.ascontiguousarray(scope["unary_from_softmax"](scope["probs"])))
    ref.addPairwiseGaussian(sxy=3, compat=3)
    ref.addPairwiseBilateral(sxy=80, srgb=13, rgbim=scope["img"], compat=10)
    want = np.array(ref.inference(10)).reshape(Q.shape)
    assert np.abs(Q - want).max() <= 1e-4 and (Q.argmax(0) == want.argmax(0)).mean() >= 0.9999
    assert type(d).__module__.startswith("mars_plugin.densecrf")


def _check_sample_reproduce(cwd: Path, scope: dict) -> None:
    """The offline try of `mars reproduce` on `mars sample --tree dhr` ran every stage."""
    scores = json.loads((cwd / "scratch" / "sample_reproduce" / "scores.json").read_text())
    assert scores["pseudo"]["num_images"] == 8 and "debiased" in scores
    assert (cwd / "scratch" / "sample_reproduce" / "report.md").is_file()
    if (cwd / "scratch" / "sample_reproduce" / "train").is_dir():  # after the cheap --train line
        assert (cwd / "scratch" / "sample_reproduce" / "train" / "checkpoint.pt").is_file()
        assert len(list((cwd / "scratch" / "sample_reproduce" / "masks").glob("*.png"))) == 8


CHECKS: Dict[str, Callable[[Path, dict], None]] = {
    "Start here: install, demo, tests": _check_demo,
    "Every command on the demo world": _check_commands,
    "Three calls in your WSSS codebase": _check_three_calls,
    "The dense CRF": _check_crf,
    "Use our CRF in your codebase": _check_dropin,
    "A reproduction anyone can run: `mars reproduce`": _check_sample_reproduce,
}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def _env() -> dict:
    env = dict(os.environ, MPLBACKEND="Agg")
    # the `mars` of the Python running the tests, also inside a virtual environment
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _run_bash(code: str, cwd: Path) -> None:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def _run_python(code: str, cwd: Path, origin: str, monkeypatch) -> dict:
    monkeypatch.chdir(cwd)
    scope: dict = {"__name__": "__readme__"}
    exec(compile(code, origin, "exec"), scope)
    return scope


def _needs_demo(block: Block) -> bool:
    return "mars_demo/" in block.code


SAMPLE = re.compile(r"\bsample_(dhr|irnet|advcam|seam|rsepm)\b")


def _ensure_samples(block: Block, cwd: Path) -> None:
    """Blocks on a `mars sample` tree (``sample_<tree>/``): a block that writes the tree itself
    gets a fresh folder (``mars sample`` refuses a used one); any other gets the tree written
    first when no earlier block wrote it (a block run alone, ``-k``)."""
    import shutil

    for tree in sorted(set(SAMPLE.findall(block.code))):
        folder = cwd / f"sample_{tree}"
        if re.search(rf"^mars sample --tree {tree} --out sample_{tree}\b", block.code, flags=re.M):
            shutil.rmtree(folder, ignore_errors=True)
        elif not folder.is_dir():
            _run_bash(f"mars sample --tree {tree} --out sample_{tree}", cwd)


def _ensure_demo(cwd: Path) -> None:
    """Blocks that read the demo's world, run alone (``-k``), get it from the README's block."""
    if not (cwd / "mars_demo" / "world").is_dir():
        demo = [b for b in BLOCKS if b.file.name == "README.md" and b.code.strip() == "mars demo"]
        assert len(demo) == 1, "the README must keep its `mars demo` block"
        _run_bash(demo[0].code, cwd)


def test_the_readme_has_its_blocks_and_every_skip_says_why():
    readme = [b for b in BLOCKS if b.file.name == "README.md"]
    sections = {b.section for b in readme}
    for s in ("Start here: install, demo, tests", "Every command on the demo world", "Three calls in your WSSS codebase"):
        assert s in sections, f"README section {s!r} lost its code block"
    assert "mars demo" in [b.code.strip() for b in readme]
    # a check written for a section that no longer exists would silently stop checking
    assert set(CHECKS) <= {b.section for b in BLOCKS}, set(CHECKS) - {b.section for b in BLOCKS}
    for b in BLOCKS:
        assert "/issues" not in b.code


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_written(block: Block, scratch: Path, monkeypatch):
    if block.skip is not None:
        # not run here (the reason is in the document); its syntax still has to be right
        if block.lang == "python":
            compile(block.code, block.id, "exec")
        else:
            r = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        return
    if _needs_demo(block):
        _ensure_demo(scratch)
    _ensure_samples(block, scratch)
    scope: dict = {}
    if block.lang == "bash":
        _run_bash(block.code, scratch)
    else:
        scope = _run_python(block.code, scratch, block.id, monkeypatch)
    check = CHECKS.get(block.section)
    if check is not None:
        check(scratch, scope)
