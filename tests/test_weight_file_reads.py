"""Issue 41, class 2: weight readers answer in one line.

Crafted MXNet ``.params`` files (``--recipe seam --weights``: an array declaring 100 GiB, a shape
whose byte count overflows 64 bits, the legacy layout declaring a huge shape) and a meta tensor in
a torchvision or deeplab-pytorch weight file: each is one line naming the file and the key, exit
2 on the command line, with memory bounded (nothing of the declared size is allocated: the
declared bytes are Python integers checked against the file and the read's bound first).
"""
import re
import struct

import pytest
import torch

from mars_plugin import cli
from mars_plugin.formats.mxnet_params import LIST_MAGIC, read_mxnet_params

from test_train import C, _tree

_V2 = 0xF993FAC9


def _v2_array(shape, flag=0):
    """One dense V2 array header declaring ``shape`` (dtype flag 0: float32), no values after it."""
    return (struct.pack("<Ii", _V2, 0) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}q", *shape)
            + struct.pack("<iii", 1, 0, flag))


def _legacy_array(shape, flag=0):
    """The legacy layout: the first word is the number of dimensions, the sizes are uint32."""
    return struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}I", *shape) + struct.pack("<iii", 1, 0, flag)


def _params(path, arrays, names):
    with open(path, "wb") as f:
        f.write(struct.pack("<QQQ", LIST_MAGIC, 0, len(arrays)))
        for a in arrays:
            f.write(a)
        f.write(struct.pack("<Q", len(names)))
        for n in names:
            f.write(struct.pack("<Q", len(n)) + n.encode())


#: case -> (the arrays, what the message says after "<path>: array N: ")
MXNET = {
    "100 GiB declared": ([_v2_array((100 * 2 ** 30 // 4,))],
                         r"array 0: a float32 array of shape \(26843545600,\) declares 107,374,182,400 bytes, above "
                         r"the 8,589,934,592 bytes this read allows"),
    "byte count overflows": ([_v2_array((2 ** 31, 2 ** 31))],  # 2**62 values, 2**64 bytes: past int64
                             r"array 0: a float32 array of shape \(2147483648, 2147483648\) declares "
                             r"18,446,744,073,709,551,616 bytes, above"),
    "legacy layout": ([_legacy_array((65536, 65536, 65536))],
                      r"array 0: a float32 array of shape \(65536, 65536, 65536\) declares "
                      r"1,125,899,906,842,624 bytes, above"),
    "second array past the file": ([_v2_array((2,)) + b"\0" * 8, _v2_array((1000, 1000))],
                                   r"array 1: declares a float32 array of shape \(1000, 1000\) \(4,000,000 bytes\), "
                                   r"but the file has 56 bytes left: a truncated or damaged MXNet .params file"),
}


@pytest.mark.parametrize("case", list(MXNET))
def test_a_crafted_mxnet_file_is_one_line_naming_the_file_and_the_array(tmp_path, case):
    arrays, match = MXNET[case]
    p = tmp_path / "w.params"
    _params(p, arrays, [f"arg:conv{i}_weight" for i in range(len(arrays))])
    with pytest.raises(ValueError) as e:
        read_mxnet_params(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: "), msg
    assert re.search(match, msg), msg


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return _tree(tmp_path_factory.mktemp("weights_tree"), n=2)


def _train(tree, out, weights, *extra):
    return cli.main(["train", "--images", str(tree / "images"), "--labels", str(tree / "pseudo"), "--out", str(out),
                     "--num-classes", str(C), "--loss", "ce", "--iterations", "1", "--batch-size", "2", "--crop", "32",
                     "--workers", "0", "--no-progress", "--weights", str(weights), *extra])


def _one_error_line(capsys, command="train"):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"mars {command}: error: "), err
    return err[0][len(f"mars {command}: error: "):]


@pytest.mark.parametrize("case", ["100 GiB declared", "byte count overflows", "legacy layout"])
def test_mars_train_recipe_seam_refuses_a_crafted_params_file_exit_2(tmp_path, tree, capsys, case):
    arrays, match = MXNET[case]
    p = tmp_path / "ilsvrc-cls_rna-a1_cls1000_ep-0001.params"
    _params(p, arrays, ["arg:conv1a_weight"])
    assert _train(tree, tmp_path / "run", p, "--recipe", "seam") == 2
    msg = _one_error_line(capsys)
    assert msg.startswith(f"{p}: ") and re.search(match, msg), msg
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def _meta_layout(path, net):
    """``net``'s state dict with every tensor on the meta device: a weight file that declares
    every shape and holds no value (a few kilobytes)."""
    torch.save(dict(net.state_dict()), path)
    return next(iter(net.state_dict()))


def test_a_meta_tensor_in_a_torchvision_weight_file_is_one_line_exit_2(tmp_path, tree, capsys):
    from mars_plugin.networks.resnet import ResNet

    with torch.device("meta"):
        net = ResNet("resnet18")
    p = tmp_path / "resnet18-f37072fd.pth"
    first = _meta_layout(p, net)
    assert _train(tree, tmp_path / "run", p, "--arch", "deeplabv3+", "--backbone", "resnet18") == 2
    msg = _one_error_line(capsys)
    assert re.fullmatch(rf"{re.escape(str(p))}: {re.escape(first)}: ImageNet --weights must be a CPU tensor whose "
                        r"values are in the file; it holds a meta-device torch.float32 tensor of shape \(64, 3, 7, "
                        r"7\) \(a meta tensor: a shape without data\)", msg), msg


def test_a_meta_tensor_in_a_deeplab_pytorch_weight_file_is_one_line_exit_2(tmp_path, tree, capsys):
    from mars_plugin.networks.deeplab import build_model

    with torch.device("meta"):
        net = build_model("deeplabv2", "resnet101", C)
    p = tmp_path / "deeplabv1_resnet101-coco.pth"
    first = _meta_layout(p, net)
    assert _train(tree, tmp_path / "run", p, "--recipe", "deeplab-pytorch") == 2
    msg = _one_error_line(capsys)
    assert re.fullmatch(rf"{re.escape(str(p))}: {re.escape(first)}: deeplab-pytorch --weights must be a CPU tensor "
                        r"whose values are in the file; it holds a meta-device torch.float32 tensor of shape .* "
                        r"\(a meta tensor: a shape without data\)", msg), msg


def test_a_weight_file_whose_tensor_is_a_stride_0_view_is_refused(tmp_path):
    """The door's rule for every weight reader: a view declaring more than its storage holds."""
    from mars_plugin.networks.deeplab import build_model, load_backbone_weights

    model = build_model("deeplabv3+", "resnet18", C)
    p = tmp_path / "resnet18.pth"
    torch.save({"conv1.weight": torch.zeros(1).expand(64, 3, 7, 7)}, p)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: conv1.weight: declares a torch.float32 tensor of "
                                         r"shape \(64, 3, 7, 7\) \(37,632 bytes\) over a storage of 4 bytes"):
        load_backbone_weights(model, p)
