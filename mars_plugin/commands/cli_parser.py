"""The ``mars`` command line's parser: every command and its flags (:func:`build_parser`).

Every flag states its default in ``--help``; numeric flags are parsed and bounded by
:mod:`mars_plugin.commands.cli_types`. :mod:`mars_plugin.cli` parses with it and dispatches.
"""
from __future__ import annotations

import argparse
import json

from mars_plugin.commands import cli_types as T
from mars_plugin.commands.label_formats import WSSS_ADAPTERS
from mars_plugin.commands.cli_types import add_io_workers_argument
from mars_plugin.method.centroids import BACKENDS
from mars_plugin.engines.crf_params import CRF_BACKENDS


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in ``--help``, except where it says nothing: a required flag ends
    with "(required)", and a None default (the help text says what leaving the flag out does)
    is not shown as "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required and action.option_strings:
            return text + " (required)"
        if action.default is None:
            return text
        return super()._get_help_string(action)


def add_threads(p: argparse.ArgumentParser) -> None:
    """``--threads N``, taken by every command (see :func:`apply_threads`)."""
    p.add_argument("--threads", type=T.threads, default=None, metavar="N",
                   help="CPU threads of torch (torch.set_num_threads), of numba's kernels and of the compiled "
                        "CRF; default: leave them as they are (one per core). Idle threads sleep (the mars "
                        "command sets OMP_WAIT_POLICY=PASSIVE), so the default suits a shared machine too; fewer "
                        "leave cores to other work")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="a bad or missing input file: stop at the first with one line naming it (exit 2), or "
                        "skip it, go on, list every skipped file on stderr at the end and exit 1")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--ignore-index", type=T.ignore_index, default=255, help="label value of ignored pixels")


def _add_selection(p: argparse.ArgumentParser) -> None:
    """The hyperparameters of Eq. 1-3 (``mars centroids``, ``mars reproduce``)."""
    p.add_argument("--alpha", type=T.alpha, default=0.4, help="share of candidates averaged per class (Eq. 2)")
    p.add_argument("--k-fg", type=T.k_clusters, default=2, help="K-means clusters per foreground class")
    p.add_argument("--k-bg", type=T.k_clusters, default=2, help="K-means clusters for the background")
    p.add_argument("--seed", type=T.seed, default=0, help="K-means seed")


def _add_wsss(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wsss", choices=WSSS_ADAPTERS, default=None,
                   help="read/write that WSSS repository's formats through mars_plugin.adapters "
                        "(skips IRNet/AdvCAM _palette.png siblings, reads its image-label file, writes its PNG mode)")
    p.add_argument("--dataset", choices=("voc", "coco"), default="voc", help="class set for --wsss rsepm tags")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling the image-label file (IRNet/AdvCAM/SEAM cls_labels.npy are pickles: "
                        "only for files you trust)")


def _crf_params(text: str):
    """--crf-params: a preset name or a JSON object of overrides (checked by the job)."""
    text = text.strip()
    if not text.startswith("{"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a preset name or a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a preset name or a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mars",
        description="MARS: model-agnostic biased object removal for weakly-supervised semantic segmentation.",
        formatter_class=_Formatter,
    )
    from mars_plugin import __version__

    ap.add_argument("--version", action="version", version=f"mars {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("demo", formatter_class=_Formatter,
                       help="run the whole method on the built-in biased world and show what it removed",
                       description="Generate the built-in biased world, select centroids, debias (CRF), train a small "
                                   "segmentation network with plain CE and with MARS, and compare them on held-out images.")
    d.add_argument("--out", default="mars_demo", help="output folder (tables, pictures, metrics.json, the world on disk)")
    d.add_argument("--seed", type=T.seed, default=0, help="seed of the world, the clustering and the training")
    d.add_argument("--num-train", type=T.demo_images, default=240, help="training images")
    d.add_argument("--num-val", type=T.demo_images, default=80, help="held-out images")
    d.add_argument("--size", type=T.demo_size, default=64, help="image side in pixels")
    d.add_argument("--epochs", type=T.demo_epochs, default=20, help="training epochs of each segmentation network")
    d.add_argument("--refine", choices=("crf", "threshold"), default="crf", help="refinement of the debiased mask")
    d.add_argument("--crf-params", type=_crf_params, default="mars", help="dense-CRF preset or JSON dict (see debias)")
    d.add_argument("--no-world", action="store_true", help="do not write the world's folders under --out/world")
    add_threads(d)

    sm = sub.add_parser("sample", formatter_class=_Formatter,
                        help="write a small sample tree in a WSSS codebase's layout, with random-weight models, to "
                             "try every command offline",
                        description="Write the built-in synthetic world (VOC class ids) as a small tree in the "
                                    "layout of DHR (its --root: VOC2012/train_aug/{image,mask,xml}, WSS/...; dhr-coco: "
                                    "its COCO2014/train tree, COCO ids, for reproduce --data COCO2014), IRNet, "
                                    "AdvCAM, SEAM or RS+EPM, with random-weight model files in weights/ (a tiny STEGO "
                                    "as DHR's two files and as a .ckpt, a tiny DINOv2 with DHR's CAUSE heads) and CAMs in "
                                    "the codebase's own files, and print the commands to try on it (features, "
                                    "centroids, debias, evaluate, report, crf, reproduce). A few seconds, a few MB.")
    from mars_plugin.commands.sample_trees import TREES

    sm.add_argument("--tree", choices=TREES, required=True, help="whose layout")
    sm.add_argument("--out", required=True, help="a new (or empty) folder for the tree")
    sm.add_argument("--num-images", type=T.demo_images, default=8, help="images in the tree")
    sm.add_argument("--size", type=T.demo_size, default=64, help="image side in pixels (16..256, a multiple of 4)")
    sm.add_argument("--seed", type=T.seed, default=0, help="seed of the world and of the random weights")
    add_threads(sm)

    c = sub.add_parser("centroids", formatter_class=_Formatter, help="select debiased centroids (Eq. 1-3) from folders",
                       description="Stream (features, pseudo label) pairs and write the debiased centroids to a .pt file.")
    c.add_argument("--features", required=True, help="folder of float (D, h, w) embeddings, <stem>.npy or <stem>.pt "
                                                      "(DHR's fp16 tensors, read with weights_only=True)")
    c.add_argument("--labels", required=True, help="folder of <stem>.png pseudo labels (0 = background, 255 = ignore)")
    c.add_argument("--image-labels", default=None, help="JSON {stem: [1-based class ids]}; default: classes of each label")
    c.add_argument("--num-classes", type=T.num_classes, required=True, help="C, the number of foreground classes")
    c.add_argument("--out", required=True, help="output .pt file")
    _add_selection(c)
    c.add_argument("--batch-size", type=T.batch_size, default=64,
                   help="images clustered per batched K-means call (512 suits a GPU)")
    c.add_argument("--device", default="cpu",
                   help="where the K-means runs: cpu, cuda, cuda:1, or auto (this rank's GPU if any)")
    c.add_argument("--spill-dir", default=None,
                   help="existing folder: candidate centroids beyond --spill-mb go to a temporary folder in it")
    c.add_argument("--spill-mb", type=T.spill_mb, default=1024, help="MB of candidate centroids held in memory")
    c.add_argument("--backend", choices=list(BACKENDS), default="auto",
                   help="K-means implementation: compiled (numba, CPU), torch (any device), or auto "
                        "(compiled on the CPU when numba is installed)")
    c.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json, for the printed "
                        "summary (default with --wsss: that codebase's class names)")
    _add_wsss(c)
    _add_common(c)
    add_threads(c)

    b = sub.add_parser("debias", formatter_class=_Formatter, help="write debiased labels (Eq. 4-5) for a folder",
                       description="One P-mode PNG (VOC palette) per pseudo label; biased pixels are written as 254, "
                                   "ignore stays 255. Existing outputs are skipped, so an interrupted run resumes.")
    b.add_argument("--features", required=True, help="folder of <stem>.npy or <stem>.pt embeddings")
    b.add_argument("--labels", required=True, help="folder of <stem>.png pseudo labels")
    b.add_argument("--centroids", required=True, help=".pt file written by 'mars centroids'")
    b.add_argument("--images", default=None, help="folder of RGB images <stem>.jpg/.png (needed by --refine crf)")
    b.add_argument("--out", required=True, help="output folder")
    b.add_argument("--refine", choices=("crf", "threshold"), default="crf", help="dense CRF or a plain threshold")
    b.add_argument("--threshold", type=T.threshold, default=0.5, help="similarity threshold of --refine threshold")
    b.add_argument("--image-labels", default=None, help="JSON {stem: [class ids]}; default: classes of each label")
    b.add_argument("--crf-params", type=_crf_params, default="mars",
                   help="dense-CRF parameters: a preset, mars (= deeplab: the MARS authors' RS+EPM/DHR/STEGO setting, "
                        "Gaussian sxy 1 compat 3, bilateral sxy 67 srgb 3 compat 4) or psa (= seam: 3/3, 80/13/10), "
                        "or a JSON dict of overrides of mars, e.g. '{\"iterations\": 5}'")
    b.add_argument("--crf-backend", choices=CRF_BACKENDS, default="torch",
                   help="torch (batched, on --device) or pydensecrf (the reference, CPU, one image at a time; "
                        "needs the crf extra)")
    b.add_argument("--device", default="cpu", help="where Eq. 4 and the CRF run: cpu, cuda, cuda:1, or auto")
    b.add_argument("--batch-size", type=T.batch_size, default=8, help="images per CRF call (64 suits a GPU)")
    b.add_argument("--max-memory", type=T.max_memory, default=None, metavar="GIB",
                   help="the CRF's memory budget in GiB per worker: an image whose CRF needs more is refused by name "
                        "(default: 6, the CRF's own)" + "%(default).0s")
    b.add_argument("--workers", type=T.workers, default=1,
                   help="processes, each with one thread (on a CPU with free cores: one per core)")
    add_io_workers_argument(b)
    b.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json, for the printed "
                        "per-class summary (default with --wsss: that codebase's class names)")
    _add_wsss(b)
    _add_common(b)
    add_threads(b)

    e = sub.add_parser("evaluate", formatter_class=_Formatter, help="IoU, FP, FN per class (SEAM's formulas)",
                       description="Confusion matrix over the whole set on pixels where gt < 255; "
                                   "FP = (P-TP)/(T+P-TP), FN = (T-TP)/(T+P-TP); mIoU over classes present. "
                                   "Predicted 254 (biased) counts as background.")
    e.add_argument("--pred", required=True, help="folder of predicted label PNGs")
    e.add_argument("--gt", required=True, help="folder of ground-truth label PNGs")
    e.add_argument("--num-classes", type=T.num_classes, required=True, help="C, the number of foreground classes")
    e.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json; default: "
                        "--wsss's names, else a classes.json beside --gt or DHR's <data>.json above it, else "
                        "'class c'")
    e.add_argument("--wsss", choices=WSSS_ADAPTERS, default=None,
                   help="name the classes as that WSSS codebase does (dhr: the dataset json above --gt, else VOC's)")
    e.add_argument("--dataset", choices=("voc", "coco"), default="voc", help="class set for --wsss rsepm")
    e.add_argument("--json", default=None, help="also write the scores to this JSON file")
    _add_common(e)
    add_threads(e)

    from mars_plugin.adapters.uss.extractor import uss_names_text
    from mars_plugin.adapters.uss.multiscale import DHR_SCALES
    from mars_plugin.commands.features import _OWN_DEFAULT, scales_argument, add_features_arguments
    from mars_plugin.commands.reproduce import USS_CHOICES

    f = sub.add_parser("features", formatter_class=_Formatter,
                       help=f"USS embeddings ({uss_names_text()}) for a folder of images",
                       description="Write one float16 (D, h, w) <stem>.npy (or <stem>.pt with --format pt) per image "
                                   f"with a {uss_names_text()} model read from disk (nothing is downloaded); "
                                   "resumable, atomic writes.")
    add_features_arguments(f)
    add_threads(f)

    r = sub.add_parser("report", formatter_class=_Formatter, help="which classes were biased: chart and overlays",
                       description="Per-class share of pseudo-label pixels marked biased, ranked, as a bar chart, and a grid "
                                   "of overlays of the most-changed images (the paper's Fig. 1(d), automatically).")
    r.add_argument("--labels", required=True, help="folder of pseudo label PNGs")
    r.add_argument("--debiased", required=True, help="folder of debiased label PNGs (from 'mars debias')")
    r.add_argument("--images", required=True, help="folder of RGB images")
    r.add_argument("--out", required=True, help="output folder")
    r.add_argument("--class-names", default=None,
                   help="JSON list of names (background first), classes.json or DHR's <data>.json")
    r.add_argument("--num-examples", type=T.num_examples, default=8, help="most-changed images shown")
    r.add_argument("--per-class", type=T.per_class, default=2,
                   help="for each class, its N images with the largest share of that class's pixels removed "
                        "(per_class.png; 0: none)")
    _add_common(r)
    add_threads(r)
    p = sub.add_parser("reproduce", formatter_class=_Formatter,
                       help="the paper's setting end to end on DHR's folder tree (VOC2012, COCO2014), with the "
                            "paper's figures and the other methods' masks beside",
                       description="On <root>/<data>/<domain>/{image,mask,xml} (DHR's layout): USS features with "
                                   "DHR's multi-scale inference (the model files as 'mars features' takes them), "
                                   "centroids, debias, evaluation of the pseudo and the debiased labels against "
                                   "<domain>/mask and of every other method folder of <root>/WSS/<data>/ (e.g. the "
                                   "authors' MARS masks) with its agreement with ours, and report.md with the "
                                   "paper's published figures beside. Every stage resumes; --out remembers its "
                                   "settings. Under torchrun the ranks share every stage.")
    p.add_argument("--root", required=True, help="folder holding <data>/<domain>/{image,mask,xml} (DHR's --root)")
    p.add_argument("--pseudo", required=True, help="folder of pseudo-label PNGs (e.g. <root>/WSS/VOC2012/RSEPM/train_aug)")
    p.add_argument("--out", required=True, help="output folder (features, centroids, debiased labels, report.md)")
    p.add_argument("--uss", choices=USS_CHOICES, default="stego",
                   help="the USS model (paper: stego; DHR: cause), loaded exactly as by 'mars features'")
    p.add_argument("--checkpoint", default=None,
                   help="STEGO Lightning .ckpt (e.g. cocostuff27_vit_base_5.ckpt; a pickle: needs --trust-pickle) "
                        "or Leopart .ckpt" + _OWN_DEFAULT)
    p.add_argument("--backbone", "--uss-backbone", dest="backbone", default=None,
                   help="DINO's dino_vitbase8_pretrain.pth (stego, with --heads) or DINOv2's "
                        "dinov2_vit?14_pretrain.pth (cause with --heads; dinov2 alone); weights_only" + _OWN_DEFAULT)
    p.add_argument("--heads", "--uss-heads", dest="heads", default=None,
                   help="DHR's STEGO_<data>.pt or CAUSE_<data>.pt, or CAUSE's own release (see docs/adapters.md); "
                        "weights_only" + _OWN_DEFAULT)
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling --checkpoint (STEGO's and Lightning's .ckpt files need it); only for "
                        "files you trust")
    p.add_argument("--features", default=None,
                   help="instead of the model files: a folder of <id>.pt/.npy features already computed "
                        "(e.g. <root>/VOC2012/train_aug/STEGO from DHR's produce_uss_features.py)" + _OWN_DEFAULT)
    p.add_argument("--data", default="VOC2012", help="dataset folder under --root (DHR's --data: VOC2012, COCO2014)")
    p.add_argument("--domain", default=None,
                   help="split folder under <data> (DHR's --domain; default: train_aug for VOC2012, train "
                        "otherwise)" + _OWN_DEFAULT)
    p.add_argument("--scales", type=scales_argument, default=DHR_SCALES,
                   help="feature scales, comma-separated; the first sets the feature grid (DHR's inference)")
    p.add_argument("--no-flip", action="store_true", help="no flip averaging of the features")
    _add_selection(p)
    p.add_argument("--refine", choices=("crf", "threshold"), default="crf", help="dense CRF or a plain threshold")
    p.add_argument("--crf-params", type=_crf_params, default="mars", help="dense-CRF preset or JSON dict (see debias)")
    p.add_argument("--device", default="cpu",
                   help="where features, K-means and CRF run: cpu, cuda, cuda:1, or auto (under torchrun: GPU "
                        "LOCAL_RANK)")
    p.add_argument("--fp16", action="store_true", help="features under float16 autocast (GPUs)")
    p.add_argument("--batch-size", type=T.batch_size, default=8, help="images per CRF call (64 suits a GPU)")
    p.add_argument("--workers", type=T.workers, default=1, help="debias processes on the CPU (one thread each)")
    p.add_argument("--num-examples", type=T.num_examples, default=8, help="most-changed images shown in the report")
    p.add_argument("--no-references", action="store_true",
                   help="do not score the other method folders of <root>/WSS/<data>/")
    p.add_argument("--dry-run", action="store_true",
                   help="check the tree and say what each stage would read and write, computing and writing "
                        "nothing (exit 1 when it finds a mismatch)")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="a bad input file: stop with its name (exit 2), or skip it, name it and exit 1")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    tr = p.add_argument_group("the second step (--train): mars train on the debiased labels, mars predict")
    tr.add_argument("--train", action="store_true",
                    help="then train the segmentation network on the debiased labels (out/train), predict and score "
                         "the validation split (out/val_pred, scores_trained.json) and write the MARS masks of the "
                         "training split (out/masks); each stage resumes")
    # each left out is the dhr recipe's, as mars train's (deeplabv3+dhr resnet101, 100 epochs of 16 512 crops, lr 1e-3)
    tr.add_argument("--arch", choices=("deeplabv3+dhr", "deeplabv3+", "deeplabv2"), default=None,
                    help="as mars train --arch (default: the dhr recipe's, deeplabv3+dhr)")
    tr.add_argument("--train-backbone", choices=("resnet18", "resnet50", "resnet101"), default=None,
                    help="as mars train --backbone (default: resnet101)")
    tr.add_argument("--weights", default=None, help="as mars train --weights (ImageNet ResNet, torchvision layout)")
    tr.add_argument("--iterations", type=T.iterations, default=None,
                    help="as mars train --iterations (default: the recipe's 100 epochs)")
    tr.add_argument("--train-batch-size", type=T.batch_size, default=None, help="as mars train --batch-size (16)")
    tr.add_argument("--crop", type=T.crop, default=None, help="as mars train --crop (512)")
    tr.add_argument("--min-size", type=T.image_side, default=None, help="as mars train --min-size (320)")
    tr.add_argument("--max-size", type=T.image_side, default=None, help="as mars train --max-size (640)")
    tr.add_argument("--lr", type=T.lr, default=None, help="as mars train --lr (1e-3)")
    tr.add_argument("--loader-workers", type=T.loader_workers, default=2, help="as mars train --workers")
    tr.add_argument("--val-domain", default="validation",
                    help="the split scored after training (<root>/<data>/<val-domain>/{image,mask}; DHR: validation)")
    tr.add_argument("--no-masks", action="store_true", help="do not predict the training split (the MARS masks)")
    add_threads(p)

    t = sub.add_parser("train", formatter_class=_Formatter,
                       help="train the segmentation network on debiased labels (EMA teacher + CRF complement + WCE, "
                            "Sec. 3.4), or with plain CE as the baseline",
                       description="The paper's second step: a DeepLab network trained on the debiased labels "
                                   "(254 = biased) with the EMA teacher refined by the dense CRF, the complement "
                                   "and the weighted CE (Eq. 6-7); --loss ce trains plain CE on the given labels. "
                                   "The MARS authors' trainer's settings (DHR train.py): SGD, poly, batch 16 of "
                                   "512x512, random resize, flip, colour jitter. Resumes from --out; under torchrun "
                                   "each process takes its slice of the global batch (the same step as one process).")
    t.add_argument("--images", default=None, help="folder of <id>.jpg|png images (default with --root: "
                                                  "<root>/<data>/<domain>/image)")
    t.add_argument("--labels", required=True, help="folder of <id>.png labels: debiased (254 = biased) for --loss mars, "
                                                   "the pseudo labels for --loss ce")
    t.add_argument("--out", required=True, help="the run's folder: checkpoint.pt, log.jsonl, train.json; a run there "
                                                 "of the same settings and data resumes, of other ones is refused")
    t.add_argument("--restart", action="store_true",
                   help="train from step 0 in --out: remove its checkpoint.pt and log.jsonl (once the data passed "
                        "its check), where a run of other settings or data would be refused")
    t.add_argument("--root", default=None, help="DHR's tree: images and xml tags from <root>/<data>/<domain>")
    t.add_argument("--data", default="VOC2012", help="with --root: dataset folder (VOC2012, COCO2014)")
    t.add_argument("--domain", default="train_aug", help="with --root: split folder")
    t.add_argument("--num-classes", type=T.num_classes, default=None,
                   help="foreground classes C (default: from --class-names, DHR's dataset with --root, else the "
                        "largest class id of --image-labels; refused when none is given)")
    t.add_argument("--class-names", default=None, help="JSON list of class names (background first), kept in the "
                                                        "checkpoint")
    t.add_argument("--image-labels", default=None,
                   help="JSON {id: [class ids]} the teacher may fill biased pixels with (mars reproduce writes "
                        "image_labels.json); default: the xml tags with --root, else each label's classes")
    from mars_plugin.networks.recipes import RECIPE_NAMES

    t.add_argument("--recipe", choices=RECIPE_NAMES, default="dhr",
                   help="the codebase whose training the run follows (mars_plugin/networks/recipes.py): dhr (the "
                        "RS+EPM row, DHR's trainer), deeplab-pytorch (IRNet/AdvCAM rows), seam (SEAM row); each flag "
                        "below left out is the recipe's, one given overrides that field (recorded in train.json)")
    t.add_argument("--arch", choices=("deeplabv3+dhr", "deeplabv3+", "deeplabv2", "deeplabv1-wr38"), default=None,
                   help="the network (default: the recipe's); deeplabv3+ is RS+EPM's DeepLabv3+ (3x3 classifier)")
    t.add_argument("--backbone", choices=("resnet18", "resnet50", "resnet101", "wr38"), default=None,
                   help="ResNet depth (resnet18 for small runs; default: the recipe's)")
    t.add_argument("--output-stride", type=T.output_stride, choices=(8, 16), default=None,
                   help="the backbone's output stride (default: the recipe's, 8 for all three)")
    t.add_argument("--bn", choices=("train", "frozen", "sync"), default=None,
                   help="BatchNorm: batch statistics (dhr's), frozen (deeplab-pytorch's) or sync (SyncBatchNorm "
                        "over torchrun's GPUs)")
    t.add_argument("--weights", default=None,
                   help="torchvision-layout ImageNet file of the backbone (e.g. resnet101-63fe2227.pth), read "
                        "weights-only; default: random initialisation")
    t.add_argument("--loss", choices=("mars", "ce"), default="mars",
                   help="mars: EMA teacher + complement + WCE on debiased labels; ce: plain CE (the baseline)")
    t.add_argument("--refine", choices=("crf", "none"), default="crf",
                   help="the teacher's refinement (the paper: the dense CRF, on the batch, on the device)")
    t.add_argument("--crf-params", type=_crf_params, default="mars", help="dense-CRF preset or JSON dict (see debias)")
    sched = t.add_mutually_exclusive_group()
    sched.add_argument("--iterations", type=T.iterations, default=None, help="optimizer steps (default: the recipe's)")
    sched.add_argument("--epochs", type=T.epochs, default=None,
                       help="passes over the images, counted as DHR (images // global batch per epoch with drop_last; "
                            "dhr: 100, 66,100 steps on VOC train_aug at 16)")
    t.add_argument("--batch-size", type=T.batch_size, default=None,
                   help="global batch (split over torchrun's processes; dhr: 16)")
    t.add_argument("--iter-size", type=T.iter_size, default=None,
                   help="batches whose gradients add up to one step (deeplab-pytorch: 2)")
    t.add_argument("--lr-step", type=T.iterations, default=None,
                   help="the poly learning rate is recomputed every N steps (deeplab-pytorch: 10)")
    t.add_argument("--loss-grid", choices=("logits", "input"), default=None,
                   help="the loss on the logits' grid (labels resized nearest) or at the crop (logits upsampled)")
    t.add_argument("--crop", type=T.crop, default=None, help="crop side (dhr: 512)")
    t.add_argument("--min-size", type=T.image_side, default=None, help="random resize: smallest longer side (dhr: 320)")
    t.add_argument("--max-size", type=T.image_side, default=None, help="random resize: largest longer side (dhr: 640)")
    t.add_argument("--lr", type=T.lr, default=None, help="backbone learning rate, the groups at the recipe's "
                                                         "multiples (dhr: 1e-3, new layers 10x)")
    t.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                   help="sgd: the MARS authors' (DHR's); adamw: for a network trained from random initialisation on "
                        "a small set (the demo world), which it teaches in far fewer steps")
    t.add_argument("--momentum", type=T.momentum, default=None, help="SGD momentum (dhr: 0.9)")
    t.add_argument("--weight-decay", type=T.weight_decay, default=None, help="SGD weight decay (dhr: 4e-5)")
    t.add_argument("--ema", type=T.ema, default=0.999, help="teacher EMA momentum (the paper: 0.999)")
    t.add_argument("--seed", type=T.seed, default=0, help="seed of the initialisation, the data order and the "
                                                          "augmentation")
    t.add_argument("--no-amp", action="store_true", help="float32 on CUDA (AMP is on by default there)")
    t.add_argument("--device", default="auto", help="auto (CUDA if any; under torchrun: GPU LOCAL_RANK), cpu, cuda")
    t.add_argument("--max-memory", type=T.max_memory, default=None, metavar="GIB",
                   help="memory budget per process in GiB: a step of --crop x --batch-size that needs more is refused "
                        "before step 1 (default: 80%% of the device's memory: RAM on the CPU, the GPU's on cuda)"
                   + "%(default).0s")
    t.add_argument("--workers", type=T.loader_workers, default=2, help="data-loading processes per training process")
    t.add_argument("--save-every", type=T.every, default=1000, help="checkpoint every N steps (and at the end)")
    t.add_argument("--log-every", type=T.every, default=10, help="a log.jsonl line every N steps")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_threads(t)

    from mars_plugin.commands.predict import add_predict_arguments

    pr = sub.add_parser("predict", formatter_class=_Formatter,
                        help="a trained network's labels (mars train checkpoint): multi-scale + flip inference and "
                             "the dense CRF, as the authors' evaluators",
                        description="One P-mode PNG (VOC palette) per image: the mean softmax over --scales and "
                                    "flips, then the dense CRF over the classes reaching --class-threshold (RS+EPM's "
                                    "and DHR's evaluators; sources in mars_plugin/networks/inference.py). --root/--method write "
                                    "DHR's WSS/<data>/<method>/<domain>/ (MARS masks, for train.py --wss). "
                                    "Resumable, atomic writes; under torchrun the ranks share the images.")
    add_predict_arguments(pr)
    add_threads(pr)

    from mars_plugin.commands.crf_settings import add_crf_arguments

    cr = sub.add_parser("crf", formatter_class=_Formatter,
                        help="the dense CRF over a folder of a codebase's CAMs or of probability maps, in batches on "
                             "the device",
                        description="One label PNG (P mode, VOC palette) or (L, H, W) .npy of marginals per file of "
                                    "--cams (a codebase's CAMs, made into the CRF's input by its own rule) or --probs "
                                    "(probability maps, channel = class id), with its image of --images. Resumable, "
                                    "atomic writes; under torchrun the ranks share the files.")
    add_crf_arguments(cr)
    add_threads(cr)

    return ap
