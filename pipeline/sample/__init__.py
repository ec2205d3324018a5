"""The embedded sample: a synthetic image-caption collection in LAION's format (`domain`), and the judge that
says whether an image of its domain shows what its caption says (`judge`)."""

SAMPLE_VERSION = 2  # 2: no row shows a held-out layout (domain.is_heldout_layout)
DEFAULT_SAMPLE_ROWS = 1200
MIN_SAMPLE_ROWS = 100  # so that every defect appears at least once
DEFAULT_SAMPLE_PORT = 18753  # where `ttt preprocess` serves the sample's images on 127.0.0.1
