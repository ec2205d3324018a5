"""The sample's tokenizer: one token per word of its captions, a `tokenizers` WordLevel model.

`ttt demo` trains with it (`ttt train --tokenizer`), and the checkpoint carries it to `ttt generate`. With the
byte-level default, a caption's colour and shape sit at positions that move with the length of the words before
them ("a red circle" / "a yellow circle"); with a token per word, "the colour of the first shape" is always the
second token, and a caption takes 8 positions instead of 48: the tiny model learns the captions it sees faster
(docs/performance.md#generation-quality). It is what a BPE trained on the sample's captions would learn: its
vocabulary is the 15 words of the domain.

The shipped file is `TOKENIZER_PATH`; `build_tokenizer()` makes it (a test checks that the two agree):

    python -c "from pipeline.sample.tokenizer import write_tokenizer; write_tokenizer()"
"""

from __future__ import annotations

from pathlib import Path

from pipeline.sample.domain import COLORS, RELATIONS, SHAPES

TOKENIZER_PATH = Path(__file__).parent / "assets" / "tokenizer.json"
PAD, UNKNOWN = "[PAD]", "[UNK]"
MAX_WORDS = 8  # the longest caption: "a yellow triangle right of a purple triangle"


def vocabulary() -> list[str]:
    """Pad first, then every word the sample's captions use, then the unknown word."""
    relation_words = dict.fromkeys(word for relation in RELATIONS for word in relation.split())
    return [PAD, "a", *COLORS, *SHAPES, *relation_words, UNKNOWN]


def build_tokenizer():  # -> tokenizers.Tokenizer (imported here: only regenerating the file needs the package)
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    words = vocabulary()
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=UNKNOWN))
    tokenizer.normalizer = normalizers.Lowercase()  # "A red circle" reads as the captions do
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.enable_truncation(MAX_WORDS)  # the model's text length (training/config.py's model_config)
    return tokenizer


def write_tokenizer(path: Path = TOKENIZER_PATH) -> None:
    build_tokenizer().save(str(path))
