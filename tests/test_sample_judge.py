import numpy as np
import pytest
from PIL import Image

from pipeline.sample.domain import COLORS, SHAPES, Scene, Shape, random_scene, render_scene, render_stored
from pipeline.sample.judge import judge, parse_caption

OPPOSITE = {"above": "below", "below": "above", "left of": "right of", "right of": "left of"}


def scenes(count: int, seed: int = 0) -> list[Scene]:
    rng = np.random.default_rng(seed)
    return [random_scene(rng) for _ in range(count)]


def test_exact_on_the_sample_renderings():
    for index, scene in enumerate(scenes(400)):
        assert judge(render_scene(scene, 64, 64), scene.caption).match, scene.caption
        assert judge(render_stored(scene, 96 + index % 65, 64), scene.caption).match, scene.caption


def other(options, current):
    return next(option for option in options if option != current)


def test_rejects_wrong_colour_shape_relation_and_count():
    for scene in scenes(200, seed=1):
        image = render_scene(scene, 64, 64)
        first = scene.first
        wrong_colour = Scene(Shape(other(COLORS, first.color), first.shape), scene.second, scene.relation)
        wrong_shape = Scene(Shape(first.color, other(SHAPES, first.shape)), scene.second, scene.relation)
        for wrong in (wrong_colour, wrong_shape):
            if wrong.second is None or wrong.first != wrong.second:
                assert not judge(image, wrong.caption).match, (scene.caption, wrong.caption)
        if scene.second is not None:
            flipped = Scene(first, scene.second, OPPOSITE[scene.relation])
            assert not judge(image, flipped.caption).match, (scene.caption, flipped.caption)
            assert not judge(image, Scene(first).caption).match  # one object named, two drawn
        else:
            extra = Scene(first, Shape(other(COLORS, first.color), first.shape), "above")
            assert not judge(image, extra.caption).match


def test_the_same_scene_said_the_other_way_round_matches():
    scene = Scene(Shape("red", "circle"), Shape("blue", "square"), "above")
    image = render_scene(scene, 64, 64)
    assert judge(image, "a blue square below a red circle").match


@pytest.mark.parametrize("caption", ["a dog", "a red circle next to a blue square", ""])
def test_captions_outside_the_grammar_never_match(caption):
    verdict = judge(render_scene(Scene(Shape("red", "circle")), 64, 64), caption)
    assert not verdict.match and "grammar" in verdict.reasons[0]
    assert parse_caption(caption) is None


def test_an_empty_or_noisy_image_does_not_match():
    assert not judge(Image.new("RGB", (64, 64), (24, 24, 24)), "a red circle").match
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert not judge(Image.fromarray(noise), "a red circle").match
