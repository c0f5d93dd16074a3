"""The training-hook recipes of docs/adapters.md run as written inside loops of the upstream shape.

Each recipe block is a list of edits ("L157-158 ..., replace with:", "after L247 ..., add:").
The loops below are written here in the shape of the upstream files the recipes were checked
against (their variable names, their device handling, deeplab-pytorch's multi-scale training
output, the SEAM codebase's tabs); every line an edit names carries a ``# L<n>`` tag with the
upstream line number. The test applies the recipe's lines exactly, indented like the line they
replace, and runs the result on a tiny dataset in the upstream folder layout (the working
directory the upstream script runs from, the WSSS checkout beside it): a recipe that names an
undefined variable, a path that does not resolve from there, or lines indented with spaces in a
tab-indented file, fails here. Each recipe must train with the CRF teacher (the dense CRF runs,
on the images as read, at the labels' size) and save the teacher beside the model: a run killed
between two checkpoints and resumed ends with the teacher of an uninterrupted run.
"""
from __future__ import annotations

import os
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


def rgb_for(i: str, size: int = 16) -> np.ndarray:
    """The (size, size, 3) uint8 RGB image of id ``i`` as a loader reads it (deterministic)."""
    return np.random.default_rng(int(i.replace("_", ""))).integers(0, 256, (size, size, 3), dtype=np.uint8)


# Probes run in the subprocess before the program: every dense CRF call's image shape, and every
# images_rgb the hook was given, so a test sees that the CRF teacher ran on the right images.
PROBE = '''
import mars_plugin.method.complement as _complement
from mars_plugin.adapters.training_hook import MARSTrainingHook as _Hook
CRF_CALLS, RGB_SEEN = [], []
_crf = _complement.dense_crf
def _counting_crf(p, image, *a, **k):
    CRF_CALLS.append(tuple(image.shape))
    return _crf(p, image, *a, **k)
_complement.dense_crf = _counting_crf
_hook_call = _Hook.__call__
def _recording_call(self, *a, **k):
    RGB_SEEN.append(k.get("images_rgb"))
    return _hook_call(self, *a, **k)
_Hook.__call__ = _recording_call
'''


def _run(cwd: Path, files: dict, call: str, env: dict = None) -> subprocess.CompletedProcess:
    """Write ``files`` into ``cwd`` and run ``call`` there in a fresh interpreter (the program's
    working directory is the upstream one, so relative paths resolve as they would upstream)."""
    cwd.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_text(text)
    paths = [str(cwd), str(Path(__file__).parent), str(ROOT)]
    code = f"import sys; sys.path[:0] = {paths!r}\n" + call
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same_state(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif k != "state":  # optimizer internals compared through the tensors above
            assert a[k] == b[k], k


# --------------------------------------------------------------------------------------------
# AdvCAM + deeplab-pytorch main.py (4219467): train(), reduced to the loop's shape
# --------------------------------------------------------------------------------------------
DEEPLAB = '''
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from libs.utils import DenseCRF, PolynomialLR, scores  # L28
from scaffold import CONFIG, DeepLabV2_ResNet101_MSC, get_device, make_loader, makedirs, resize_labels, tqdm


def train(config_path, cuda):  # L106
    device = get_device(cuda)
    loader = make_loader()
    loader_iter = iter(loader)
    model = DeepLabV2_ResNet101_MSC(n_classes=CONFIG.DATASET.N_CLASSES)
    model = nn.DataParallel(model)
    model.to(device)

    # Loss definition
    criterion = nn.CrossEntropyLoss(ignore_index=CONFIG.DATASET.IGNORE_LABEL)  # L157
    criterion.to(device)  # L158

    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.SOLVER.LR, momentum=CONFIG.SOLVER.MOMENTUM)

    # Learning rate scheduler
    scheduler = PolynomialLR(  # L184
        optimizer=optimizer,  # L185
        step_size=CONFIG.SOLVER.LR_DECAY,  # L186
        iter_max=CONFIG.SOLVER.ITER_MAX,  # L187
        power=CONFIG.SOLVER.POLY_POWER,  # L188
    )  # L189

    checkpoint_dir = os.path.join(CONFIG.EXP.OUTPUT_DIR, "models", CONFIG.EXP.ID)
    makedirs(checkpoint_dir)
    model.train()
    model.module.base.freeze_bn()
    losses = []
    for iteration in tqdm(  # L210
        range(1, CONFIG.SOLVER.ITER_MAX + 1),  # L211
        total=CONFIG.SOLVER.ITER_MAX,  # L212
        dynamic_ncols=True,  # L213
    ):  # L214
        optimizer.zero_grad()
        loss = 0
        for _ in range(CONFIG.SOLVER.ITER_SIZE):
            try:
                _, images, labels = next(loader_iter)  # L222
            except StopIteration:
                loader_iter = iter(loader)
                _, images, labels = next(loader_iter)  # L225
            logits = model(images.to(device))  # L228
            iter_loss = 0  # L231
            for logit in logits:  # L232
                # Resize labels for {100%, 75%, 50%, Max} logits  # L233
                _, _, H, W = logit.shape  # L234
                labels_ = resize_labels(labels, size=(H, W))  # L235
                iter_loss += criterion(logit, labels_.to(device))  # L236
            iter_loss /= CONFIG.SOLVER.ITER_SIZE
            iter_loss.backward()
            loss += float(iter_loss)
        losses.append(loss)
        optimizer.step()  # L247
        scheduler.step(epoch=iteration)  # L250
        # Save a model
        if iteration % CONFIG.SOLVER.ITER_SAVE == 0:  # L275
            torch.save(  # L276
                model.module.state_dict(),  # L277
                os.path.join(checkpoint_dir, "checkpoint_{}.pth".format(iteration)),  # L278
            )  # L279

    torch.save(  # L281
        model.module.state_dict(), os.path.join(checkpoint_dir, "checkpoint_final.pth")  # L282
    )  # L283
    return model, losses, locals()
'''

DEEPLAB_SCAFFOLD = '''
"""Stand-ins for what deeplab-pytorch's main.py imports (config, MSC model, loader), in their shapes."""
import os
import types

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# configs/voc12.yaml: the image mean (:20-24) and the solver's shape, tiny
CONFIG = types.SimpleNamespace(
    EXP=types.SimpleNamespace(ID="voc12", OUTPUT_DIR="data"),
    DATASET=types.SimpleNamespace(N_CLASSES=21, IGNORE_LABEL=255),
    IMAGE=types.SimpleNamespace(MEAN=types.SimpleNamespace(R=122.675, G=116.669, B=104.008)),
    SOLVER=types.SimpleNamespace(LR=1e-4, MOMENTUM=0.9, ITER_MAX=3, ITER_SIZE=2, ITER_SAVE=2, LR_DECAY=10,
                                 POLY_POWER=0.9),
)


def tqdm(x, **kw):
    return x


def makedirs(d):
    os.makedirs(d, exist_ok=True)


def get_device(cuda):
    return torch.device("cpu")


class PolynomialLR:
    """libs/utils/lr_scheduler.py: the rate follows the iteration alone. KILL_AT=<n> stands for
    a kill at iteration n, between two checkpoints."""

    def __init__(self, optimizer, step_size, iter_max, power):
        self.optimizer, self.iter_max, self.power = optimizer, iter_max, power
        self.base = [g["lr"] for g in optimizer.param_groups]

    def step(self, epoch):
        if os.environ.get("KILL_AT") == str(epoch):
            raise SystemExit(3)
        for g, b in zip(self.optimizer.param_groups, self.base):
            g["lr"] = b * (1 - epoch / (self.iter_max + 1)) ** self.power


class Base(nn.Module):
    """DeepLab's base in miniature: output stride 4 (DeepLab-v2: 8)."""

    def __init__(self, n_classes):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, n_classes, 3, stride=2, padding=1)

    def freeze_bn(self):
        self.bn.eval()

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


class MSC(nn.Module):
    """libs/models/msc.py at 4219467, its forward verbatim."""

    def __init__(self, base, scales=None):
        super(MSC, self).__init__()
        self.base = base
        if scales:
            self.scales = scales
        else:
            self.scales = [0.5, 0.75]

    def forward(self, x):
        logits = self.base(x)
        _, _, H, W = logits.shape
        interp = lambda l: F.interpolate(l, size=(H, W), mode="bilinear", align_corners=False)
        logits_pyramid = []
        for p in self.scales:
            h = F.interpolate(x, scale_factor=p, mode="bilinear", align_corners=False)
            logits_pyramid.append(self.base(h))
        logits_all = [logits] + [interp(l) for l in logits_pyramid]
        logits_max = torch.max(torch.stack(logits_all), dim=0)[0]
        if self.training:
            return [logits] + logits_pyramid + [logits_max]
        else:
            return logits_max


def DeepLabV2_ResNet101_MSC(n_classes):
    """libs/models/__init__.py:33-39 (scales [0.5, 0.75]); one init in every run."""
    torch.manual_seed(0)
    return MSC(base=Base(n_classes), scales=[0.5, 0.75])


def resize_labels(labels, size):
    return F.interpolate(labels[:, None].float(), size=size, mode="nearest")[:, 0].long()


RGB = {}  # the images as read, uint8 RGB: what the CRF must see


def make_loader():
    """Batches of 2 as libs/datasets/base.py:105-113 yields them: cv2's BGR floats minus the BGR
    mean, channels first (no augmentation: images and labels keep the crop's 16x16)."""
    from test_recipes import IDS, labels_for, rgb_for

    mean_bgr = np.array((CONFIG.IMAGE.MEAN.B, CONFIG.IMAGE.MEAN.G, CONFIG.IMAGE.MEAN.R))
    ids = sorted(IDS)
    batches = []
    for k in range(0, len(ids), 2):
        b = ids[k : k + 2]
        images = []
        for i in b:
            RGB[i] = rgb_for(i)
            image = RGB[i][:, :, ::-1].astype(np.float32)  # cv2.imread: BGR (libs/datasets/voc.py:84)
            image -= mean_bgr
            images.append(image.transpose(2, 0, 1).astype(np.float32))
        batches.append((tuple(b), torch.from_numpy(np.stack(images)), labels_for(b, seed=k)))
    return batches
'''

DEEPLAB_LIBS = {
    "scaffold.py": DEEPLAB_SCAFFOLD,
    "libs/__init__.py": "",
    "libs/utils.py": "from scaffold import PolynomialLR\nDenseCRF = scores = None\n",
}


def _deeplab_tree(base: Path, program: str) -> Path:
    """<base>/deeplab-pytorch (main.py's working directory) beside <base>/AdvCAM."""
    write_cls_labels(base / "AdvCAM" / "voc12" / "cls_labels.npy", IDS, str_keys=False)
    work = base / "deeplab-pytorch"
    _run(work, dict(DEEPLAB_LIBS, **{"main.py": program}), "pass")
    return work


@pytest.mark.slow
def test_deeplab_template_runs_unchanged_on_clean_labels(tmp_path):
    """Control: the loop itself is sound (plain CE on labels without 254)."""
    work = _deeplab_tree(tmp_path, DEEPLAB)
    scaffold = DEEPLAB_SCAFFOLD.replace("labels_for(b, seed=k)", "labels_for(b, seed=k).clamp(max=20) * 0")
    r = _run(work, {"scaffold.py": scaffold}, "import main; m, losses, _ = main.train(None, False); print(losses)")
    assert r.returncode == 0, r.stderr
    # the same loop with plain CE on the debiased labels fails, as upstream does (254 >= 21 classes)
    r = _run(work, {"scaffold.py": DEEPLAB_SCAFFOLD}, "import main; main.train(None, False)")
    assert r.returncode != 0 and ("out of bounds" in r.stderr or "IndexError" in r.stderr), r.stderr[-2000:]


def test_msc_stand_in_returns_upstreams_order():
    """msc.py:45 returns [logits] + logits_pyramid + [logits_max], the pyramid in the order of
    scales [0.5, 0.75] (models/__init__.py:38): sizes 1x, 0.5x, 0.75x, 1x."""
    ns: dict = {}
    exec(DEEPLAB_SCAFFOLD, ns)
    net = ns["DeepLabV2_ResNet101_MSC"](21).train()
    assert [tuple(t.shape[-2:]) for t in net(torch.zeros(1, 3, 32, 32))] == [(8, 8), (4, 4), (6, 6), (8, 8)]


def test_msc_output_order_is_written_as_upstream_returns_it():
    """docs/adapters.md, the AdvCAM adapter and the hook once gave [1x, 0.75x, 0.5x, max]."""
    wrong = re.compile(r"1x,\s*0\.75x,\s*0\.5x")
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "adapters").rglob("*.py")),
             *sorted((ROOT / "mars_plugin").rglob("*.py"))]
    hits = [f"{f.relative_to(ROOT)}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
            if wrong.search(line)]
    assert hits == []
    for f in (DOC, ROOT / "adapters" / "wsss" / "advcam.py", ROOT / "adapters" / "training_hook.py"):
        assert re.search(r"1x,\s*0\.5x,\s*0\.75x", f.read_text()), f


ADVCAM_CHECKS = '''
import math, torch, main, scaffold
m, losses, scope = main.train(None, False)
hook = scope["hook"]
assert hook.refine == "crf" and hook.match == "logits", (hook.refine, hook.match)
assert len(losses) == {n} and all(math.isfinite(l) and l > 0 for l in losses), losses
# the CRF ran once per batch, at the labels' size, on the images as read (RGB uint8)
assert CRF_CALLS == [(2, 16, 16, 3)] * (2 * {n}), CRF_CALLS
ids = sorted(scaffold.RGB)
for k, rgb in enumerate(RGB_SEEN):
    want = torch.from_numpy(__import__("numpy").stack([scaffold.RGB[i] for i in ids[2 * (k % 2): 2 * (k % 2) + 2]]))
    assert rgb.dtype == torch.uint8 and torch.equal(rgb, want), k
t, s = list(hook.teacher.parameters()), list(m.parameters())
assert len(t) == len(s) and any(not torch.equal(a, b) for a, b in zip(t, s))  # an EMA, not a copy
print("ok")
'''


@pytest.fixture(scope="module")
def advcam_uninterrupted(tmp_path_factory):
    """The recipe applied to main.py, run for all of its 3 iterations."""
    work = _deeplab_tree(tmp_path_factory.mktemp("advcam"), apply(DEEPLAB, recipe("advcam")))
    r = _run(work, {}, PROBE + ADVCAM_CHECKS.format(n=3))
    return work, r


@pytest.mark.slow
def test_advcam_recipe_trains_with_the_crf_teacher(advcam_uninterrupted):
    work, r = advcam_uninterrupted
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    models = work / "data" / "models" / "voc12"
    for name in ("checkpoint_2", "checkpoint_final"):
        state = torch.load(models / f"{name}_mars.pth", weights_only=True)  # the teacher beside the model
        assert set(state) == {"hook", "optimizer", "iteration"} and (models / f"{name}.pth").is_file()
        model = torch.load(models / f"{name}.pth", weights_only=True)  # model.module's, the teacher DataParallel's
        assert set(state["hook"]["teacher"]) == {"module." + k for k in model}


@pytest.mark.slow
def test_advcam_recipe_resumed_gives_the_uninterrupted_teacher(advcam_uninterrupted, tmp_path):
    """Killed at iteration 3 (after checkpoint 2), resumed with MARS_RESUME=checkpoint_2.pth: the same
    final teacher, student and optimizer as the uninterrupted run, bit for bit."""
    ref, r = advcam_uninterrupted
    assert r.returncode == 0, r.stderr[-3000:]
    work = _deeplab_tree(tmp_path, apply(DEEPLAB, recipe("advcam")))
    r = _run(work, {}, "import main; main.train(None, False)", env={"KILL_AT": "3"})
    models = work / "data" / "models" / "voc12"
    assert r.returncode == 3 and (models / "checkpoint_2_mars.pth").is_file(), r.stderr[-3000:]
    assert not (models / "checkpoint_final.pth").exists()
    r = _run(work, {}, PROBE + ADVCAM_CHECKS.format(n=1), env={"MARS_RESUME": "data/models/voc12/checkpoint_2.pth"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    for name in ("checkpoint_final.pth", "checkpoint_final_mars.pth"):
        _same_state(torch.load(models / name, weights_only=True),
                    torch.load(ref / "data" / "models" / "voc12" / name, weights_only=True))


@pytest.mark.slow
def test_advcam_recipe_without_match_logits_says_what_to_pass(tmp_path):
    """The fault the recipe avoids: refine="crf" with match="labels" on MSC's stride-4 outputs
    stops before the teacher runs, and the error names match='logits'."""
    edits = [(after, a, b, tok, [l.replace(', match="logits"', "") for l in new])
             for after, a, b, tok, new in recipe("advcam")]
    work = _deeplab_tree(tmp_path, apply(DEEPLAB, edits))
    r = _run(work, {}, "import main; main.train(None, False)")
    assert r.returncode != 0 and "match='logits'" in r.stderr.splitlines()[-1], r.stderr[-2000:]


@pytest.mark.slow
def test_the_old_advcam_recipe_is_caught(tmp_path):
    """Replacing only L157 (the recipe before this fix) leaves `criterion.to(device)`: NameError."""
    old = [(after, a, (157 if a == 157 else b), tok, new) for after, a, b, tok, new in recipe("advcam")]
    work = _deeplab_tree(tmp_path, apply(DEEPLAB, old, check_tokens=False))
    r = _run(work, {}, "import main; main.train(None, False)")
    assert r.returncode != 0 and "NameError: name 'criterion' is not defined" in r.stderr, r.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# SEAM + semantic-segmentation-codebase experiment/seamv1-pseudovoc/train.py (a40f6c6)
# --------------------------------------------------------------------------------------------
# (a backslash at the end of a line below joins it with the next: the program's line is upstream's)
SEAM = '''
import torch
import numpy as np
import random
torch.manual_seed(1) # cpu
import torch.nn as nn
import os
import time
from scaffold import DataLoader, cfg, generate_dataset, generate_net
from tqdm import tqdm  # L34


def train_net():
\tperiod = 'train'
\ttransform = 'weak'
\tdataset = generate_dataset(cfg, period=period, transform=transform)
\tdataloader = DataLoader(dataset, batch_size=cfg.TRAIN_BATCHES)
\tnet = generate_net(cfg, batchnorm=nn.BatchNorm2d)
\tif cfg.TRAIN_CKPT:  # L53
\t\tnet.load_state_dict(torch.load(cfg.TRAIN_CKPT),strict=True)  # L54
\t\tprint('load pretrained model')  # L55
\tdevice = torch.device('cpu')  # L62, torch.device(0) upstream: the CPU here
\tparameter_source = net  # L68
\tnet.to(device)  # L69
\toptimizer = torch.optim.SGD(net.parameters(), lr=cfg.TRAIN_LR, momentum=cfg.TRAIN_MOMENTUM,\
 weight_decay=cfg.TRAIN_WEIGHT_DECAY)
\titr = cfg.TRAIN_MINEPOCH * len(dataset)//(cfg.TRAIN_BATCHES)  # L81
\tmax_itr = cfg.TRAIN_ITERATION  # L82
\tmax_epoch = max_itr*(cfg.TRAIN_BATCHES)//len(dataset)+1  # L83
\tcriterion = nn.CrossEntropyLoss(ignore_index=255)  # L85
\tlosses = []
\tfor epoch in range(cfg.TRAIN_MINEPOCH, max_epoch):  # L87
\t\tfor i_batch, sample in enumerate(dataloader):  # L88
\t\t\tnow_lr = adjust_lr(optimizer, itr, max_itr, cfg.TRAIN_LR, cfg.TRAIN_POWER)  # L90
\t\t\toptimizer.zero_grad()  # L91
\t\t\tinputs, seg_label = sample['image'], sample['segmentation']  # L93
\t\t\tn,c,h,w = inputs.size()  # L94
\t\t\tpred1 = net(inputs.to(device))  # L96, .to(0) upstream
\t\t\tloss = criterion(pred1, seg_label.to(device))  # L97
\t\t\tloss.backward()  # L98
\t\t\toptimizer.step()  # L99
\t\t\tlosses.append(loss.item())
\t\t\titr += 1  # L121
\t\t\tif itr>=max_itr:  # L122
\t\t\t\tbreak  # L123
\t\tsave_path = os.path.join(cfg.MODEL_SAVE_DIR,\
'%s_%s_%s_epoch%d.pth'%(cfg.MODEL_NAME,cfg.MODEL_BACKBONE,cfg.DATA_NAME,epoch))  # L124
\t\ttorch.save(parameter_source.state_dict(), save_path)  # L125
\t\tprint('%s has been saved'%save_path)  # L126
\t\tremove_path = os.path.join(cfg.MODEL_SAVE_DIR,\
'%s_%s_%s_epoch%d.pth'%(cfg.MODEL_NAME,cfg.MODEL_BACKBONE,cfg.DATA_NAME,epoch-1))  # L127
\t\tif os.path.exists(remove_path):  # L128
\t\t\tos.remove(remove_path)  # L129
\tsave_path = os.path.join(cfg.MODEL_SAVE_DIR,\
'%s_%s_%s_itr%d_all.pth'%(cfg.MODEL_NAME,cfg.MODEL_BACKBONE,cfg.DATA_NAME,cfg.TRAIN_ITERATION))  # L131
\ttorch.save(parameter_source.state_dict(),save_path)  # L132
\treturn net, losses, locals()


def adjust_lr(optimizer, itr, max_itr, lr_init, power):  # L138
\tif os.environ.get('KILL_AT') == str(itr):  # the test's kill, between two checkpoints
\t\traise SystemExit(3)
\tnow_lr = lr_init * (1 - itr/(max_itr+1)) ** power
\tfor g in optimizer.param_groups:
\t\tg['lr'] = now_lr
\treturn now_lr
'''

SEAM_SCAFFOLD = '''
"""Stand-ins for the codebase's config, dataset and network, in their shapes."""
import os
import types

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT_DIR = os.path.abspath(os.path.join(os.path.dirname("__file__"), "..", ".."))  # config.py:52, from the cwd
cfg = types.SimpleNamespace(
    DATA_MEAN=[0.485, 0.456, 0.406], DATA_STD=[0.229, 0.224, 0.225],  # config.py:19-20
    TRAIN_LR=0.01, TRAIN_MOMENTUM=0.9, TRAIN_WEIGHT_DECAY=0.0005, TRAIN_POWER=0.9, TRAIN_BATCHES=2,
    TRAIN_MINEPOCH=int(os.environ.get("TRAIN_MINEPOCH", "0")), TRAIN_ITERATION=5,
    TRAIN_CKPT=os.environ.get("TRAIN_CKPT") or None,
    MODEL_NAME="deeplabv1", MODEL_BACKBONE="resnet38", DATA_NAME="VOCDataset",
    MODEL_SAVE_DIR=os.path.join(ROOT_DIR, "model", "seamv1-pseudovoc"),  # config.py:53
)
os.makedirs(cfg.MODEL_SAVE_DIR, exist_ok=True)


class Net(nn.Module):
    """deeplabv1's output contract (lib/net/deeplabv1.py:53): logits at the input's size."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.cls_conv = nn.Conv2d(8, 21, 1)

    def forward(self, x):
        n, c, h, w = x.size()
        result = self.cls_conv(torch.relu(self.bn(self.conv(x))))
        return F.interpolate(result, (h, w), mode="bilinear", align_corners=True)


def generate_net(cfg, batchnorm):
    return Net()


RGB = {}  # the images as read, uint8 RGB: what the CRF must see


def generate_dataset(cfg, period, transform):
    """Samples as BaseDataset.__getitem__ gives them: RGB (VOCDataset.py:64-65), (x / 255 - mean)
    / std (transform.py:151-168), channels first (:190-196); labels as read (254 kept)."""
    from test_recipes import IDS, labels_for, rgb_for

    samples = []
    for k, i in enumerate(sorted(IDS)):
        RGB[i] = rgb_for(i)
        image = RGB[i].astype(np.float32)
        for ch in range(3):
            image[..., ch] = (image[..., ch] / 255 - cfg.DATA_MEAN[ch]) / cfg.DATA_STD[ch]
        samples.append({"image": torch.from_numpy(image.transpose(2, 0, 1)),
                        "segmentation": labels_for([i], seed=k)[0], "name": i})
    return samples


class DataLoader:
    """Batches of the samples in order (upstream shuffles with its seeded generator)."""

    def __init__(self, dataset, batch_size):
        self.dataset, self.batch_size = dataset, batch_size

    def __iter__(self):
        for k in range(0, len(self.dataset) - self.batch_size + 1, self.batch_size):
            b = self.dataset[k : k + self.batch_size]
            yield {"image": torch.stack([s["image"] for s in b]),
                   "segmentation": torch.stack([s["segmentation"] for s in b]), "name": [s["name"] for s in b]}
'''

SEAM_EXPERIMENT = Path("semantic-segmentation-codebase") / "experiment" / "seamv1-pseudovoc"


def _seam_tree(base: Path, program: str) -> Path:
    """<base>/SEAM beside <base>/semantic-segmentation-codebase; train.py's working directory is
    experiment/seamv1-pseudovoc, where the codebase runs it (its README: ``python train.py``)."""
    write_cls_labels(base / "SEAM" / "voc12" / "cls_labels.npy", IDS, str_keys=True)
    work = base / SEAM_EXPERIMENT
    _run(work, {"train.py": program, "scaffold.py": SEAM_SCAFFOLD}, "pass")
    return work


SEAM_CHECKS = '''
import math, torch, train, scaffold
net, losses, scope = train.train_net()
hook = scope["hook"]
assert hook.refine == "crf" and "criterion" not in scope
assert len(losses) == {n} and all(math.isfinite(l) and l > 0 for l in losses), losses
assert CRF_CALLS == [(2, 16, 16, 3)] * {n}, CRF_CALLS
ids = sorted(scaffold.RGB)
for k, rgb in enumerate(RGB_SEEN):
    want = torch.from_numpy(__import__("numpy").stack([scaffold.RGB[i] for i in ids[2 * (k % 2): 2 * (k % 2) + 2]]))
    assert rgb.dtype == torch.uint8 and torch.equal(rgb, want), k
print("ok")
'''


@pytest.fixture(scope="module")
def seam_uninterrupted(tmp_path_factory):
    work = _seam_tree(tmp_path_factory.mktemp("seam"), apply(SEAM, recipe("seam")))
    return work, _run(work, {}, PROBE + SEAM_CHECKS.format(n=5))


@pytest.mark.slow
def test_seam_recipe_runs_from_the_experiment_folder_with_the_crf_teacher(seam_uninterrupted):
    work, r = seam_uninterrupted
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    saved = sorted(p.name for p in (work / ".." / ".." / "model" / "seamv1-pseudovoc").iterdir())
    # the last epoch's model and teacher (older epochs removed with theirs), and the final pair
    assert saved == ["deeplabv1_resnet38_VOCDataset_epoch2.pth", "deeplabv1_resnet38_VOCDataset_epoch2_mars.pth",
                     "deeplabv1_resnet38_VOCDataset_itr5_all.pth", "deeplabv1_resnet38_VOCDataset_itr5_all_mars.pth"]


@pytest.mark.slow
def test_seam_recipe_resumed_gives_the_uninterrupted_teacher(seam_uninterrupted, tmp_path):
    """Killed at itr 3 (epoch 1; epoch 0 saved), resumed with TRAIN_CKPT = epoch 0's file and
    TRAIN_MINEPOCH = 1, the codebase's own resume: the same final teacher and student."""
    ref, r = seam_uninterrupted
    assert r.returncode == 0, r.stderr[-3000:]
    work = _seam_tree(tmp_path, apply(SEAM, recipe("seam")))
    models = work / ".." / ".." / "model" / "seamv1-pseudovoc"
    r = _run(work, {}, "import train; train.train_net()", env={"KILL_AT": "3"})
    assert r.returncode == 3 and not (models / "deeplabv1_resnet38_VOCDataset_itr5_all.pth").exists(), r.stderr
    ckpt = str(models / "deeplabv1_resnet38_VOCDataset_epoch0.pth")
    r = _run(work, {}, PROBE + SEAM_CHECKS.format(n=3), env={"TRAIN_CKPT": ckpt, "TRAIN_MINEPOCH": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    ref_models = ref / ".." / ".." / "model" / "seamv1-pseudovoc"
    for name in ("deeplabv1_resnet38_VOCDataset_itr5_all.pth", "deeplabv1_resnet38_VOCDataset_itr5_all_mars.pth"):
        _same_state(torch.load(models / name, weights_only=True), torch.load(ref_models / name, weights_only=True))


@pytest.mark.slow
def test_seam_old_path_does_not_resolve_from_the_experiment_folder(tmp_path):
    """The recipe's old "../SEAM/..." is <codebase>/experiment/SEAM from train.py's folder."""
    old = [(after, a, b, tok, [l.replace("../../../SEAM/", "../SEAM/") for l in new])
           for after, a, b, tok, new in recipe("seam")]
    assert old != recipe("seam")
    work = _seam_tree(tmp_path, apply(SEAM, old))
    r = _run(work, {}, "import train; train.train_net()")
    assert r.returncode != 0 and "../SEAM/voc12/cls_labels.npy: cannot read" in r.stderr, r.stderr[-2000:]
    assert (work / ".." / "SEAM").resolve() == (tmp_path / "semantic-segmentation-codebase" / "experiment" / "SEAM")


def test_seam_recipe_pasted_with_spaces_is_an_indentation_error(tmp_path):
    """What the docs warn about: the file is tab-indented (TabError is an IndentationError)."""
    program = apply(SEAM, recipe("seam"), indent_with="    ")
    r = _run(tmp_path / SEAM_EXPERIMENT, {"train.py": program, "scaffold.py": SEAM_SCAFFOLD}, "import train")
    assert r.returncode != 0 and re.search(r"(TabError|IndentationError):", r.stderr), r.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# IRNet / RS+EPM: no segmentation stage upstream; the doc's own code runs on the adapters' files
# --------------------------------------------------------------------------------------------
def _irnet_debias_block() -> str:
    text = DOC.read_text()
    start = text.index("- **IRNet** (")
    blocks = re.findall(r"```python\n(.*?)```", text[start:text.index("### ", start)], flags=re.S)
    assert len(blocks) == 1
    return textwrap.dedent(blocks[0])


def test_irnet_debias_snippet_runs_in_a_fresh_namespace(tmp_path, monkeypatch):
    """Executed as written, with only the reader functions it says are yours (feat, rgb)."""
    from PIL import Image

    from mars_plugin.adapters.wsss import irnet
    ids = sorted(IDS)
    (tmp_path / "result" / "sem_seg").mkdir(parents=True)
    for k, i in enumerate(ids):
        y = labels_for([i], seed=k)[0]
        y[y == 254] = 0  # pseudo labels: no biased pixel yet
        Image.fromarray(y.numpy().astype(np.uint8), mode="L").save(tmp_path / "result" / "sem_seg" / f"{i}.png")
    write_cls_labels(tmp_path / "voc12" / "cls_labels.npy", IDS, str_keys=False)
    rng = np.random.default_rng(0)
    feats = {i: torch.from_numpy(rng.standard_normal((8, 8, 8)).astype(np.float32)) for i in ids}
    monkeypatch.chdir(tmp_path)
    scope = {"feat": feats.__getitem__, "rgb": lambda i: rgb_for(i)}
    exec(compile(_irnet_debias_block(), str(DOC), "exec"), scope)
    out = dict(irnet.load_pseudo_labels("result/sem_seg_mars"))
    assert sorted(out) == ids and all(tuple(y.shape) == (16, 16) for y in out.values())


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
        Image.fromarray(rgb_for(i)).save(folder / f"{i}.png", format="PNG")
        (folder / f"{i}.png").rename(folder / f"{i}.jpg")  # lossless, so the CRF's image is known exactly


def _run_loop(code: str, ids, monkeypatch) -> dict:
    """Run the loop as written; the CRF must run on each step's image as read."""
    import mars_plugin.method.complement as complement_module

    seen = []
    real = complement_module.dense_crf

    def probe(p, image, *a, **k):
        seen.append(image.clone())
        return real(p, image, *a, **k)

    monkeypatch.setattr(complement_module, "dense_crf", probe)
    torch.manual_seed(0)  # the toy network's init, the same in every run
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    assert torch.isfinite(scope["loss"]) and set(scope["labels"]) == set(ids)
    assert (scope["labels"][ids[0]] == 254).any()  # the loop handed the stored 254 to the hook
    assert scope["hook"].refine == "crf" and len(seen) == scope["iterations"] - scope.get("_start", 0)
    for k, img in enumerate(seen):
        assert img.dtype == torch.uint8 and torch.equal(img[0], torch.from_numpy(rgb_for(sorted(ids)[k % len(ids)])))
    return scope


def _irnet_files(tmp_path: Path):
    from mars_plugin.adapters.wsss import irnet
    ids = sorted(IDS)
    y = labels_for(ids)
    irnet.write_debiased(zip(ids, y.masked_fill(y == 254, -1)), tmp_path / "result" / "sem_seg_mars")
    write_cls_labels(tmp_path / "voc12" / "cls_labels.npy", IDS, str_keys=False)
    _jpegs(tmp_path / "JPEGImages", ids)
    return ids


def test_own_loop_runs_on_irnet_files_with_the_crf_teacher(tmp_path, monkeypatch):
    ids = _irnet_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    scope = _run_loop(_own_loop_blocks()[0], ids, monkeypatch)
    state = torch.load("mars_checkpoint.pth", weights_only=True)
    assert state["step"] == scope["iterations"] and set(state) == {"model", "optimizer", "hook", "step"}


def test_own_loop_killed_and_rerun_gives_the_uninterrupted_teacher(tmp_path, monkeypatch):
    """A kill in step 3 (the checkpoint holds step 2), then the same script again: the same
    teacher, student and optimizer as one uninterrupted run."""
    from mars_plugin.adapters.training_hook import MARSTrainingHook

    loop = _own_loop_blocks()[0]
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "kill"
    for d in (ref_dir, kill_dir):
        d.mkdir()
        monkeypatch.chdir(d)
        ids = _irnet_files(d)
    monkeypatch.chdir(ref_dir)
    _run_loop(loop, ids, monkeypatch)
    ref = torch.load("mars_checkpoint.pth", weights_only=True)

    monkeypatch.chdir(kill_dir)
    real_update, calls = MARSTrainingHook.update, []

    def killed(self, model):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # step 3 never finishes; the checkpoint holds step 2
        real_update(self, model)

    monkeypatch.setattr(MARSTrainingHook, "update", killed)
    torch.manual_seed(0)  # the init of the reference run
    with pytest.raises(KeyboardInterrupt):
        exec(compile(loop, str(DOC), "exec"), {})
    assert torch.load("mars_checkpoint.pth", weights_only=True)["step"] == 2
    monkeypatch.setattr(MARSTrainingHook, "update", real_update)
    torch.manual_seed(1)  # another init: the resumed run must take everything from the checkpoint
    scope: dict = {}
    exec(compile(loop, str(DOC), "exec"), scope)
    assert scope["step"] == scope["iterations"]
    _same_state(torch.load("mars_checkpoint.pth", weights_only=True), ref)


def test_own_loop_runs_on_rsepm_files(tmp_path, monkeypatch):
    from mars_plugin.adapters.wsss import rsepm
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
    scope = _run_loop("\n".join(lines[:first] + [setup] + lines[first + 3 :]), ids, monkeypatch)
    assert all(bool(scope["classes"][i][c - 1]) for i in ids for c in IDS[i])  # the xml tags
