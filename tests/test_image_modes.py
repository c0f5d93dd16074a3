"""Every image mode is read right or refused by name (issue 30, class 6): one reader
(``files.read_image``, the rule of ``formats/images.py``) for every command. Each readable mode
is compared with its 8-bit twin, through the reader and through the paths of ``mars
features``, ``mars predict``, ``mars debias`` (its CRF image) and ``mars train`` (its data);
each refused mode is one line naming the file and the mode. Labels of a non-label mode are
refused by name too."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

from mars_plugin.cli import main
from mars_plugin.runs.errors import JobError
from mars_plugin.commands.features import features_job
from mars_plugin.commands.predict import predict_job
from mars_plugin.formats.files import read_image, read_label, write_label
from mars_plugin.formats.images import to_rgb
from mars_plugin.networks.seg_data import Augmentation, TrainFolder
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world

H, W = 12, 20


def _grey(seed: int = 0) -> np.ndarray:
    """(H, W) uint8 with every byte value a chance to appear, both extremes included."""
    g = np.random.default_rng(seed).integers(0, 256, (H, W)).astype(np.uint8)
    g[0, 0], g[0, 1] = 0, 255
    return g


def _rgb(seed: int = 1) -> np.ndarray:
    rgb = np.random.default_rng(seed).integers(0, 256, (H, W, 3)).astype(np.uint8)
    rgb[0, 0], rgb[0, 1] = 0, 255
    return rgb


def _rgb_of(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[:, :, None], 3, axis=2)


def _grey_palette(im: Image.Image) -> Image.Image:
    im.putpalette([i for i in range(256) for _ in range(3)])
    return im


# Each case writes a file of one mode at ``path`` and returns the RGB its 8-bit twin holds.
def _i16_png(path: Path) -> np.ndarray:
    g = _grey()
    Image.fromarray(g.astype(np.uint16) * 257).save(path, format="PNG")  # v * 257: the 16-bit twin of v
    return _rgb_of(g)


def _i16_png_low_byte_noise(path: Path) -> np.ndarray:
    g = _grey()
    Image.fromarray(g.astype(np.uint16) * 256 + 255 - g).save(path, format="PNG")  # scaled, not rounded: v >> 8
    return _rgb_of(g)


def _rgb48_png(path: Path) -> np.ndarray:
    """A 16-bit-per-channel RGB PNG (PIL writes none: the chunks by hand), v * 257 per channel."""
    import struct
    import zlib

    rgb = _rgb()
    a = (rgb.astype(np.uint16) * 257).astype(">u2")
    raw = b"".join(b"\x00" + a[y].tobytes() for y in range(H))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 16, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return rgb


def _i16_tiff(path: Path) -> np.ndarray:
    g = _grey()
    Image.fromarray(g.astype(np.uint16) * 257).save(path, format="TIFF")
    return _rgb_of(g)


def _i32_tiff(path: Path) -> np.ndarray:
    g = _grey()
    Image.fromarray(g.astype(np.int32) << 23).save(path, format="TIFF")  # signed 32-bit: 31 magnitude bits
    return _rgb_of(g)


def _i16_pgm(path: Path) -> np.ndarray:
    g = _grey()
    path.write_bytes(b"P5\n%d %d\n65535\n" % (W, H) + (g.astype(">u2") * 257).tobytes())  # PIL opens it as I
    return _rgb_of(g)


def _float_tiff(path: Path) -> np.ndarray:
    g = _grey()
    Image.fromarray(g.astype(np.float32) / 255).save(path, format="TIFF")
    return _rgb_of(g)


def _cmyk_tiff(path: Path) -> np.ndarray:
    rgb = _rgb()
    Image.fromarray(rgb).convert("CMYK").save(path, format="TIFF")  # PIL's RGB <-> CMYK is exact both ways
    return rgb


def _cmyk_jpeg(path: Path) -> np.ndarray:
    Image.fromarray(_rgb()).convert("CMYK").save(path, format="JPEG", quality=95)
    with Image.open(path) as im:  # an Adobe CMYK JPEG, as PIL converts it
        assert im.mode == "CMYK"
        return np.array(im.convert("RGB"))


def _la_png(path: Path) -> np.ndarray:
    g = _grey()
    alpha = np.random.default_rng(5).integers(0, 256, (H, W)).astype(np.uint8)
    Image.fromarray(np.stack([g, alpha], -1), "LA").save(path, format="PNG")
    return _rgb_of(g)  # alpha dropped, not composited


def _rgba_png(path: Path) -> np.ndarray:
    rgb = _rgb()
    alpha = np.zeros((H, W), np.uint8)  # fully transparent: the colours are still what is read
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(path, format="PNG")
    return rgb


def _palette_transparent_index(path: Path) -> np.ndarray:
    g = _grey()
    _grey_palette(Image.fromarray(g, "L").convert("P")).save(path, format="PNG", transparency=int(g[0, 0]))
    return _rgb_of(g)


def _palette_transparent_bytes(path: Path) -> np.ndarray:
    g = _grey()
    _grey_palette(Image.fromarray(g, "L").convert("P")).save(path, format="PNG", transparency=bytes(range(256)))
    return _rgb_of(g)


def _bilevel_png(path: Path) -> np.ndarray:
    g = np.where(_grey() > 127, 255, 0).astype(np.uint8)
    Image.fromarray(g).convert("1").save(path, format="PNG")
    return _rgb_of(g)


def _exif_rotated_png(path: Path) -> np.ndarray:
    rgb = _rgb()
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": not applied, the stored pixels are read
    Image.fromarray(rgb).save(path, format="PNG", exif=exif)
    return rgb


def _exif_rotated_jpeg(path: Path) -> np.ndarray:
    rgb = _rgb()
    exif = Image.Exif()
    exif[0x0112] = 8
    Image.fromarray(rgb).save(path, format="JPEG", quality=95, exif=exif)
    with Image.open(path) as im:
        assert im.getexif().get(0x0112) == 8
        return np.array(im.convert("RGB"))  # the stored pixels (JPEG is lossy: its own decode is the twin)


#: name -> writer. Every file is named .png, whatever its content (TIFF, PGM, JPEG): PIL reads the
#: content, not the name, and the commands list .png files, so every case can run through them.
READABLE = {
    "I;16 png": _i16_png,
    "I;16 png, low byte dropped": _i16_png_low_byte_noise,
    "RGB 16-bit png": _rgb48_png,
    "I;16 tiff": _i16_tiff,
    "I tiff 32-bit": _i32_tiff,
    "I pgm 16-bit": _i16_pgm,
    "F tiff in [0, 1]": _float_tiff,
    "CMYK tiff": _cmyk_tiff,
    "CMYK jpeg": _cmyk_jpeg,
    "LA png": _la_png,
    "RGBA png": _rgba_png,
    "P with a transparent index": _palette_transparent_index,
    "P with transparency bytes": _palette_transparent_bytes,
    "1 png": _bilevel_png,
    "EXIF-rotated png": _exif_rotated_png,
    "EXIF-rotated jpeg": _exif_rotated_jpeg,
}


@pytest.mark.parametrize("case", list(READABLE))
def test_each_mode_reads_as_its_8_bit_twin(tmp_path, case):
    path = tmp_path / "im.png"
    twin = READABLE[case](path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: dropping transparency is the rule
        got = read_image(path)
    assert got.dtype == np.uint8 and got.shape == (H, W, 3)
    assert np.array_equal(got, twin), case


def _f_out_of_range(path: Path) -> str:
    Image.fromarray(np.linspace(0, 2, H * W, dtype=np.float32).reshape(H, W)).save(path, format="TIFF")
    return r"mode F\) image with values in \[0, 2\]"


def _f_nan(path: Path) -> str:
    a = np.full((H, W), 0.5, np.float32)
    a[3, 4] = np.nan
    Image.fromarray(a).save(path, format="TIFF")
    return r"mode F\) image holds 1 values that are not finite"


def _i_negative(path: Path) -> str:
    Image.fromarray(np.full((H, W), -5, np.int32)).save(path, format="TIFF")
    return r"mode I image holds negative values"


def _lab_tiff(path: Path) -> str:
    Image.fromarray(_rgb()).convert("LAB").save(path, format="TIFF")
    return r"image mode LAB is not read by mars"


#: name -> writer returning a regex the one-line refusal must match (besides the file's path).
REFUSED = {
    "F out of [0, 1]": _f_out_of_range,
    "F with a NaN": _f_nan,
    "I negative": _i_negative,
    "LAB": _lab_tiff,
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refused_mode_is_one_line_naming_the_file_and_mode(tmp_path, case):
    path = tmp_path / "im.png"
    says = REFUSED[case](path)
    with pytest.raises(ValueError, match=says) as e:
        read_image(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg


@pytest.mark.parametrize("mode", ["HSV", "RGBa", "La", "LAB"])
def test_modes_without_a_rule_are_refused_naming_the_mode(mode):
    base = Image.fromarray(_rgb())
    if mode == "La":
        im = Image.fromarray(_grey()).convert("LA").convert("La")
    else:
        im = base.convert("RGBA").convert(mode) if mode == "RGBa" else base.convert(mode)
    assert im.mode == mode
    with pytest.raises(ValueError, match=rf"^x\.png: image mode {mode} is not read by mars"):
        to_rgb(im, "x.png")


def test_an_in_memory_pa_and_i16b_follow_the_rule():
    """Modes PIL reads from few files, checked on the rule itself."""
    g = _grey()
    pa = _grey_palette(Image.fromarray(g, "L").convert("P")).convert("PA")
    assert pa.mode == "PA" and np.array_equal(to_rgb(pa, "pa"), _rgb_of(g))
    big = Image.fromarray((g.astype(np.uint16) * 257).astype(">u2"))
    assert big.mode == "I;16B" and np.array_equal(to_rgb(big, "b"), _rgb_of(g))


# --------------------------------------------------------------------------- labels

def _label_16bit(path: Path) -> str:
    Image.fromarray(np.full((H, W), 300, np.uint16)).save(path, format="PNG")
    return r"got mode I;16 \(16-bit"


def _label_rgb(path: Path) -> str:
    Image.fromarray(_rgb()).save(path, format="PNG")
    return r"got mode RGB \(a colour image"


def _label_la(path: Path) -> str:
    Image.fromarray(_grey()).convert("LA").save(path, format="PNG")
    return r"got mode LA \(grey with alpha"


@pytest.mark.parametrize("write", [_label_16bit, _label_rgb, _label_la])
def test_a_label_of_a_non_label_mode_is_refused_by_name(tmp_path, write):
    path = tmp_path / "lab.png"
    says = write(path)
    with pytest.raises(ValueError, match=says) as e:
        read_label(path)
    assert str(e.value).startswith(f"{path}: label PNGs must be 8-bit palette (P) or grayscale (L)")


# --------------------------------------------------------------------------- through the commands

#: The cases run through every command (one image each, all in one folder).
THROUGH = ["I;16 png", "RGB 16-bit png", "I tiff 32-bit", "F tiff in [0, 1]", "CMYK tiff", "LA png", "RGBA png",
           "P with transparency bytes", "EXIF-rotated png"]


def _mode_folders(root: Path):
    """``root/modes``: one image per case of :data:`THROUGH`; ``root/twins``: their 8-bit RGB
    twins (plain RGB PNGs)."""
    modes, twins = root / "modes", root / "twins"
    modes.mkdir(parents=True)
    twins.mkdir()
    for i, case in enumerate(THROUGH):
        twin = READABLE[case](modes / f"m{i}.png")
        Image.fromarray(twin).save(twins / f"m{i}.png")
    return modes, twins


def _pixels(images, output_size=None):
    """An extractor whose features are the pixels themselves: (B, 3, H, W) uint8 -> float."""
    return images.float()


def test_features_of_each_mode_equal_its_twins(tmp_path):
    modes, twins = _mode_folders(tmp_path)
    for src, out in ((modes, tmp_path / "f_modes"), (twins, tmp_path / "f_twins")):
        s = features_job(_pixels, src, out, batch_size=3, progress=False, file_format="npy")
        assert s.done == len(THROUGH) and not s.failed
    for i, case in enumerate(THROUGH):
        a = np.load(tmp_path / "f_modes" / f"m{i}.npy")
        assert np.array_equal(a, np.load(tmp_path / "f_twins" / f"m{i}.npy")), case


class _ColourNet(nn.Module):
    """A 1x1 convolution: each pixel's label follows its colour."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 1)
        nn.init.normal_(self.conv.weight, std=30.0)

    def forward(self, x):
        return self.conv(x)


def test_predict_of_each_mode_equals_its_twins(tmp_path):
    modes, twins = _mode_folders(tmp_path)
    net = _ColourNet().eval()
    for src, out in ((modes, tmp_path / "p_modes"), (twins, tmp_path / "p_twins")):
        s = predict_job(net, src, out, scales=(1.0,), flip=False, crf=None, batch_size=2, progress=False,
                        preprocess=lambda rgb: rgb.permute(0, 3, 1, 2).float() / 255)
        assert s.done == len(THROUGH) and not s.failed
    varied = 0
    for i, case in enumerate(THROUGH):
        a = read_label(tmp_path / "p_modes" / f"m{i}.png")
        assert torch.equal(a, read_label(tmp_path / "p_twins" / f"m{i}.png")), case
        varied += len(torch.unique(a)) > 1
    assert varied >= len(THROUGH) // 2  # the labels do follow the pixels


def test_train_data_of_each_mode_equals_its_twins(tmp_path):
    modes, twins = _mode_folders(tmp_path)
    labels = tmp_path / "labels"
    for i in range(len(THROUGH)):
        write_label(labels / f"m{i}.png", torch.ones(H, W, dtype=torch.long))
    stems = [f"m{i}" for i in range(len(THROUGH))]
    aug = Augmentation(crop=16, min_size=16, max_size=24)
    a, b = (TrainFolder(d, labels, stems, 3, aug, seed=0) for d in (modes, twins))
    for stem, case in zip(stems, THROUGH):
        assert np.array_equal(a.read(stem)[0], b.read(stem)[0]), case


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes_world")
    w = make_world(6, size=32, dim=16, seed=3)
    write_world(w, root)
    assert main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    return root, w


def _debias(root: Path, images: Path, out: Path, *extra: str) -> int:
    return main(["debias", "--features", str(root / "features"), "--labels", str(root / "labels"), "--centroids",
                 str(root / "V.pt"), "--images", str(images), "--out", str(out), "--no-progress", *extra])


def _grey_folders(root: Path, w, tmp_path: Path):
    """The world's images as 16-bit grey PNGs (``i16``) and their 8-bit grey twins (``i8``)."""
    i16, i8 = tmp_path / "i16", tmp_path / "i8"
    i16.mkdir()
    i8.mkdir()
    for stem, img in zip(w.stems, w.images):
        g = np.asarray(img, dtype=np.float64).mean(-1).round().astype(np.uint8)
        Image.fromarray(g.astype(np.uint16) * 257).save(i16 / f"{stem}.png")
        Image.fromarray(g).save(i8 / f"{stem}.png")
    return i16, i8


def test_debias_crf_reads_a_16_bit_image_as_its_8_bit_twin(world, tmp_path):
    root, w = world
    i16, i8 = _grey_folders(root, w, tmp_path)
    assert _debias(root, i16, tmp_path / "d16") == 0
    assert _debias(root, i8, tmp_path / "d8") == 0
    for stem in w.stems:
        assert torch.equal(read_label(tmp_path / "d16" / f"{stem}.png"), read_label(tmp_path / "d8" / f"{stem}.png"))


def test_a_refused_mode_is_one_line_in_each_command(world, tmp_path, capsys):
    root, w = world
    images = tmp_path / "images"
    images.mkdir()
    for p in (root / "images").iterdir():
        (images / p.name).write_bytes(p.read_bytes())
    bad = images / f"{w.stems[1]}.png"
    bad.unlink()
    _f_out_of_range_sized(bad, w.images[1].shape[:2])
    says = f"{bad}: a float (mode F) image with values in [0, 2]"

    assert _debias(root, images, tmp_path / "stop") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert _debias(root, images, tmp_path / "skip", "--on-error", "skip") == 1
    err = capsys.readouterr().err
    assert says in err and sorted(p.stem for p in (tmp_path / "skip").glob("*.png")) == [s for s in w.stems if s != w.stems[1]]

    with pytest.raises(JobError, match=r"mode F\) image with values in \[0, 2\]") as e:
        features_job(_pixels, images, tmp_path / "feats", progress=False)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(JobError, match=r"mode F\) image with values in \[0, 2\]") as e:
        predict_job(_ColourNet().eval(), images, tmp_path / "pred", scales=(1.0,), flip=False, crf=None,
                    progress=False, preprocess=lambda rgb: rgb.permute(0, 3, 1, 2).float())
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def _f_out_of_range_sized(path: Path, size) -> None:
    h, w = size
    Image.fromarray(np.linspace(0, 2, h * w, dtype=np.float32).reshape(h, w)).save(path, format="TIFF")
