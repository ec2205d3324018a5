"""The data side of ttt, one room per concern:

core/               the contract both halves import: shard format, streaming loader, tokenizer, hf:// locations
preprocess/         `ttt preprocess` and `ttt publish`: the organiser's stages, on Dask
vqgan/              images <-> codes, and `ttt vqgan train`
sample/             the embedded sample and its judge
inspect_dataset.py  `ttt inspect`
"""
