"""What both halves share, importable with numpy, pyarrow and torch alone: the shard format (the contract),
where a dataset's files are, the streaming loader, the tokenizer, and small helpers (files, devices, hf://)."""
