"""The names and defaults of a dataset folder, with no imports: the CLI reads them at start-up.

./ttt-data/                             where `ttt preprocess` writes and the other commands read
  README.md                             the data card
  ttt_manifest.json                     the run's shards and settings
  data/train-00000-of-000NN.parquet     the shards (`shard_format.shard_path`)
"""

DEFAULT_DATASET = "./ttt-data"
DATA_DIR = "data"
SPLIT = "train"
# Brotli's slow levels (10-11) are the ones that find the 13-bit structure of int16 codes: 1716 instead of
# 1862 bytes per uniform 32x32 grid (bench/preprocess.py). Shards are written once and streamed by every
# peer every epoch, so the default buys bandwidth with write time (about 200-400 rows/s per core at 1024 codes).
DEFAULT_COMPRESSION_LEVEL = 11
