"""mars train's settings record (commands/train_settings.TrainSettings): every bad value refused
naming its field, the command line and the API build the same record, and the record survives
the checkpoint (weights-only) and reads back to the same settings."""
import pytest
import torch

from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.commands.train_settings import TrainSettings
from mars_plugin.networks.seg_checkpoint import load_checkpoint, save_checkpoint

OK = dict(num_classes=4, arch="deeplabv3+", backbone="resnet18")


@pytest.mark.parametrize("field, value, message", [
    ("num_classes", 0, r"num_classes must be an integer in 1\.\.253, got 0"),
    ("loss", "wce", r"loss must be 'mars' or 'ce', got 'wce'"),
    ("refine", "bilateral", r"refine must be 'crf' or None, got 'bilateral'"),
    ("iterations", 0, r"iterations must be an integer >= 1, got 0"),
    ("batch_size", -2, r"batch_size must be an integer >= 1, got -2"),
    ("save_every", 0, r"save_every must be an integer >= 1, got 0"),
    ("log_every", 0, r"log_every must be an integer >= 1, got 0"),
    ("workers", 257, r"workers must be an integer in 0\.\.256, got 257"),  # --workers' bounds (issue 41)
    ("seed", -1, r"seed must be an integer in 0\.\.4294967295, got -1"),
    ("lr", 0.0, r"lr must be a finite number in \(0, 10\], got 0\.0"),
    ("momentum", 1.0, r"momentum must be a finite number in \[0, 1\), got 1\.0"),
    ("weight_decay", 2.0, r"weight_decay must be a finite number in \[0, 1\], got 2\.0"),
    ("ema", 1.5, r"ema must be a finite number in \[0, 1\], got 1\.5"),
    ("poly_power", float("nan"), r"poly_power must be a finite number in \[0, 10\], got nan"),
    ("crop", 4, r"crop must be an integer >= 8, got 4"),
    ("min_size", 700, r"min_size must be <= max_size, got 700 > 640"),
    ("optimizer", "adam", r"optimizer must be 'sgd' or 'adamw', got 'adam'"),
    ("bn", "group", r"bn must be 'train', 'frozen' or 'sync', got 'group'"),
    ("arch", "unet", r"arch must be one of .*got 'unet'"),
    ("backbone", "vgg16", r"backbone must be one of .*got 'vgg16'"),
    ("output_stride", 32, r"output_stride must be 8 or 16, got 32"),
])
def test_every_bad_value_is_refused_naming_its_field(field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TrainSettings(**{**OK, field: value})


def test_a_bad_type_is_refused_naming_its_field():
    with pytest.raises(TypeError, match=r"iterations must be an integer >= 1, got .*str"):
        TrainSettings(**OK, iterations="100")


def test_the_record_is_frozen_and_resolves_the_recipe_defaults_once():
    s = TrainSettings(num_classes=4, recipe="deeplab-pytorch", backbone="resnet18", loss="ce")
    assert (s.arch, s.output_stride, s.bn) == ("deeplabv2", 8, "frozen")
    assert s.refine is None and s.crf_params is None and s.ema is None  # the baseline has no teacher
    with pytest.raises(Exception):
        s.lr = 1.0
    assert TrainSettings(**OK, refine="none").refine is None


def _args(*extra):
    return build_parser().parse_args(["train", "--images", "i", "--labels", "l", "--out", "o", "--num-classes", "4",
                                      "--arch", "deeplabv3+", "--backbone", "resnet18", *extra])


def test_the_command_line_and_the_api_build_the_same_record():
    args = _args("--lr", "0.01", "--batch-size", "8", "--bn", "frozen", "--weights", "/x/r18.pth", "--no-amp",
                 "--workers", "0", "--max-memory", "2")
    cli = TrainSettings.from_args(args, 4)
    api = TrainSettings(num_classes=4, arch="deeplabv3+", backbone="resnet18", lr=0.01, batch_size=8, bn="frozen",
                        weights="/x/r18.pth", amp=False, workers=0, max_bytes=2 * 2 ** 30)
    assert cli == api


def test_round_trip_cli_record_checkpoint_record(tmp_path):
    s = TrainSettings.from_args(_args("--loss", "ce", "--iterations", "7", "--weights", "/w/resnet18.pth",
                                      "--crop", "64", "--min-size", "60", "--max-size", "90"), 4)
    rec = s.record(amp=False, stems=3, images="i", labels="l", world_size=1)
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"model": s.model, "iteration": 0, "student": {"w": torch.zeros(1)}, "settings": rec})
    back = TrainSettings.from_record(load_checkpoint(path)["settings"])
    assert back.record(amp=False) == s.record(amp=False)
    assert back.weights == "resnet18.pth" and back.iterations == 7 and back.loss == "ce"


def test_the_record_keeps_the_keys_and_values_older_runs_wrote():
    # what mars train wrote before the record existed (train.py at 3adb75c), for the same run
    old = dict(arch="deeplabv3+", backbone="resnet18", output_stride=16, num_classes=4, loss="mars", refine="crf",
               crf_params="mars", iterations=30000, batch_size=16, crop=512, min_size=320, max_size=640, lr=1e-3,
               momentum=0.9, weight_decay=4e-5, ema=0.999, poly_power=0.9, seed=0, bn="train", optimizer="sgd",
               weights="r.pth")
    new = TrainSettings(**OK, weights="/a/r.pth", output_stride=16, iterations=30000).record()
    assert {k: new[k] for k in old} == old
