"""The training-hook recipes of docs/adapters.md run as written inside loops of the upstream shape.

Each recipe block is a list of edits ("L157-158 ..., replace with:", "after L247 ..., add:").
The loops below are written here in the shape of the upstream files the recipes were checked
against (their variable names, their device handling, deeplab-pytorch's multi-scale training
output, the SEAM codebase's tabs); every line an edit names carries a ``# L<n>`` tag with the
upstream line number. The test applies the recipe's lines exactly, indented like the line they
replace, and runs the result on a tiny dataset: a recipe that names an undefined variable, or
lines indented with spaces in a tab-indented file, fails here.
"""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adapters.md"
EDIT = re.compile(r"^# -- (?P<after>after )?L(?P<a>\d+)(?:-(?P<b>\d+))? (?P<tokens>.*), (?P<action>add|replace with):$")


def recipe(name: str) -> List[Tuple[bool, int, int, str, List[str]]]:
    """(after, first line, last line, identifying tokens, new lines) of the doc's recipe ``name``."""
    blocks = re.findall(r"```python\n(# recipe " + name + r":.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/adapters.md must hold one '# recipe {name}:' block"
    edits, cur = [], None
    for line in blocks[0].splitlines()[1:]:
        m = EDIT.match(line)
        if m:
            a = int(m.group("a"))
            cur = (bool(m.group("after")), a, int(m.group("b") or a), m.group("tokens"), [])
            edits.append(cur)
        else:
            assert cur is not None and line.strip() and not line.startswith("#"), f"unexpected line {line!r}"
            cur[4].append(line)
    return edits


def apply(template: str, edits, indent_with=None, check_tokens: bool = True) -> str:
    """The template with each edit applied at its ``# L<n>`` tagged lines, bottom-up so that the
    tags stay where they are."""
    lines = template.split("\n")

    def where(n: int) -> int:
        hits = [i for i, l in enumerate(lines) if l.rstrip().endswith(f"# L{n}")]
        assert len(hits) == 1, f"template line L{n}: {len(hits)} tagged"
        return hits[0]

    for after, a, b, tokens, new in sorted(edits, key=lambda e: -e[1]):
        first, last = where(a), where(b)
        # the doc's identifying tokens name what the template holds at those lines
        for tok in re.findall(r"`([^`]*)`", tokens) if check_tokens else ():
            head = tok.split("(")[0].split("...")[0].strip()
            assert any(head in l for l in lines[first : last + 1]), (tok, lines[first : last + 1])
        ref = lines[first] if not after else lines[last]
        ws = ref[: len(ref) - len(ref.lstrip())]
        if indent_with is not None:
            ws = ws.replace("\t", indent_with)
        body = [ws + l for l in new]
        if after:
            lines[last + 1 : last + 1] = body
        else:
            lines[first : last + 1] = body
    return "\n".join(lines)


def write_cls_labels(path: Path, classes: dict, *, str_keys: bool) -> None:
    """IRNet/AdvCAM cls_labels.npy ({int id: float32 (20,)}) or SEAM's (str keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    d = {}
    for k, ids in classes.items():
        v = np.zeros(20, np.float32)
        v[[c - 1 for c in ids]] = 1
        d[k if str_keys else int(k.replace("_", ""))] = v
    np.save(str(path), d)


IDS = {"2007_000032": [1], "2007_000039": [15], "2007_000063": [8, 12], "2007_000068": [3]}


def labels_for(ids, size=16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ys = []
    for i in ids:
        y = torch.zeros(size, size, dtype=torch.long)
        for c in IDS[i]:
            y[2:10, 2 + c % 5 : 12] = c
        y[torch.rand(size, size, generator=g) < 0.2] = 254  # biased, as write_debiased stores it
        y[0] = 255
        ys.append(y)
    return torch.stack(ys)


# --------------------------------------------------------------------------------------------
# AdvCAM + deeplab-pytorch main.py (4219467): train(), reduced to the loop's shape
# --------------------------------------------------------------------------------------------
DEEPLAB = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from libs.utils import DenseCRF, PolynomialLR, scores  # L28
from scaffold import CONFIG, MSCNet, make_loader, resize_labels, tqdm


def train():
    device = torch.device("cpu")
    loader = make_loader()
    loader_iter = iter(loader)
    model = MSCNet(n_classes=CONFIG.DATASET.N_CLASSES)
    model = nn.DataParallel(model)
    model.to(device)

    # Loss definition
    criterion = nn.CrossEntropyLoss(ignore_index=CONFIG.DATASET.IGNORE_LABEL)  # L157
    criterion.to(device)  # L158

    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.SOLVER.LR, momentum=0.9)
    scheduler = PolynomialLR(optimizer)
    model.train()
    model.module.base.freeze_bn()
    losses = []
    for iteration in tqdm(range(1, CONFIG.SOLVER.ITER_MAX + 1)):
        optimizer.zero_grad()
        loss = 0
        for _ in range(CONFIG.SOLVER.ITER_SIZE):
            try:
                _, images, labels = next(loader_iter)  # L222
            except StopIteration:
                loader_iter = iter(loader)
                _, images, labels = next(loader_iter)  # L225
            logits = model(images.to(device))
            iter_loss = 0  # L231
            for logit in logits:  # L232
                # one CE per scale, the labels resized to it  # L233
                _, _, H, W = logit.shape  # L234
                labels_ = resize_labels(labels, size=(H, W))  # L235
                iter_loss += criterion(logit, labels_.to(device))  # L236
            iter_loss /= CONFIG.SOLVER.ITER_SIZE
            iter_loss.backward()
            loss += float(iter_loss)
        losses.append(loss)
        optimizer.step()  # L247
        scheduler.step(epoch=iteration)
    return model, losses, locals()
'''

DEEPLAB_SCAFFOLD = '''
"""Stand-ins for what deeplab-pytorch's main.py imports (config, MSC model, loader)."""
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = types.SimpleNamespace(
    DATASET=types.SimpleNamespace(N_CLASSES=21, IGNORE_LABEL=255),
    SOLVER=types.SimpleNamespace(LR=0.01, ITER_MAX=3, ITER_SIZE=2),
)


def tqdm(x, **kw):
    return x


class PolynomialLR:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, epoch):
        pass


class Base(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, n_classes, 1)

    def freeze_bn(self):
        self.bn.eval()

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


class MSCNet(nn.Module):
    """MSC's output contract: training -> [1x, 0.75x, 0.5x, max], eval -> one map."""

    def __init__(self, n_classes):
        super().__init__()
        self.base = Base(n_classes)

    def forward(self, x):
        logits = self.base(x)
        h, w = logits.shape[2:]
        pyramid = [self.base(F.interpolate(x, scale_factor=s, mode="bilinear", align_corners=False)) for s in (0.75, 0.5)]
        if not self.training:
            return logits
        up = [F.interpolate(p, size=(h, w), mode="bilinear", align_corners=False) for p in pyramid]
        return [logits] + pyramid + [torch.max(torch.stack([logits] + up), dim=0)[0]]


def resize_labels(labels, size):
    return F.interpolate(labels[:, None].float(), size=size, mode="nearest")[:, 0].long()


def make_loader():
    import numpy as np
    from test_recipes import IDS, labels_for

    ids = sorted(IDS)
    g = torch.Generator().manual_seed(0)
    batches = []
    for k in range(0, len(ids), 2):
        b = ids[k : k + 2]
        batches.append((tuple(b), torch.randn(len(b), 3, 16, 16, generator=g), labels_for(b, seed=k)))
    return batches
'''


def _run(tmp_path: Path, name: str, program: str, scaffold: str, call: str) -> subprocess.CompletedProcess:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / f"{name}.py").write_text(program)
    (work / "scaffold.py").write_text(scaffold)
    (work / "libs").mkdir(exist_ok=True)
    (work / "libs" / "__init__.py").write_text("")
    (work / "libs" / "utils.py").write_text("from scaffold import PolynomialLR\nDenseCRF = scores = None\n")
    code = f"import sys; sys.path[:0] = [{str(work)!r}, {str(Path(__file__).parent)!r}]\n" + call
    return subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=300)


def test_deeplab_template_runs_unchanged_on_clean_labels(tmp_path):
    """Control: the loop itself is sound (plain CE on labels without 254)."""
    scaffold = DEEPLAB_SCAFFOLD.replace("labels_for(b, seed=k)", "labels_for(b, seed=k).clamp(max=20) * 0")
    r = _run(tmp_path, "main", DEEPLAB, scaffold, "import main; m, losses, _ = main.train(); print(losses)")
    assert r.returncode == 0, r.stderr


def test_advcam_recipe_runs_in_deeplab_pytorch_shaped_loop(tmp_path):
    (tmp_path / "work").mkdir()
    write_cls_labels(tmp_path / "AdvCAM" / "voc12" / "cls_labels.npy", IDS, str_keys=False)
    program = apply(DEEPLAB, recipe("advcam"))
    r = _run(tmp_path, "main", program, DEEPLAB_SCAFFOLD, textwrap.dedent("""
        import math, torch, main
        m, losses, scope = main.train()
        assert len(losses) == 3 and all(math.isfinite(l) and l > 0 for l in losses), losses
        hook = scope["hook"]
        t, s = list(hook.teacher.parameters()), list(m.parameters())
        assert len(t) == len(s) and any(not torch.equal(a, b) for a, b in zip(t, s))  # an EMA, not a copy
        assert all(p.grad is not None for p in m.parameters())
        print("ok")
    """))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    # the same loop with plain CE on these labels fails, as upstream does (254 >= 21 classes)
    r = _run(tmp_path, "plain", DEEPLAB, DEEPLAB_SCAFFOLD, "import plain; plain.train()")
    assert r.returncode != 0 and ("out of bounds" in r.stderr or "IndexError" in r.stderr), r.stderr[-2000:]


def test_the_old_advcam_recipe_is_caught(tmp_path):
    """Replacing only L157 (the recipe before this fix) leaves `criterion.to(device)`: NameError."""
    write_cls_labels(tmp_path / "AdvCAM" / "voc12" / "cls_labels.npy", IDS, str_keys=False)
    old = [(after, a, (157 if a == 157 else b), tok, new) for after, a, b, tok, new in recipe("advcam")]
    r = _run(tmp_path, "main", apply(DEEPLAB, old, check_tokens=False), DEEPLAB_SCAFFOLD, "import main; main.train()")
    assert r.returncode != 0 and "NameError: name 'criterion' is not defined" in r.stderr, r.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# SEAM + semantic-segmentation-codebase experiment/seamv1-pseudovoc/train.py (a40f6c6)
# --------------------------------------------------------------------------------------------
SEAM = '''
import torch
import torch.nn as nn
from scaffold import cfg, dataloader, generate_net, adjust_lr
from tqdm import tqdm  # L34


def train_net():
\tnet = generate_net()
\tdevice = torch.device("cpu")  # L62: torch.device(0) upstream; the CPU here
\tparameter_source = net
\tnet.to(device)
\toptimizer = torch.optim.SGD(net.parameters(), lr=cfg.TRAIN_LR, momentum=0.9)
\titr = 0
\tcriterion = nn.CrossEntropyLoss(ignore_index=255)  # L85
\tlosses = []
\tfor epoch in range(cfg.TRAIN_EPOCHS):
\t\tfor i_batch, sample in enumerate(dataloader):
\t\t\tnow_lr = adjust_lr(optimizer, itr)
\t\t\toptimizer.zero_grad()
\t\t\tinputs, seg_label = sample['image'], sample['segmentation']
\t\t\tn,c,h,w = inputs.size()
\t\t\tpred1 = net(inputs.to(device))  # L96: .to(0) upstream
\t\t\tloss = criterion(pred1, seg_label.to(device))  # L97
\t\t\tloss.backward()  # L98
\t\t\toptimizer.step()  # L99
\t\t\tlosses.append(loss.item())
\t\t\titr += 1
\treturn net, losses, locals()
'''

SEAM_SCAFFOLD = '''
"""Stand-ins for the codebase's config, dataset and network."""
import types

import torch
import torch.nn as nn

cfg = types.SimpleNamespace(TRAIN_LR=0.01, TRAIN_EPOCHS=2)


def generate_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 21, 1))


def adjust_lr(optimizer, itr):
    return 0.01


def _batches():
    from test_recipes import IDS, labels_for

    ids = sorted(IDS)
    g = torch.Generator().manual_seed(1)
    return [{"image": torch.randn(2, 3, 16, 16, generator=g), "segmentation": labels_for(ids[k : k + 2], seed=k),
             "name": ids[k : k + 2]} for k in range(0, len(ids), 2)]


dataloader = _batches()
'''


def test_seam_recipe_runs_in_the_codebase_shaped_loop(tmp_path):
    write_cls_labels(tmp_path / "SEAM" / "voc12" / "cls_labels.npy", IDS, str_keys=True)
    program = apply(SEAM, recipe("seam"))
    r = _run(tmp_path, "train", program, SEAM_SCAFFOLD, textwrap.dedent("""
        import math, train
        net, losses, scope = train.train_net()
        assert len(losses) == 4 and all(math.isfinite(l) and l > 0 for l in losses), losses
        assert "hook" in scope and "criterion" not in scope
        print("ok")
    """))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_seam_recipe_pasted_with_spaces_is_an_indentation_error(tmp_path):
    """What the docs warn about: the file is tab-indented (TabError is an IndentationError)."""
    program = apply(SEAM, recipe("seam"), indent_with="    ")
    r = _run(tmp_path, "train", program, SEAM_SCAFFOLD, "import train")
    assert r.returncode != 0 and re.search(r"(TabError|IndentationError):", r.stderr), r.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# IRNet / RS+EPM: no segmentation stage upstream; the doc's own loop runs on the adapters' files
# --------------------------------------------------------------------------------------------
def _own_loop_blocks() -> List[str]:
    """The IRNet loop and the RS+EPM lines that replace its three set-up lines."""
    text = DOC.read_text()
    start = text.index("### The training hook in your own loop")
    blocks = re.findall(r"```python\n(.*?)```", text[start:text.index("\n### ", start + 1)], flags=re.S)
    assert len(blocks) == 2
    return blocks


def _jpegs(folder: Path, ids) -> None:
    from PIL import Image

    folder.mkdir(parents=True)
    for i in ids:
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.jpg")


def _run_loop(code: str, ids) -> dict:
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    assert torch.isfinite(scope["loss"]) and set(scope["labels"]) == set(ids)
    assert (scope["labels"][ids[0]] == 254).any()  # the loop handed the stored 254 to the hook
    return scope


def test_own_loop_runs_on_irnet_files(tmp_path, monkeypatch):
    from mars_plugin.adapters import irnet

    ids = sorted(IDS)
    y = labels_for(ids)
    irnet.write_debiased(zip(ids, y.masked_fill(y == 254, -1)), tmp_path / "result" / "sem_seg_mars")
    write_cls_labels(tmp_path / "voc12" / "cls_labels.npy", IDS, str_keys=False)
    _jpegs(tmp_path / "JPEGImages", ids)
    monkeypatch.chdir(tmp_path)
    _run_loop(_own_loop_blocks()[0], ids)


def test_own_loop_runs_on_rsepm_files(tmp_path, monkeypatch):
    from mars_plugin.adapters import rsepm

    ids = sorted(IDS)
    y = labels_for(ids)
    rsepm.write_debiased(zip(ids, y.masked_fill(y == 254, -1)), rsepm.pseudo_label_dir(tmp_path / "experiments", "t@MARS"))
    names = rsepm.class_names("voc")
    (tmp_path / "VOC2012" / "train_aug" / "xml").mkdir(parents=True)
    for i in ids:
        objs = "".join(f"<object><name>{names[c]}</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax>"
                       f"<ymax>9</ymax></bndbox></object>" for c in IDS[i])
        (tmp_path / "VOC2012" / "train_aug" / "xml" / f"{i}.xml").write_text(
            f"<annotation><size><width>16</width><height>16</height></size>{objs}</annotation>")
    _jpegs(tmp_path / "VOC2012" / "train_aug" / "image", ids)
    monkeypatch.chdir(tmp_path)
    loop, setup = _own_loop_blocks()
    setup = setup.replace("<tag>", "t").replace("<root>", "VOC2012")
    lines = loop.split("\n")
    first = next(k for k, l in enumerate(lines) if l.startswith("labels = "))
    assert [l.split(" =")[0] for l in lines[first : first + 3]] == ["labels", "classes", "image_dir"]
    scope = _run_loop("\n".join(lines[:first] + [setup] + lines[first + 3 :]), ids)
    assert all(bool(scope["classes"][i][c - 1]) for i in ids for c in IDS[i])  # the xml tags
