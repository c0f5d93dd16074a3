"""The README's dense-CRF code block runs as written (and gives what it says)."""
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(section: str) -> str:
    text = README.read_text()
    start = text.index(f"## {section}\n")
    end = text.index("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)
    assert len(blocks) == 1, f"expected one python block under '## {section}', found {len(blocks)}"
    return blocks[0]


def test_dense_crf_block_runs():
    scope = {}
    exec(compile(_block("The dense CRF"), str(README), "exec"), scope)
    Q, U = scope["Q"], scope["U"]
    assert Q.shape == (21, 120, 160) and Q.dtype == torch.float32
    torch.testing.assert_close(Q.sum(0), torch.ones(120, 160), rtol=0, atol=1e-4)
    assert U.shape == (21, 120, 160)
