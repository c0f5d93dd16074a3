"""``mars features``' settings: one frozen record (:class:`FeaturesSettings`), checked once where
it is made, built by the command line (:meth:`FeaturesSettings.from_args`), taken by
:func:`mars_plugin.commands.features.features_job` and stored as the folder's identity
(:meth:`FeaturesSettings.identity`); and the command's flags (:func:`add_features_arguments`:
``HELP``, ``DESCRIPTION``; :mod:`mars_plugin.commands.cli_parser` adds ``--threads``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from mars_plugin._checks import MAX_BATCH_SIZE, MAX_STRIDE, check_int_param, check_scales
from mars_plugin.adapters.uss.extractor import USS_MODELS, uss_names_text
from mars_plugin.adapters.uss.preprocess import check_output_size
from mars_plugin.commands import cli_types as T
from mars_plugin.runs.errors import ON_ERROR

__all__ = ["FeaturesSettings", "add_features_arguments", "scales_argument", "FILE_FORMATS"]

#: ``file_format`` of :func:`~mars_plugin.commands.features.features_job`: numpy arrays, or fp16
#: torch tensors as DHR writes them.
FILE_FORMATS = ("npy", "pt")
#: the model's options (as given: None is the model's default), recorded with its files
_MODEL_OPTIONS = ("res", "flip", "scales", "dhr", "head", "normalize", "interpolation", "prefix")


@dataclass(frozen=True)
class FeaturesSettings:
    """What ``mars features`` does. The model (``uss`` and its files ``checkpoint``, ``backbone``,
    ``heads``; its options ``res`` ... ``prefix``, as :func:`~mars_plugin.adapters.uss.extractor.load_extractor`
    takes them, ``flip`` being its ``flip_average``; checked by that loader): what
    :meth:`load_extractor` loads and :meth:`identity` records; a library extractor is described by
    ``model`` instead (None: its ``describe()``). The job: ``batch_size`` images per forward pass
    on ``device`` (under ``fp16`` autocast), maps of ``output_size`` (None: the extractor's grid,
    ``"image"``, or an (h, w) pair) or of the image's size over ``stride``, written as
    ``file_format`` files; ``on_error``: a bad image stops the run or is skipped."""

    uss: Optional[str] = None
    checkpoint: Optional[str] = None
    backbone: Optional[str] = None
    heads: Optional[str] = None
    res: Union[None, int, str] = None
    interpolation: Optional[str] = None
    flip: Optional[bool] = None
    scales: Optional[Tuple[float, ...]] = None
    dhr: bool = False
    head: bool = False
    prefix: Optional[str] = None
    normalize: Optional[bool] = None
    trust_pickle: bool = False
    #: what made a library extractor (its weights, its options), recorded with the folder
    model: Optional[Mapping[str, Any]] = None
    fp16: bool = False
    output_size: Optional[Union[str, Tuple[int, int]]] = None
    stride: Optional[int] = None
    file_format: str = "npy"
    batch_size: int = 8
    device: Any = "cpu"
    on_error: str = "stop"
    progress: bool = True

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: normalised once here
        if self.model is not None and not isinstance(self.model, Mapping):
            raise TypeError(f"model must be a mapping (what made the extractor: its weights, its options) or None, "
                            f"got {type(self.model).__name__} {self.model!r}"[:200])
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.file_format not in FILE_FORMATS:
            raise ValueError(f"file_format must be one of {FILE_FORMATS}, got {self.file_format!r}")
        put("batch_size", check_int_param(self.batch_size, "batch_size", 1, MAX_BATCH_SIZE))
        if self.stride is not None:
            put("stride", check_int_param(self.stride, "stride", 1, MAX_STRIDE))
        if self.stride is not None and self.output_size is not None:
            raise ValueError("give either output_size or stride, not both")
        if isinstance(self.output_size, str) and self.output_size != "image":
            raise ValueError(f"output_size must be None, 'image' or an (h, w) pair, got {self.output_size!r}")
        if self.output_size is not None and not isinstance(self.output_size, str):
            check_output_size(self.output_size)
        T.check_fields(self, add_arguments, FLAG_KEYWORDS)  # then every flag's bounds, choices, switches (cli_types)

    @property
    def extensions(self) -> Tuple[str, str]:
        """(the extension written, the other format's): a stem must not have both."""
        return (".npy", ".pt") if self.file_format == "npy" else (".pt", ".npy")

    def load_extractor(self) -> Any:
        """The model of ``uss`` from its files (read from disk, nothing is downloaded)."""
        from mars_plugin.adapters.uss.extractor import load_extractor

        return load_extractor(
            self.uss, self.checkpoint, backbone=self.backbone, heads=self.heads, trust_pickle=self.trust_pickle,
            res=self.res, flip_average=self.flip, head=self.head, normalize=self.normalize,
            interpolation=self.interpolation, prefix=self.prefix, scales=self.scales, dhr=self.dhr,
        )

    def described(self, extractor: Any) -> Any:
        """What made ``extractor``: ``model`` if given; else with ``uss`` its model files (size and
        hash of their ends) and every option, as given (None: the model's default); else its
        ``describe()`` (a library extractor's weights are then not recorded: give ``model``)."""
        if self.model is not None:
            return self.model
        if self.uss is not None:
            from mars_plugin.runs.identities import model_files_id

            return dict(model_files_id(self.uss, self.checkpoint, self.backbone, self.heads),
                        **{k: getattr(self, k) for k in _MODEL_OPTIONS})
        describe = getattr(extractor, "describe", None)
        return {"extractor": describe() if callable(describe) else type(extractor).__name__}

    def identity(self, extractor: Any) -> Dict[str, Any]:
        """The settings that shape the embeddings (the folder's record, compared on resume); not
        the image folder: each image is recorded by its identity (a moved or copied tree is the
        same run), nor the format (npy or pt: the same values; a folder may mix them)."""
        return {"fp16": bool(self.fp16), "output_size": self.output_size, "stride": self.stride,
                "model": self.described(extractor)}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FeaturesSettings":
        """``mars features``' parsed flags -> the settings (checked)."""
        return cls(uss=args.uss, checkpoint=args.checkpoint, backbone=args.backbone, heads=args.heads,
                   res=args.res, interpolation=args.interpolation, flip=args.flip, scales=args.scales,
                   dhr=args.dhr, head=args.head, prefix=args.prefix, normalize=args.normalize,
                   trust_pickle=args.trust_pickle, fp16=args.fp16,
                   output_size="image" if args.full_size else None, stride=args.stride,
                   file_format=args.file_format, batch_size=args.batch_size, device=args.device,
                   on_error=args.on_error, progress=not args.no_progress)


# --------------------------------------------------------------------------------------------
# the flags
# --------------------------------------------------------------------------------------------


def scales_argument(text: str) -> Tuple[float, ...]:
    """--scales: comma-separated positive numbers, e.g. 2,1,1.5,0.5 (order kept)."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 2,1,1.5,0.5, got {text!r}") from None
    try:
        return check_scales(values)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


# An empty "%(default)" field: ArgumentDefaultsHelpFormatter then leaves out its "(default: None)"
# where the help text already says what None means.
_OWN_DEFAULT = "%(default).0s"


def add_features_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mars features`` (use an ``ArgumentDefaultsHelpFormatter`` to show defaults),
    in the order ``--help`` lists them."""
    _add_model_files(parser)
    _add_folders(parser)
    _add_model_options(parser)
    _add_output(parser)


def _add_model_files(parser: argparse.ArgumentParser) -> None:
    """--uss and its files: --checkpoint, or --backbone and --heads."""
    parser.add_argument("--uss", choices=USS_MODELS, required=True,
                        help="unsupervised segmentation model the checkpoint belongs to")
    parser.add_argument("--checkpoint", default=None,
                        help="STEGO Lightning .ckpt (cocostuff27_vit_base_5.ckpt, potsdam_test.ckpt, ...) or Leopart "
                             ".ckpt (leopart_vits16.ckpt, leopart_vitb8.ckpt, or a Lightning checkpoint); or give "
                             "--backbone and --heads" + _OWN_DEFAULT)
    parser.add_argument("--backbone", default=None,
                        help="STEGO or CAUSE as DHR stores them: the backbone file (DINO's dino_vitbase8_pretrain.pth; "
                             "DINOv2 weights for CAUSE), with --heads; --uss dinov2: DINOv2's release file alone "
                             "(dinov2_vitb14_pretrain.pth, ..._reg4_pretrain.pth)"
                             + _OWN_DEFAULT)
    parser.add_argument("--heads", default=None,
                        help="STEGO or CAUSE as DHR stores them: the heads file (weights/STEGO_<dataset>.pt, 'cluster1' "
                             "and 'cluster2'; weights/CAUSE_<dataset>.pt, 'decoder' and 'codebook'; or CAUSE's own release folder "
                             "CAUSE/<dataset>/dinov2_vit_base_14/2048/ or its segment_tr.pth), with --backbone" + _OWN_DEFAULT)


def _add_folders(parser: argparse.ArgumentParser) -> None:
    """--images, --out, and where and how the network runs."""
    parser.add_argument("--images", required=True, help="folder of RGB images <stem>.jpg/.jpeg/.png/.bmp")
    parser.add_argument("--out", required=True, help="output folder of <stem>.npy float16 (D, h, w) embeddings")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:N, or auto: GPU LOCAL_RANK under torchrun (each rank its own GPU), "
                             "the GPU if any otherwise, else the CPU")
    parser.add_argument("--batch-size", type=T.batch_size, default=8, help="images per forward pass (same-size images only)")
    parser.add_argument("--fp16", action="store_true", help="run the network under float16 autocast (GPU)")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """The model's inference options (None: the model's own default)."""
    parser.add_argument("--res", type=T.res, default=None,
                        help="STEGO: shorter image side fed to the ViT (default: 320, its evaluation); "
                             "Leopart: square input side (default: 448, its evaluation); DINOv2: shorter side "
                             "(default: native); 'native': the image's own "
                             "resolution (DHR)" + _OWN_DEFAULT)
    parser.add_argument("--interpolation", choices=("nearest", "bilinear"), default=None,
                        help="input resize (default: nearest for STEGO, as its transform; bilinear for Leopart)"
                             + _OWN_DEFAULT)
    parser.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                        help="average the embeddings with those of the horizontally flipped image (default: yes for "
                             "STEGO, as its evaluation; no for Leopart)" + _OWN_DEFAULT)
    parser.add_argument("--scales", type=scales_argument, default=None,
                        help="DHR's multi-scale inference at these comma-separated scales of the --res image, e.g. "
                             "2,1,1.5,0.5 (the first sets the output grid; default: one scale)" + _OWN_DEFAULT)
    parser.add_argument("--dhr", action="store_true",
                        help="DHR's inference: --res native --scales 2,1,1.5,0.5 --flip --no-normalize (flags given "
                             "explicitly win)")
    parser.add_argument("--head", action="store_true",
                        help="Leopart: use the 256-d projection-head embedding instead of the backbone tokens")
    parser.add_argument("--prefix", default=None,
                        help="Leopart: key prefix of the backbone in the checkpoint (default: 'model.', else the "
                             "single prefix in front of 'cls_token')" + _OWN_DEFAULT)
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="L2-normalise each pixel's embedding (default: yes for STEGO and the Leopart head, no "
                             "for Leopart backbone tokens)" + _OWN_DEFAULT)


def _add_output(parser: argparse.ArgumentParser) -> None:
    """The maps' size, the files written, and how the run goes."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--stride", type=T.stride, default=None,
                      help="write maps of ceil(H/N) x ceil(W/N) for an H x W image (default: the ViT patch grid; "
                           "the MARS core resizes features to each label anyway)" + _OWN_DEFAULT)
    size.add_argument("--full-size", action="store_true",
                      help="write maps of the image's own H x W (large files: D*H*W*2 bytes each)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow unpickling a checkpoint that holds Python objects besides its weights (STEGO's "
                             "and Lightning's .ckpt files do); only for files you trust")
    parser.add_argument("--on-error", choices=ON_ERROR, default="stop",
                        help="an unreadable image: stop with its name (exit 2), or report it, go on and exit 1")
    parser.add_argument("--format", choices=FILE_FORMATS, default="npy", dest="file_format",
                        help="write <stem>.npy arrays or <stem>.pt fp16 torch tensors (DHR's format)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


#: ``mars features`` in ``mars --help``, and the head of its own ``--help``
HELP = f"USS embeddings ({uss_names_text()}) for a folder of images"
DESCRIPTION = ("Write one float16 (D, h, w) <stem>.npy (or <stem>.pt with --format pt) per image "
               f"with a {uss_names_text()} model read from disk (nothing is downloaded); "
               "resumable, atomic writes.")

#: the flags of ``mars features`` (:mod:`mars_plugin.commands.cli_parser` adds ``--threads``)
add_arguments = add_features_arguments
#: the record the flags build, and the Python function taking it as ``settings=`` or its fields
#: as keywords
SETTINGS = FeaturesSettings
API = "mars_plugin.commands.features:features_job"
#: flag dest -> Python keyword, where the names differ
FLAG_KEYWORDS = {"images": "images_dir", "out": "out_dir", "full_size": "output_size", "no_progress": "progress"}
#: keywords no flag sets
PYTHON_ONLY = {
    "extractor": "the model itself: the command line loads it from --uss and its files (FeaturesSettings.load_extractor)",
    "model": "what made a library extractor, recorded with the folder (the command line records --uss's files and "
             "options instead)",
    "stems": "only these images of the folder (a caller's subset: mars reproduce's ids)",
}
