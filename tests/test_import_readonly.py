"""``import mars_plugin`` works where numba can cache nothing, and compiles nothing at import.

A read-only install run by a user without a home folder (a container as non-root) gives numba
no folder for ``cache=True``, which then raises when a function is decorated, i.e. at import.
The package must import, compile its kernels in memory on first use and give the same result.
"""
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")

import mars_plugin  # noqa: E402

SCRIPT = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("default")
    import numpy as np, torch
    import mars_plugin
    from mars_plugin.engines import kmeans_compiled
    assert mars_plugin.__file__.startswith(sys.argv[1]), mars_plugin.__file__
    assert kmeans_compiled.available() and kmeans_compiled._CACHE is False
    # Nothing was compiled at import: every kernel is still without a signature.
    compiled = [n for n in dir(kmeans_compiled) if getattr(getattr(kmeans_compiled, n), "signatures", None)]
    assert not compiled, compiled
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 4, 4, generator=g)
    y = torch.tensor([[0, 0, 1, 1]] * 4)
    a = mars_plugin.image_centroids(f, y, backend="compiled")
    b = mars_plugin.image_centroids(f, y, backend="torch")
    for c in (1,):
        assert torch.allclose(a.fg[c], b.fg[c].float(), atol=1e-5)
    assert torch.allclose(a.bg, b.bg.float(), atol=1e-5)
    print("OK")
""")


def _read_only_copy(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    shutil.copytree(Path(mars_plugin.__file__).parent, root / "mars_plugin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # A plain file where numba's in-tree cache folder would go: unwritable even for root,
    # for whom chmod alone does not stop writes.
    for d in [root / "mars_plugin"] + sorted(p for p in (root / "mars_plugin").rglob("*") if p.is_dir()):
        (d / "__pycache__").write_text("not a folder")
    for p in sorted(root.rglob("*"), reverse=True) + [root]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return root


@pytest.mark.slow
def test_import_and_compile_without_any_cache_folder(tmp_path):
    root = _read_only_copy(tmp_path)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file: nothing can be created below it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "XDG_", "PYTHON"))}
    env.update(HOME=str(blocker / "home"), XDG_CACHE_HOME=str(blocker / "cache"), PYTHONPATH=str(root),
               PYTHONDONTWRITEBYTECODE="1", MARS_NO_NUMBA="")
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(root)], env=env, capture_output=True, text=True,
                              timeout=600, cwd=str(tmp_path))
    finally:
        for p in [root] + sorted(root.rglob("*")):
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")
    assert "Traceback" not in proc.stderr
