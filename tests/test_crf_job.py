"""`mars crf` (issue 34, item 2): the dense CRF over a folder of a codebase's CAMs or of
probability maps, end to end on the sample trees of `mars sample`, whose images get CAM files in
each codebase's own format (the trees hold none): the batched job equals the adapter's own
per-image `cams_to_label`; --probs, --write probs; resume, --restart, a different run refused,
--on-error skip with a corrupt file, the output never inside an input."""
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin.cli import main
from mars_plugin.commands.crf_job import crf_job
from mars_plugin.commands.crf_settings import CrfSettings
from mars_plugin.runs.errors import JobError
from mars_plugin.commands.sample_trees import LAYOUTS, write_sample_tree
from mars_plugin.engines.crf_params import check_crf_params
from mars_plugin.formats.files import read_image

N, SIZE = 4, 40


def _cams_of(gt: np.ndarray, rng: np.random.Generator):
    """(0-based class ids, (K, H, W) float32 CAMs in [0, 1]) of the classes of a ground truth."""
    ids = sorted(int(c) for c in np.unique(gt) if 0 < c < 255)
    maps = [np.clip((gt == c) * 0.8 + rng.uniform(0, 0.3, gt.shape), 0, 1).astype(np.float32) for c in ids]
    return np.array([c - 1 for c in ids], dtype=np.int64), np.stack(maps) if maps else np.zeros((0,) + gt.shape,
                                                                                                 np.float32)


def _write_cams(tree: str, root: Path, folder: Path) -> None:
    """One CAM file per image, in ``tree``'s format (what its ``load_cams`` reads)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for p in sorted((root / LAYOUTS[tree]["gt"]).glob("*.png")):
        gt = np.asarray(Image.open(p))
        keys0, cam = _cams_of(gt, rng)
        if tree in ("irnet", "advcam"):
            np.save(folder / f"{p.stem}.npy", {"keys": keys0, "cam": cam[:, ::4, ::4], "high_res": cam})
        elif tree == "seam":
            np.save(folder / f"{p.stem}.npy", {int(k): m for k, m in zip(keys0, cam)})
        elif tree == "rsepm":
            with open(folder / f"{p.stem}.pkl", "wb") as f:
                pickle.dump({"keys": np.concatenate([[0], keys0 + 1]), "seed": cam}, f)
        else:  # dhr: the softmax of background and classes, fp16
            probs = np.concatenate([1 - cam.max(0, keepdims=True) ** 0.5, cam])
            probs = probs / probs.sum(0, keepdims=True)
            torch.save({"keys": torch.from_numpy(np.concatenate([[0], keys0 + 1])),
                        "masks": torch.from_numpy(probs).half()}, folder / f"{p.stem}.pt")


@pytest.fixture(scope="module", params=["irnet", "advcam", "seam", "rsepm", "dhr"])
def tree(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(f"crf_{name}")
    write_sample_tree(name, root, num_images=N, size=SIZE, seed=0)
    _write_cams(name, root, root / "cams")
    return name, root, root / LAYOUTS[name]["images"]


def _labels(folder: Path):
    return {p.stem: np.asarray(Image.open(p)) for p in sorted(folder.glob("*.png"))}


def test_each_codebase_equals_its_adapter_per_image(tree, tmp_path, monkeypatch):
    """The batched job (3 images per CRF call, on the sample tree) writes, per file, the label of
    the adapter's own cams_to_label with the image (its CRF, one image at a time)."""
    name, root, images = tree
    from mars_plugin.commands.label_formats import _adapter
    import mars_plugin.commands.crf_job as job

    adapter = _adapter(name)
    real, maps_per_call = job._crf_batch, []

    def counted(items, *a):
        maps_per_call.append(sum(len(it["maps"]) for it in items))
        return real(items, *a)

    monkeypatch.setattr(job, "_crf_batch", counted)
    s = crf_job(images, tmp_path / "out", cams_dir=root / "cams", wsss=name, trust_pickle=True, batch_size=3,
                progress=False)
    assert s.done == N and not s.failed
    got = _labels(tmp_path / "out")
    assert len(got) == N
    ext = {"rsepm": ".pkl", "dhr": ".pt"}.get(name, ".npy")
    for stem, label in got.items():
        cams = adapter.load_cams(root / "cams" / f"{stem}{ext}", trust_pickle=True)
        img = read_image(next(images.glob(f"{stem}.*")))
        want = adapter.cams_to_label(cams, image=img).numpy()
        np.testing.assert_array_equal(label, want)
        assert Image.open(tmp_path / "out" / f"{stem}.png").mode == "P"
    assert max(maps_per_call) > 1  # several maps went through one CRF call


def test_the_codebase_own_crf_is_the_default(tree, tmp_path):
    """--wsss X without --crf records X's own CRF (the adapter's CRF_PARAMS), and the presets by
    the codebases' names hold them."""
    name, root, images = tree
    from mars_plugin.commands.label_formats import _adapter

    own = {k: v for k, v in _adapter(name).CRF_PARAMS.items() if k != "gt_prob"}
    assert CrfSettings(wsss=name).params == check_crf_params(own) == check_crf_params(name)


def test_probs_folder_labels_and_probs(tmp_path):
    """--probs: .npy and .pt maps (channel = class id) give the argmax of the CRF's marginals as
    labels, and the marginals themselves with --write probs (float16 as asked)."""
    from mars_plugin.engines.crf import dense_crf

    root = tmp_path / "t"
    write_sample_tree("seam", root, num_images=3, size=SIZE, seed=1)
    images = root / LAYOUTS["seam"]["images"]
    rng = np.random.default_rng(1)
    (tmp_path / "probs").mkdir()
    want = {}
    for i, p in enumerate(sorted(images.iterdir())):
        q = rng.dirichlet(np.ones(5), size=(SIZE, SIZE)).transpose(2, 0, 1).astype(np.float32)
        if i % 2:
            torch.save(torch.from_numpy(q), tmp_path / "probs" / f"{p.stem}.pt")
        else:
            np.save(tmp_path / "probs" / f"{p.stem}.npy", q)
        want[p.stem] = dense_crf(torch.from_numpy(q), read_image(p), "mars").numpy()
    assert crf_job(images, tmp_path / "lab", probs_dir=tmp_path / "probs", progress=False).done == 3
    for stem, label in _labels(tmp_path / "lab").items():
        np.testing.assert_array_equal(label, want[stem].argmax(0))
    s = crf_job(images, tmp_path / "pr", probs_dir=tmp_path / "probs", write="probs", probs_dtype="float16",
                progress=False)
    assert s.done == 3
    for stem, q in want.items():
        got = np.load(tmp_path / "pr" / f"{stem}.npy", allow_pickle=False)
        assert got.dtype == np.float16 and got.shape == q.shape
        np.testing.assert_allclose(got, q, atol=1e-3)


def test_write_probs_by_class_id(tmp_path):
    """SEAM's CAMs with --write probs: (21, H, W) marginals, zero where the image has no class,
    whose argmax through the class ids is the label the job writes."""
    root = tmp_path / "t"
    write_sample_tree("seam", root, num_images=2, size=SIZE, seed=2)
    _write_cams("seam", root, root / "cams")
    images = root / LAYOUTS["seam"]["images"]
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # every .npy written is closed by the job
        warnings.simplefilter("always", ResourceWarning)
        crf_job(images, tmp_path / "p", cams_dir=root / "cams", wsss="seam", trust_pickle=True, write="probs",
                progress=False)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    crf_job(images, tmp_path / "l", cams_dir=root / "cams", wsss="seam", trust_pickle=True, progress=False)
    from mars_plugin.adapters.wsss import seam

    for stem, label in _labels(tmp_path / "l").items():
        q = np.load(tmp_path / "p" / f"{stem}.npy")
        assert q.shape == (21, SIZE, SIZE) and q.dtype == np.float32
        ids = {0} | set(seam.load_cams(root / "cams" / f"{stem}.npy", trust_pickle=True)["keys"].tolist())
        assert len(ids) > 1 and all(not q[c].any() for c in range(21) if c not in ids)
        np.testing.assert_allclose(q.sum(0), 1, atol=1e-4)
        np.testing.assert_array_equal(q.argmax(0), label)


def test_irnet_probs_refused_by_name():
    with pytest.raises(ValueError, match="write='probs' with wsss='irnet'"):
        CrfSettings(wsss="irnet", write="probs")


@pytest.fixture()
def rsepm(tmp_path):
    root = tmp_path / "t"
    write_sample_tree("rsepm", root, num_images=N, size=SIZE, seed=3)
    _write_cams("rsepm", root, root / "cams")
    return root / "cams", root / LAYOUTS["rsepm"]["images"]


def test_resume_after_an_interruption(rsepm, tmp_path, monkeypatch):
    """A run killed after two files resumes with them kept, writes the others, and the folder
    equals one uninterrupted run."""
    cams, images = rsepm
    import mars_plugin.commands.crf_job as job

    real, calls = job._finish, []

    def dies(j):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(j[0])
        return real(j)

    monkeypatch.setattr(job, "_finish", dies)
    with pytest.raises(KeyboardInterrupt):
        crf_job(images, tmp_path / "out", cams_dir=cams, wsss="rsepm", trust_pickle=True, batch_size=2,
                progress=False)
    monkeypatch.setattr(job, "_finish", real)
    s = crf_job(images, tmp_path / "out", cams_dir=cams, wsss="rsepm", trust_pickle=True, progress=False)
    assert (s.existing, s.done) == (2, N - 2)
    crf_job(images, tmp_path / "once", cams_dir=cams, wsss="rsepm", trust_pickle=True, progress=False)
    assert json.dumps({k: v.tolist() for k, v in _labels(tmp_path / "out").items()}) == \
        json.dumps({k: v.tolist() for k, v in _labels(tmp_path / "once").items()})
    assert crf_job(images, tmp_path / "out", cams_dir=cams, wsss="rsepm", trust_pickle=True,
                   progress=False).existing == N


def test_other_settings_refused_on_resume_unless_restart(rsepm, tmp_path):
    cams, images = rsepm
    crf_job(images, tmp_path / "out", cams_dir=cams, wsss="rsepm", trust_pickle=True, progress=False)
    with pytest.raises(JobError, match="other settings"):
        crf_job(images, tmp_path / "out", cams_dir=cams, wsss="rsepm", trust_pickle=True, crf="psa", progress=False)
    s = crf_job(images, tmp_path / "out", cams_dir=cams, wsss="rsepm", trust_pickle=True, crf="psa", restart=True,
                progress=False)
    assert s.done == N and s.existing == 0


def test_on_error_skip_names_the_corrupt_file(rsepm, tmp_path, capsys):
    cams, images = rsepm
    bad = sorted(cams.iterdir())[1]
    bad.write_bytes(b"not a pickle")
    with pytest.raises(JobError, match=bad.stem):
        crf_job(images, tmp_path / "a", cams_dir=cams, wsss="rsepm", trust_pickle=True, progress=False)
    rc = main(["crf", "--cams", str(cams), "--wsss", "rsepm", "--trust-pickle", "--images", str(images),
               "--out", str(tmp_path / "b"), "--on-error", "skip", "--no-progress"])
    assert rc == 1
    assert bad.stem in capsys.readouterr().err
    assert sorted(p.stem for p in (tmp_path / "b").glob("*.png")) == sorted(p.stem for p in cams.iterdir()
                                                                             if p != bad)


def test_pickles_need_the_trust_flag(rsepm, tmp_path):
    cams, images = rsepm
    with pytest.raises(JobError, match="trust_pickle"):
        crf_job(images, tmp_path / "a", cams_dir=cams, wsss="rsepm", progress=False)


def test_out_inside_an_input_refused(rsepm, capsys):
    cams, images = rsepm
    rc = main(["crf", "--cams", str(cams), "--wsss", "rsepm", "--trust-pickle", "--images", str(images),
               "--out", str(cams / "crf")])
    assert rc == 2
    assert "--out" in capsys.readouterr().err and not (cams / "crf").exists()
    with pytest.raises(JobError, match="--out .* lies inside --images"):  # the Python API refuses it too
        crf_job(images, images / "crf", cams_dir=cams, wsss="rsepm", trust_pickle=True, progress=False)
    assert not (images / "crf").exists()


@pytest.mark.slow
def test_workers_write_the_same_files(rsepm, tmp_path):
    """--workers 2 (decoding and encoding in spawned processes) writes what --workers 0 writes."""
    cams, images = rsepm
    crf_job(images, tmp_path / "w0", cams_dir=cams, wsss="rsepm", trust_pickle=True, progress=False)
    crf_job(images, tmp_path / "w2", cams_dir=cams, wsss="rsepm", trust_pickle=True, workers=2, batch_size=3,
            progress=False)
    a, b = _labels(tmp_path / "w0"), _labels(tmp_path / "w2")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_writes_what_the_cpu_writes(tmp_path):
    """--device cuda (the batched CRF on the GPU) writes the CPU run's labels (to 1e-4 of the
    pixels) and its marginals (to 1e-4): images of different sizes in one batch."""
    rng = np.random.default_rng(5)
    for d in ("images", "probs"):
        (tmp_path / d).mkdir()
    for i, (H, W) in enumerate([(40, 56), (48, 40), (40, 56), (33, 47)]):
        Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).save(tmp_path / "images" / f"im{i}.png")
        q = rng.dirichlet(np.ones(6), size=(H, W)).transpose(2, 0, 1).astype(np.float32)
        np.save(tmp_path / "probs" / f"im{i}.npy", q)
    for write in ("labels", "probs"):
        for dev in ("cpu", "cuda"):
            crf_job(tmp_path / "images", tmp_path / f"{write}_{dev}", probs_dir=tmp_path / "probs", write=write,
                    device=dev, batch_size=3, progress=False)
    a, b = _labels(tmp_path / "labels_cpu"), _labels(tmp_path / "labels_cuda")
    assert a.keys() == b.keys() and sum((a[k] != b[k]).sum() for k in a) <= 1e-4 * sum(v.size for v in a.values())
    for p in sorted((tmp_path / "probs_cpu").glob("*.npy")):
        np.testing.assert_allclose(np.load(tmp_path / "probs_cuda" / p.name), np.load(p), rtol=0, atol=1e-4)


def test_labels_from_a_device_argmax_equal_the_host_argmax():
    """On a GPU, --probs to labels takes the argmax on the device and sends back (H, W): the
    label written from it equals the one from the (L, H, W) marginals, ties included (both
    take the first maximum)."""
    from mars_plugin.commands.crf_job import _output

    rng = np.random.default_rng(2)
    q = rng.integers(0, 3, (5, 9, 11)).astype(np.float32)  # many ties
    item = {"ids": np.arange(5), "size": (9, 11)}
    cfg = {"write": "labels", "wsss": None}
    host = _output(item, [q], cfg)
    device = _output(item, [torch.from_numpy(q).argmax(0).numpy()], cfg)
    assert host.dtype == device.dtype == np.uint8
    np.testing.assert_array_equal(host, device)
    np.testing.assert_array_equal(host, q.argmax(0))


def test_half_maps_give_the_float32_maps_labels(tmp_path):
    """float16 maps travel as float16 and widen on the device: the same files as the same maps
    stored as float32."""
    rng = np.random.default_rng(4)
    for d in ("images", "p16", "p32"):
        (tmp_path / d).mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (30, 38, 3), dtype=np.uint8)).save(tmp_path / "images" / f"im{i}.png")
        q = rng.dirichlet(np.ones(4), size=(30, 38)).transpose(2, 0, 1).astype(np.float16)
        np.save(tmp_path / "p16" / f"im{i}.npy", q)
        np.save(tmp_path / "p32" / f"im{i}.npy", q.astype(np.float32))
    for src in ("p16", "p32"):
        crf_job(tmp_path / "images", tmp_path / f"o_{src}", probs_dir=tmp_path / src, write="probs", progress=False)
    for p in sorted((tmp_path / "o_p32").glob("*.npy")):
        np.testing.assert_array_equal(np.load(tmp_path / "o_p16" / p.name), np.load(p))


def test_probs_with_more_channels_than_png_ids_refused_for_labels(tmp_path):
    """A --probs map of 255 channels cannot become a label PNG (ids 254 and 255 mean biased and
    ignore, 256 would wrap): the file fails by name, and --write probs still takes it."""
    (tmp_path / "images").mkdir()
    (tmp_path / "probs").mkdir()
    Image.fromarray(np.zeros((6, 7, 3), np.uint8)).save(tmp_path / "images" / "a.png")
    np.save(tmp_path / "probs" / "a.npy", np.full((255, 6, 7), 1 / 255, np.float32))
    with pytest.raises(JobError, match="a: the probability map has 255 channels"):
        crf_job(tmp_path / "images", tmp_path / "lab", probs_dir=tmp_path / "probs", progress=False)
    assert crf_job(tmp_path / "images", tmp_path / "pr", probs_dir=tmp_path / "probs", write="probs",
                   crf_params={"iterations": 1}, progress=False).done == 1


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match="crf must be one of"):
        CrfSettings(crf="nope")
    with pytest.raises(ValueError, match=r"crf_params\['iterations'\]"):
        CrfSettings(crf_params={"iterations": 0})
    assert CrfSettings(crf="irnet", crf_params={"iterations": 3}).params["bilateral_srgb"] == 5


def test_input_flags_refused_by_name(rsepm, tmp_path, capsys):
    """--cams without --wsss, --probs with it, both or neither: one line naming the flags."""
    cams, images = rsepm
    base = ["crf", "--images", str(images), "--out", str(tmp_path / "o"), "--no-progress"]
    cases = [(["--cams", str(cams)], "--cams needs --wsss"),
             (["--probs", str(cams), "--wsss", "rsepm"], "--probs takes plain probability maps; --wsss rsepm"),
             (["--cams", str(cams), "--probs", str(cams), "--wsss", "rsepm"], "one of them, not both"),
             ([], "give --cams DIR")]
    for extra, msg in cases:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_probs_cli_writes_probs(tmp_path, capsys):
    """mars crf --probs on the command line, --write probs, float16: (L, H, W) .npy files."""
    root = tmp_path / "t"
    write_sample_tree("seam", root, num_images=2, size=32, seed=5)
    images = root / LAYOUTS["seam"]["images"]
    (tmp_path / "p").mkdir()
    for p in images.iterdir():
        np.save(tmp_path / "p" / f"{p.stem}.npy", np.full((3, 32, 32), 1 / 3, np.float32))
    assert main(["crf", "--probs", str(tmp_path / "p"), "--images", str(images), "--out", str(tmp_path / "o"),
                 "--write", "probs", "--probs-dtype", "float16", "--no-progress"]) == 0
    assert "crf -> " in capsys.readouterr().out
    got = [np.load(f) for f in sorted((tmp_path / "o").glob("*.npy"))]
    assert len(got) == 2 and all(q.shape == (3, 32, 32) and q.dtype == np.float16 for q in got)
