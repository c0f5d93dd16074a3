"""End to end on a small generated world where "boat" leaks into "sea".

Sea is the biased object of boat: WSSS pseudo labels of boat images spill over the sea around the
boat, while in dog images the same sea is plain background. MARS must mark exactly the leaked sea
pixels -1 and keep the boat.
"""
import pytest
import torch
import torch.nn as nn

from mars_plugin import (
    EMATeacher,
    WCELoss,
    complement_labels,
    debias_labels,
    image_centroids,
    select_centroids,
)

SKY, SEA, GRASS, BOAT, DOG, ROCK = range(6)  # region kinds (prototypes of the embedding)
BG, C_BOAT, C_DOG = 0, 1, 2  # label ids
H = W = 24
D = 16


def make_world(seed: int, n_boat: int = 6, n_dog: int = 6, noise: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    # Orthonormal region prototypes (QR of a random matrix): kinds are unrelated in the embedding.
    protos = torch.linalg.qr(torch.randn(D, 6, generator=g)).Q.T.contiguous()
    # Distinct region colours, so the CRF's bilateral kernel sees the same edges as the embedding.
    palette = torch.tensor([[120, 170, 230], [20, 60, 140], [60, 150, 50], [200, 40, 40], [150, 110, 60], [90, 90, 90]],
                           dtype=torch.uint8)
    world = []
    for i in range(n_boat + n_dog):
        boat = i < n_boat
        kinds = torch.full((H, W), SKY, dtype=torch.long)
        kinds[H // 2 :] = SEA if boat else GRASS
        if not boat:
            kinds[:, : 6 + i % 3] = SEA  # sea as plain background of dog images
        kinds[: 3, :] = ROCK
        top, left = 6 + i % 4, 5 + (i * 3) % 7
        kinds[top : top + 8, left : left + 9] = BOAT if boat else DOG
        gt = torch.zeros(H, W, dtype=torch.long)
        gt[kinds == (BOAT if boat else DOG)] = C_BOAT if boat else C_DOG
        pseudo = gt.clone()
        if boat:  # the biased object: sea under and around the boat labelled "boat"
            pseudo[top + 8 : top + 13, max(0, left - 3) : left + 12] = C_BOAT
        pseudo[0, 0] = 255  # an ignore pixel
        feats = protos[kinds].permute(2, 0, 1) + noise * torch.randn(D, H, W, generator=g)
        rgb = palette[kinds] + torch.randint(0, 20, (H, W, 3), generator=g, dtype=torch.uint8)
        world.append(dict(features=feats, pseudo=pseudo, gt=gt, kinds=kinds, image=rgb,
                          classes=[C_BOAT] if boat else [C_DOG]))
    return world


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("refine", ["threshold", "crf"])
def test_leaked_sea_becomes_biased_and_boat_is_kept(seed, refine):
    world = make_world(seed)
    V = select_centroids(((w["features"], w["pseudo"]) for w in world), num_classes=2, seed=seed)
    assert V.valid.tolist() == [False, True, True]
    for w in world:
        y = debias_labels(w["features"], w["pseudo"], V, w["classes"], image=w["image"], refine=refine)
        leaked = (w["pseudo"] == C_BOAT) & (w["kinds"] == SEA)
        target = (w["pseudo"] > 0) & (w["pseudo"] != 255) & ~leaked
        if leaked.any():
            assert bool((y[leaked] == -1).all()), "every leaked sea pixel must be marked biased"
        assert torch.equal(y[target], w["pseudo"][target]), "true object pixels must be kept"
        assert torch.equal(y[w["pseudo"] == 0], w["pseudo"][w["pseudo"] == 0])
        assert y[0, 0] == 255


def test_selected_boat_centroid_is_the_boat_not_the_sea():
    world = make_world(5)
    per_image = [image_centroids(w["features"], w["pseudo"]) for w in world]
    V = select_centroids(per_image, num_classes=2)
    boat_proto = torch.stack([w["features"][:, w["kinds"] == BOAT].mean(1) for w in world[:6]]).mean(0)
    sea_proto = torch.stack([w["features"][:, w["kinds"] == SEA].mean(1) for w in world]).mean(0)
    cos = torch.nn.functional.cosine_similarity
    assert cos(V.centroids[C_BOAT], boat_proto, dim=0) > 0.95
    assert cos(V.centroids[C_BOAT], sea_proto, dim=0) < 0.5
    # Without other images' background the two boat clusters could not be told apart: the
    # candidates closest to the background (the sea) are the ones left out.
    assert V.num_candidates[C_BOAT] == 12 and V.num_selected[C_BOAT] == 5


def test_training_step_wiring_complement_wce_ema():
    """One segmentation step with the three calls: loss finite, grads flow, teacher moves."""
    world = make_world(3, n_boat=2, n_dog=2)
    V = select_centroids(((w["features"], w["pseudo"]) for w in world), num_classes=2)
    y_db = torch.stack([debias_labels(w["features"], w["pseudo"], V, w["classes"], refine="threshold") for w in world])
    x = torch.stack([w["image"].permute(2, 0, 1).float() / 255 for w in world])
    classes = [w["classes"] for w in world]
    torch.manual_seed(0)
    student = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 3, 1))
    teacher = EMATeacher(student, momentum=0.9)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    before = [p.clone() for p in teacher.parameters()]
    y_co, w = complement_labels(y_db, teacher(x).softmax(1), classes)
    assert not bool((y_co == -1).any())
    assert torch.equal(y_co[y_db != -1], y_db[y_db != -1])
    loss = WCELoss()(student(x), y_co, w)
    assert torch.isfinite(loss)
    opt.zero_grad()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in student.parameters())
    opt.step()
    teacher.update(student)
    assert any(not torch.equal(a, b) for a, b in zip(before, teacher.parameters()))
