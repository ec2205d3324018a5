import pandas as pd
import pytest

from pipeline.preprocess.metadata import ColumnMap, InputError, expand_inputs, read_metadata

LAION = {
    "SAMPLE_ID": [10, 11],
    "URL": ["http://x/1", "http://x/2"],
    "TEXT": ["a red circle", "a blue square"],
    "HEIGHT": [100, 200],
    "WIDTH": [100, 300],
    "LICENSE": ["?", "?"],
    "NSFW": ["UNLIKELY", "UNSURE"],
    "similarity": [0.3, 0.31],
}


def test_laion_parquet_and_csv_and_tsv_read_alike(tmp_path):
    frame = pd.DataFrame(LAION)
    frame.to_parquet(tmp_path / "part-0.parquet", index=False)
    frame.to_csv(tmp_path / "part-1.csv", index=False)
    frame.to_csv(tmp_path / "part-2.tsv", index=False, sep="\t")
    files = expand_inputs([str(tmp_path / "part-*")])
    assert [f.name for f in files] == ["part-0.parquet", "part-1.csv", "part-2.tsv"]
    rows = read_metadata(files, ColumnMap(), needs_size=True, needs_nsfw=True)
    assert len(rows) == 6
    assert rows["key"].tolist() == ["10", "11"] * 3
    assert rows["width"].tolist() == [100, 300] * 3
    assert rows["nsfw"].tolist() == ["UNLIKELY", "UNSURE"] * 3


def test_configurable_columns_and_url_hash_keys(tmp_path):
    pd.DataFrame({"link": ["http://x/1"], "alt": ["a caption"]}).to_csv(tmp_path / "m.csv", index=False)
    columns = ColumnMap(key=None, url="link", caption="alt", width=None, height=None, nsfw=None)
    rows = read_metadata([tmp_path / "m.csv"], columns, needs_size=False, needs_nsfw=False)
    assert rows.loc[0, "caption"] == "a caption"
    assert len(rows.loc[0, "key"]) == 16  # hash of the URL


def test_missing_column_is_one_clear_error(tmp_path):
    pd.DataFrame({"URL": ["http://x/1"], "TEXT": ["a caption"]}).to_parquet(tmp_path / "m.parquet")
    with pytest.raises(InputError, match="no column 'WIDTH'.*--url-col"):
        read_metadata([tmp_path / "m.parquet"], ColumnMap(), needs_size=True, needs_nsfw=False)


def test_empty_unreadable_and_unmatched_inputs(tmp_path):
    pd.DataFrame({"URL": [], "TEXT": []}, dtype=str).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(InputError, match="holds no rows"):
        read_metadata([tmp_path / "empty.parquet"], ColumnMap(), needs_size=False, needs_nsfw=False)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="cannot read .*broken.parquet"):
        read_metadata([tmp_path / "broken.parquet"], ColumnMap(), needs_size=False, needs_nsfw=False)
    with pytest.raises(InputError, match="matches no file"):
        expand_inputs([str(tmp_path / "nothing-*.parquet")])
