"""The client's restatement of the gateway's draws (`tensorgate.augment`): fixed values shared
with the gateway's unit tests (`src/pushdown/augment.rs`), the spec it sends, torchvision
transforms read off, and its reference pipeline against torchvision's own ops."""


import numpy as np
import pytest
from PIL import Image

from tensorgate.augment import Augment, Draws, Drawn


def test_the_generator_and_boxes_match_the_gateways_unit_tests():
    d = Draws(0, "k")
    assert [d.draw(n) for n in range(3)] == [0x142BED6364D6DEE5, 0x55CEB35FF5AA4BDA, 0xF3EBA21745386B34]
    a = Augment(seed=42)
    assert a.draw("img/0.jpg", 500, 375) == Drawn((166, 253, 179, 218), True)
    assert a.draw("a", 64, 2000) == Drawn((957, 0, 85, 64), False)
    assert a.draw("b", 2000, 64) == Drawn((0, 957, 64, 85), False)
    assert Augment(seed=5, flip=None).draw("k", 1, 1000) == Drawn((499, 0, 1, 1), False)
    assert Drawn.parse("166,253,179,218,1") == Drawn((166, 253, 179, 218), True)
    assert Drawn.parse(",,,,0") == Drawn(None, False)


def test_the_spec_names_torchvisions_transforms_with_numbers_read_back_exactly():
    assert Augment(seed=3).fields() == {
        "augment": "RandomResizedCrop(scale=0.08:1,ratio=0.75:1.3333333333333333);RandomHorizontalFlip(p=0.5)",
        "seed": "3",
    }
    assert Augment(seed=3, crop=False, flip=1.0).spec() == "RandomHorizontalFlip(p=1)"
    assert Augment(seed=3, flip=None, scale=(0.25, 1.0)).spec() == "RandomResizedCrop(scale=0.25:1,ratio=0.75:1.3333333333333333)"


def test_torchvision_transforms_are_read_off_and_others_refused():
    from torchvision import transforms as T

    recipe = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomHorizontalFlip(0.3), T.ToTensor(),
                        T.Normalize([0.5] * 3, [0.5] * 3)])
    a = Augment.from_torchvision(recipe, seed=9)
    assert (a.crop, a.scale, a.ratio, a.flip, a.seed) == (True, (0.2, 1.0), (3 / 4, 4 / 3), 0.3, 9)
    with pytest.raises(ValueError):
        Augment.from_torchvision([T.RandomResizedCrop(224), T.ColorJitter(0.4)], seed=0)
    with pytest.raises(ValueError):
        Augment.from_torchvision([T.RandomResizedCrop(224, interpolation=T.InterpolationMode.NEAREST)], seed=0)


def test_the_reference_pipeline_equals_torchvisions_ops():
    from torchvision.transforms.v2 import functional as F

    rng = np.random.default_rng(0)
    img = Image.fromarray((rng.random((300, 411, 3)) * 255).astype(np.uint8))
    a = Augment(seed=1, flip=1.0)
    got, drawn = a.apply(img, "k", size=(64, 48))
    top, left, h, w = drawn.box
    want = F.horizontal_flip(F.resized_crop(img, top, left, h, w, [64, 48], antialias=True))
    assert drawn.flip and got.size == (48, 64)
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_epochs_and_keys_draw_independently():
    a = Augment(seed=5)
    assert a.for_epoch(0) == Augment(seed=5).for_epoch(0) and a.for_epoch(0).seed != a.for_epoch(1).seed
    boxes = {a.draw(f"k{i}", 640, 480).box for i in range(100)}
    assert len(boxes) > 95
    flips = sum(a.draw(f"k{i}", 640, 480).flip for i in range(400))
    assert 150 < flips < 250
