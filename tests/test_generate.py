"""`ttt generate`: KV-cached sampling, logit filtering, the CLI end to end, and refusing a mismatched VQGAN."""

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from inference.sample_quality import HELDOUT_PROMPTS, SEEN_PROMPTS
from inference.sampling import filter_logits, sample_codes, sample_next
from inference.settings import SamplingSettings
from pipeline.vqgan.codec import sample_vqgan_spec
from tests.support.commands import run_ttt
from training.checkpoint import save_checkpoint
from training.config import PRESETS, ModelConfig
from training.model import DalleTransformer, KVCache

# Small enough to sample quickly, big enough that every pattern restricts: a 6x6 grid, a 3x3 conv.
SMALL = {"text_len": 8, "grid": 6, "width": 32, "layers": 6, "heads": 2, "head_dim": 16, "conv_kernel": 3}


def random_model(seed: int = 0, **overrides) -> DalleTransformer:
    torch.manual_seed(seed)
    return DalleTransformer(ModelConfig(**{**SMALL, **overrides})).eval()


def cached_hidden_states(model: DalleTransformer, text: torch.Tensor, codes: torch.Tensor, step) -> tuple:
    """The text through a new cache in one go, then the codes but the last one at a time through
    `step(embedded code, its position, cache)`: (the hidden states of every position, the cache)."""
    cache = KVCache(model.config, len(text), torch.device("cpu"), torch.float64)
    hidden = [model.run_layers(model.text_embedding(text), cache)]
    for position in range(model.config.image_tokens - 1):
        embedded = model.image_embedding(codes[:, position : position + 1])
        hidden.append(step(embedded, model.config.text_len + position, cache))
    return torch.cat(hidden, dim=1), cache


@pytest.mark.parametrize("share_groups", [True, False])
def test_cached_hidden_states_equal_the_full_forward_pass(share_groups):
    model = random_model(share_groups=share_groups).double()
    config = model.config
    text = torch.randint(0, 256, (3, config.text_len))
    codes = torch.randint(0, config.codebook_size, (3, config.image_tokens))
    with torch.no_grad():
        full = model.hidden_states(text, codes)
        steps, cache = cached_hidden_states(model, text, codes, lambda x, _, cache: model.run_layers(x, cache))
    assert cache.length == config.input_len
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-12)


def test_a_step_over_the_whole_cache_gives_the_logits_of_the_full_forward_pass():
    # What CachedStep records as a CUDA graph: the same shapes at every position (a position tensor, attention over
    # the whole cache), the not yet written keys hidden by the mask row.
    model = random_model().double()
    config = model.config
    text = torch.randint(0, 256, (3, config.text_len))
    codes = torch.randint(0, config.codebook_size, (3, config.image_tokens))

    def whole_cache_step(embedded, position, cache):
        return model.run_positions(embedded, torch.tensor([position]), config.input_len, cache)

    with torch.no_grad():
        full = model.image_logits(model.hidden_states(text, codes)[:, config.text_len - 1 :])
        steps, _ = cached_hidden_states(model, text, codes, whole_cache_step)
        logits = model.image_logits(steps[:, config.text_len - 1 :])
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingSettings(temperature=0),
        SamplingSettings(top_p=1),
        SamplingSettings(top_k=20, top_p=1),
        SamplingSettings(top_p=0.75),
    ],
    ids=["greedy", "plain", "top-k", "top-p"],
)
def test_kv_cached_sampling_draws_exactly_the_codes_of_full_recomputation(sampling):
    # float64 so that the two orders of summation cannot round a draw across a bin edge.
    model = random_model(seed=1).double()
    text = torch.randint(0, 256, (4, model.config.text_len))
    cached = sample_codes(model, text, sampling, torch.Generator().manual_seed(7))
    recomputed = sample_codes(model, text, sampling, torch.Generator().manual_seed(7), use_cache=False)
    assert torch.equal(cached, recomputed)
    assert cached.shape == (4, model.config.image_tokens)
    if sampling.temperature > 0:  # different rows of the batch draw different codes
        assert not torch.equal(cached[0], cached[1])


def test_top_k_keeps_the_k_largest_logits_in_place():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0], [4.0, 0.0, 1.0, 2.0, 3.0]])
    kept = filter_logits(logits, top_k=2)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True, False], [True, False, False, False, True]]
    assert torch.equal(kept[torch.isfinite(kept)], logits[torch.isfinite(kept)])
    assert torch.equal(filter_logits(logits, top_k=0), logits) and torch.equal(filter_logits(logits, top_k=9), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Probabilities 0.1, 0.5, 0.05, 0.3, 0.05 (unsorted, so the mapping back to vocabulary order is checked).
    logits = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05]]).log()
    finite = lambda p: torch.isfinite(filter_logits(logits, top_p=p))[0].tolist()  # noqa: E731
    assert finite(0.5) == [False, True, False, False, False]  # 0.5 alone reaches 0.5
    assert finite(0.75) == [False, True, False, True, False]  # 0.5 + 0.3 = 0.8 reaches 0.75
    assert finite(0.85) == [True, True, False, True, False]  # ... + 0.1 = 0.9
    assert finite(0.01) == [False, True, False, False, False]  # the most likely code always stays
    assert finite(1.0) == [True] * 5
    # Top-k first, then top-p over what is left: renormalised 0.5/0.8 = 0.625 reaches 0.6.
    both = torch.isfinite(filter_logits(logits, top_k=2, top_p=0.6))[0].tolist()
    assert both == [False, True, False, False, False]


def test_sample_next_draws_only_kept_codes_and_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05]]).log().expand(2000, -1)
    drawn = sample_next(logits, SamplingSettings(top_p=0.75), torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {1, 3}
    share = (drawn == 1).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.04  # renormalised over the nucleus
    assert set(sample_next(logits, SamplingSettings(temperature=0), torch.Generator()).tolist()) == {1}
    with pytest.raises(ValueError):
        SamplingSettings(top_p=0)


def sample_info(**dataset) -> dict:
    """What `ttt train` records about the data a checkpoint learned from (here: the embedded sample)."""
    identity = sample_vqgan_spec().identity.__dict__
    return {"run_id": "test", "dataset": {"codebook_size": 512, "grid": [8, 8], "image_size": 64,
                                          "vqgan": identity, **dataset}, "tokenizer": "bytes"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    save_checkpoint(folder, DalleTransformer(PRESETS["tiny"].model), 5, sample_info())
    return folder


def test_generate_writes_pngs_of_the_vqgan_size_and_a_grid(tiny_checkpoint, tmp_path):
    prompt = "a red circle above a blue square"
    args = ["generate", prompt, "--checkpoint", tiny_checkpoint, "--num-samples", "3", "--batch-size", "2"]
    result = run_ttt(*args, "--out", tmp_path / "a", "--top-k", "100", "--seed", "3")
    images = sorted((tmp_path / "a").glob("*-0*.png"))
    assert [p.name for p in images] == [f"a-red-circle-above-a-blue-square-seed3-{i:03d}.png" for i in range(3)]
    assert all(Image.open(p).size == (64, 64) for p in images)  # 8x8 codes x the sample VQGAN's factor 8
    grid = Image.open(tmp_path / "a" / "a-red-circle-above-a-blue-square-seed3-grid.png")
    assert grid.width == 3 * 128 and grid.height > 128
    assert "3 sampled, 3 kept" in result.stdout and "global step 5" in result.stdout
    assert "sample judge" in result.stdout and "of 3 accepted" in result.stdout
    # The same seed draws the same images; --keep keeps the first K.
    run_ttt(*args, "--out", tmp_path / "b", "--top-k", "100", "--seed", "3", "--keep", "2")
    again = sorted((tmp_path / "b").glob("*-0*.png"))
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in images[:2]]


def test_a_checkpoint_pushed_to_the_hub_loads_through_huggingface_hub(tiny_checkpoint, tmp_path):
    """hf://ORG/NAME goes through hf_hub_download; offline, it answers from the Hub cache as a download left it."""
    snapshot = tmp_path / "hub" / "models--my-org--ttt-run" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_checkpoint, snapshot)
    (tmp_path / "hub" / "models--my-org--ttt-run" / "refs").mkdir()
    (tmp_path / "hub" / "models--my-org--ttt-run" / "refs" / "main").write_text("0" * 40)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = run_ttt("generate", "a red circle", "--checkpoint", "hf://my-org/ttt-run", "--num-samples", "1",
                     "--out", tmp_path / "out", env=env)  # fmt: skip
    assert "global step 5" in result.stdout and len(list((tmp_path / "out").glob("*.png"))) == 2


def test_a_mismatched_vqgan_or_checkpoint_is_refused_naming_both(tmp_path, tiny_checkpoint):
    torch.manual_seed(0)
    other_codebook = DalleTransformer(ModelConfig(codebook_size=1024))
    save_checkpoint(tmp_path / "codebook", other_codebook, 1, sample_info(codebook_size=1024))
    other_vqgan = sample_info(vqgan={**sample_vqgan_spec().identity.__dict__, "ckpt_sha256": "ab" * 32})
    save_checkpoint(tmp_path / "vqgan", DalleTransformer(PRESETS["tiny"].model), 1, other_vqgan)
    save_checkpoint(tmp_path / "size", DalleTransformer(PRESETS["tiny"].model), 1, sample_info(image_size=128))
    cases = [
        (["--checkpoint", tmp_path / "codebook"], "(8x8 codes from 1024) does not match VQGAN model.yaml (512 codes"),
        (["--checkpoint", tmp_path / "vqgan"], "trained on codes of model.yaml (checkpoint sha256 abababababab...)"),
        (["--checkpoint", tmp_path / "size"], "trained on 128 px images (factor 16), but the VQGAN model.yaml"),
        (["--checkpoint", tmp_path / "missing"], "does not exist; train one with `ttt train`"),
        (["--checkpoint", "hf://nobody/nothing"], "cannot fetch checkpoint hf://nobody/nothing from the Hub"),
        (["--checkpoint", tiny_checkpoint, "--keep", "9"], "--keep 9 must be between 1 and --num-samples 8"),
        (["--checkpoint", tiny_checkpoint, "--rerank-clip", "ViT-B-32"], "is not MODEL:WEIGHTS"),
        (["--checkpoint", tiny_checkpoint, "--rerank-clip", f"ViT-B-32:{tmp_path}/no.pt"], "do not exist"),
        (["--checkpoint", tiny_checkpoint, "--vqgan-config", tmp_path / "v.yaml"], "pass both --vqgan-config"),
    ]
    for args, message in cases:
        result = run_ttt("generate", "a red circle", "--out", tmp_path / "out", *args, check=False,
                         env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in result.stderr, (args, result.stderr)
        assert message in result.stderr.strip().splitlines()[-1], (args, result.stderr)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    """A randomly initialised open_clip model in a local-dir folder (real CLIP weights cannot be downloaded here)."""
    import open_clip

    folder = tmp_path_factory.mktemp("clip")
    vision = {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16}
    text = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}
    config = {"model_cfg": {"embed_dim": 32, "vision_cfg": vision, "text_cfg": text}}
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = open_clip.create_model(f"local-dir:{folder}", load_weights=False)
    torch.save(model.state_dict(), folder / "open_clip_pytorch_model.bin")
    return folder


def test_clip_reranking_keeps_the_most_similar_samples(tiny_checkpoint, tiny_clip, tmp_path):
    from inference.rerank import ClipReranker

    prompt = "a green square"
    args = ["generate", prompt, "--checkpoint", tiny_checkpoint, "--num-samples", "5", "--seed", "1"]
    run_ttt(*args, "--out", tmp_path / "all")
    result = run_ttt(*args, "--out", tmp_path / "best", "--keep", "2", "--rerank-clip", f"local-dir:{tiny_clip}")
    assert "5 sampled, 2 kept (CLIP re-ranked)" in result.stdout
    every = [Image.open(p).convert("RGB") for p in sorted((tmp_path / "all").glob("*-0*.png"))]
    scores = ClipReranker(f"local-dir:{tiny_clip}").scores(every, prompt)
    best = [every[i] for i in scores.argsort(descending=True)[:2].tolist()]
    kept = [Image.open(p).convert("RGB") for p in sorted((tmp_path / "best").glob("*-0*.png"))]
    assert [image.tobytes() for image in kept] == [image.tobytes() for image in best]


def test_heldout_prompts_never_occur_in_the_sample_and_seen_ones_do(tmp_path):
    """The default 1,200-row sample's captions (the demo trains on them), from its metadata: no row shows a held-out
    layout, in either phrasing, and the held-out prompts are such layouts."""
    from pipeline.sample.domain import Scene, is_heldout_layout, write_sample
    from pipeline.sample.judge import parse_caption

    metadata = write_sample(tmp_path, "http://127.0.0.1:1")
    captions = set(pq.read_table(metadata, columns=["TEXT"]).column("TEXT").to_pylist())
    scenes = [parse_caption(caption) for caption in captions]
    assert not any(is_heldout_layout(scene) for scene in scenes if scene is not None)
    mirrored = {"above": "below", "below": "above", "left of": "right of", "right of": "left of"}
    assert len(set(HELDOUT_PROMPTS)) == len(HELDOUT_PROMPTS) == 16
    for prompt in HELDOUT_PROMPTS:
        scene = parse_caption(prompt)
        mirror = Scene(scene.second, scene.first, mirrored[scene.relation])
        assert scene.second is not None and is_heldout_layout(scene)
        assert prompt not in captions and mirror.caption not in captions
    assert set(SEEN_PROMPTS) <= captions


def test_a_layout_is_what_the_picture_shows_and_its_swap_has_the_two_shapes_the_other_way_round():
    from pipeline.sample.domain import layout, swapped_layout
    from pipeline.sample.judge import parse_caption

    below = parse_caption("a red circle below a blue square")
    assert (
        layout(below)
        == layout(parse_caption("a blue square above a red circle"))
        == parse_caption("a blue square above a red circle")
    )
    assert swapped_layout(below) == parse_caption("a red circle above a blue square")
    assert swapped_layout(parse_caption("a red circle right of a blue square")) == parse_caption(
        "a red circle left of a blue square"
    )


def test_the_sample_tokenizer_reads_a_word_as_one_token_and_ships_as_built():
    from pipeline.core.text import load_tokenizer
    from pipeline.sample.domain import COLORS, RELATIONS, SHAPES
    from pipeline.sample.tokenizer import MAX_WORDS, TOKENIZER_PATH, build_tokenizer, vocabulary
    from training.config import model_config

    assert json.loads(TOKENIZER_PATH.read_text()) == json.loads(build_tokenizer().to_str())
    longest = f"a {max(COLORS, key=len)} {max(SHAPES, key=len)} {max(RELATIONS, key=len)} a yellow triangle"
    assert len(longest.split()) == MAX_WORDS == model_config("tiny", TOKENIZER_PATH).text_len  # no pad-only tail
    assert model_config("tiny", None).text_len == PRESETS["tiny"].model.text_len  # bytes: the preset's 48
    tokenizer = load_tokenizer(TOKENIZER_PATH)
    words = vocabulary()
    captions = [*SEEN_PROMPTS, *HELDOUT_PROMPTS, "A Red circle"]
    for caption, ids in zip(captions, tokenizer.encode_batch(captions, 10), strict=True):
        read = [words[i] for i in ids if i != tokenizer.pad_id]
        assert read == caption.lower().split(), caption
    assert words[tokenizer.encode_batch(["an orange circle"], 4)[0][0]] == "[UNK]"


def test_a_prompt_with_words_the_tokenizer_lacks_is_drawn_with_a_warning_that_names_them(tmp_path):
    from pipeline.sample.tokenizer import TOKENIZER_PATH
    from training.config import ModelConfig

    config = ModelConfig(**{**PRESETS["tiny"].model.to_dict(), "text_vocab_size": 17, "pad_id": 0})
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", DalleTransformer(config), 5, sample_info(), tokenizer=TOKENIZER_PATH)
    args = ["generate", "an orange circle", "--checkpoint", tmp_path / "ckpt", "--num-samples", "1"]
    result = run_ttt(*args, "--out", tmp_path / "out")
    assert "the model's tokenizer has no token for 'an', 'orange': each reads as its unknown token" in " ".join(
        result.stdout.split()
    )
    assert "tokenizer.json tokenizer" in result.stdout and len(list((tmp_path / "out").glob("*-000.png"))) == 1
    quiet = run_ttt("generate", "a red circle", "--checkpoint", tmp_path / "ckpt", "--num-samples", "1",
                    "--out", tmp_path / "out", "--json")  # fmt: skip
    assert "no token for" not in quiet.stdout + quiet.stderr
    drawn = json.loads(quiet.stdout)  # --json: the report alone on stdout
    assert drawn["prompt"] == "a red circle" and drawn["tokenizer"] == "tokenizer.json" and len(drawn["images"]) == 1
    assert Path(drawn["images"][0]).is_file() and Path(drawn["grid"]).is_file() and len(drawn["judged"]) == 1


def test_an_acceptance_interval_is_over_prompts_and_never_claims_certainty():
    from inference.sample_quality import Acceptance

    uneven = Acceptance({f"prompt {i}": count for i, count in enumerate([8, 8, 8, 8, 0, 0, 0, 0])}, 8)
    low, high = uneven.interval()
    assert low < 0.3 and high > 0.7  # half the prompts always pass, half never: the share is far from known
    even = Acceptance({f"prompt {i}": 4 for i in range(8)}, 8)
    assert even.interval()[1] - even.interval()[0] < high - low  # every prompt at half: known much better
    assert Acceptance({"a": 0, "b": 0}, 8).interval() == pytest.approx((0.0, 0.194), abs=0.01)  # Wilson, 0 of 16
    assert uneven.interval() == (low, high) and uneven.summary() == f"50% of 64 images (95% CI {low:.0%}-{high:.0%})"
