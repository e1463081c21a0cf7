"""The Hugging Face formats of pitstop.data (pitstop.data.arrow): a Parquet file's and a
save_to_disk dataset's token column read back as written, cut into the same samples as the
same tokens in an .npy, digested by their tokens wherever they lie, and bad columns and
directories refused, saying what to do. The files are written here with pyarrow, by
hand, as Hugging Face's `datasets` lays them out (it is not installed)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import xxhash

from pitstop.data import Manifest, SampleReader, ShardCache, Windows, describe_shard

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

INT32_LISTS = pa.list_(pa.int32())


def documents(count: int, seed: int) -> list[list[int]]:
    """`count` token lists of 0 to 40 ids below 50,000 (one empty, as a real corpus has)."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 50_000, int(rng.integers(1, 41))).tolist() for _ in range(count)]
    rows[count // 3] = []
    return rows


def flat(rows: Sequence[Sequence[int]]) -> list[int]:
    return [token for row in rows for token in row]


def write_parquet(
    url: str,
    rows: Sequence[Sequence[Any]],
    kind: Any = INT32_LISTS,
    column: str = "input_ids",
    row_group_size: int | None = None,
) -> None:
    """A Parquet file of `rows` in `column`, beside a text column (unless `column` is
    that one), as to_parquet writes a tokenized dataset."""
    columns: dict[str, Any] = {"text": [f"document {i}" for i in range(len(rows))]}
    columns[column] = pa.array(rows, kind)
    table = pa.table(columns)
    with fsspec.open(url, "wb") as file:
        pq.write_table(table, file, row_group_size=row_group_size)


def write_hf(
    directory: str,
    files: Sequence[Sequence[Sequence[Any]]],
    kind: Any = INT32_LISTS,
    column: str = "input_ids",
    listed: Sequence[int] | None = None,
) -> list[str]:
    """A directory as Dataset.save_to_disk writes it: one Arrow IPC stream per entry of
    `files` (each of a few record batches), state.json listing them (in the order of
    `listed`, by default as numbered) and dataset_info.json. Returns the files' URLs."""
    names = [f"data-{i:05d}-of-{len(files):05d}.arrow" for i in range(len(files))]
    features = {column: {"dtype": str(kind), "_type": "Value"}}  # not read; as a record
    for name, rows in zip(names, files, strict=True):
        table = pa.table({column: pa.array(rows, kind)})
        schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {}})})
        with (
            fsspec.open(f"{directory}/{name}", "wb") as file,
            pa.ipc.new_stream(file, schema) as writer,
        ):
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
    order = range(len(files)) if listed is None else listed
    state = {
        "_data_files": [{"filename": names[i]} for i in order],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    info = {"citation": "", "description": "", "features": features, "homepage": ""}
    with fsspec.open(f"{directory}/state.json", "w") as file:
        file.write(json.dumps(state, indent=2))
    with fsspec.open(f"{directory}/dataset_info.json", "w") as file:
        file.write(json.dumps(info, indent=2))
    return [f"{directory}/{names[i]}" for i in order]


def save_npy(path: Path, tokens: Sequence[int]) -> str:
    np.save(path, np.asarray(tokens, dtype=np.int32))
    return str(path)


@pytest.fixture
def memory() -> Iterator[str]:
    """A fresh folder of fsspec's in-memory filesystem, removed afterwards."""
    root = f"memory://arrow-{uuid.uuid4().hex}"
    yield root
    filesystem = fsspec.filesystem("memory")
    if filesystem.exists(root):
        filesystem.rm(root, recursive=True)


def all_tokens(manifest: Manifest, cache: ShardCache) -> list[list[int]]:
    """Each shard's tokens as the reader sees them: one window spanning the whole shard
    (context = tokens - 1) read through a SampleReader of a one-shard manifest."""
    streams = []
    for shard in manifest.shards:
        windows = Windows(Manifest([shard]), shard.tokens - 1)
        with SampleReader(windows, cache) as reader:
            x, y = reader.read([0])
        streams.append([*x[0].tolist(), y[0, -1].item()])
    return streams


def test_a_parquet_file_of_two_row_groups_reads_back_as_written(tmp_path: Path) -> None:
    rows = documents(30, seed=1)
    write_parquet(str(tmp_path / "train.parquet"), rows, row_group_size=15)
    assert pq.ParquetFile(tmp_path / "train.parquet").num_row_groups == 2

    manifest = Manifest.build([str(tmp_path / "train.parquet")], "parquet")
    (shard,) = manifest.shards
    tokens = np.asarray(flat(rows), dtype="<i4")
    assert (shard.format, shard.dtype, shard.column) == ("parquet", "<i4", "input_ids")
    assert (shard.tokens, shard.byte_size, shard.offset) == (len(tokens), tokens.nbytes, 0)
    assert shard.digest == f"xxh3_128:{xxhash.xxh3_128(tokens.tobytes()).hexdigest()}"

    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    assert all_tokens(manifest, cache) == [tokens.tolist()]
    # The cache holds the column converted to a flat array, named by its digest.
    (converted,) = (tmp_path / "cache").iterdir()
    assert converted.name == f"{shard.digest.partition(':')[2]}.tokens"
    assert converted.read_bytes() == tokens.tobytes()


def test_a_save_to_disk_directory_is_its_arrow_files_in_state_json_order(
    tmp_path: Path,
) -> None:
    files = [documents(20, seed=2), documents(25, seed=3), documents(9, seed=4)]
    # state.json lists the files out of their numbering: its order is the dataset's.
    urls = write_hf(str(tmp_path / "ds"), files, listed=[2, 0, 1])
    manifest = Manifest.build([str(tmp_path / "ds")], "hf")
    assert [shard.url for shard in manifest.shards] == urls
    assert [shard.format for shard in manifest.shards] == ["hf"] * 3
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    assert all_tokens(manifest, cache) == [flat(files[2]), flat(files[0]), flat(files[1])]
    # One of its files alone is a shard too; the directory is not.
    assert describe_shard(urls[0], "hf") == manifest.shards[0]
    with pytest.raises(ValueError, match=r"a directory; .* pass the directory to Manifest\.build"):
        describe_shard(str(tmp_path / "ds"), "hf")


@pytest.mark.parametrize("format_name", ["parquet", "hf"])
def test_every_sample_is_the_same_as_from_the_same_tokens_in_an_npy(
    tmp_path: Path, format_name: str
) -> None:
    files = [documents(40, seed=5), documents(33, seed=6)]
    if format_name == "parquet":
        urls = [str(tmp_path / f"{i}.parquet") for i in range(2)]
        for url, rows in zip(urls, files, strict=True):
            write_parquet(url, rows, row_group_size=16)
        manifest = Manifest.build(urls, "parquet")
    else:
        write_hf(str(tmp_path / "ds"), files)
        manifest = Manifest.build([str(tmp_path / "ds")], "hf")
    npy = Manifest.build(
        [save_npy(tmp_path / f"{i}.npy", flat(rows)) for i, rows in enumerate(files)], "npy"
    )
    assert manifest.tokens == npy.tokens == len(flat(files[0])) + len(flat(files[1]))

    windows, expected = Windows(manifest, 9), Windows(npy, 9)
    assert windows.samples == expected.samples > 100
    assert windows.shard_windows == expected.shard_windows
    every = list(range(windows.samples))[::-1]
    with SampleReader(windows, ShardCache(tmp_path / "cache", 1 << 20)) as reader:
        x, y = reader.read(every)
    with SampleReader(expected) as reader:
        npy_x, npy_y = reader.read(every)
    assert x.tolist() == npy_x.tolist()
    assert y.tolist() == npy_y.tolist()


def test_the_digest_follows_the_tokens_not_the_place_or_the_file(
    tmp_path: Path, memory: str
) -> None:
    rows = documents(24, seed=7)
    write_parquet(str(tmp_path / "a.parquet"), rows, row_group_size=12)
    write_parquet(f"{memory}/a.parquet", rows, row_group_size=12)
    local = Manifest.build([f"file://{tmp_path / 'a.parquet'}"], "parquet")
    remote = Manifest.build([f"{memory}/a.parquet"], "parquet")
    assert local.shards[0].url != remote.shards[0].url
    assert local.digest == remote.digest

    # The same tokens cut into other rows, in another column, in one row group: another
    # file, the same tokens, so the same digest.
    tokens = flat(rows)
    write_parquet(
        str(tmp_path / "b.parquet"), [tokens[:5], tokens[5:]], column="ids", row_group_size=None
    )
    other = Manifest.build([str(tmp_path / "b.parquet")], "parquet", column="ids")
    assert other.digest == local.digest
    # Other tokens, another digest.
    write_parquet(str(tmp_path / "c.parquet"), [tokens[:-1]])
    assert Manifest.build([str(tmp_path / "c.parquet")], "parquet").digest != local.digest

    write_hf(str(tmp_path / "ds"), [rows[:10], rows[10:]])
    write_hf(f"{memory}/ds", [rows[:10], rows[10:]])
    on_disk = Manifest.build([f"file://{tmp_path / 'ds'}"], "hf")
    in_memory = Manifest.build([f"{memory}/ds"], "hf")
    assert on_disk.digest == in_memory.digest
    # The manifest keeps the column it read, through its JSON.
    assert Manifest.from_json(other.to_json()).shards == other.shards


def test_a_remote_shard_is_converted_once_and_a_changed_one_refused(
    tmp_path: Path, memory: str
) -> None:
    rows = documents(30, seed=8)
    write_hf(f"{memory}/ds", [rows])
    manifest = Manifest.build([f"{memory}/ds"], "hf")
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    assert all_tokens(manifest, cache) == [flat(rows)]
    # Once converted, the shard is read from the cache: its source may go.
    fsspec.filesystem("memory").rm(manifest.shards[0].url)
    assert all_tokens(manifest, cache) == [flat(rows)]

    write_parquet(str(tmp_path / "a.parquet"), rows)
    manifest = Manifest.build([str(tmp_path / "a.parquet")], "parquet")
    write_parquet(str(tmp_path / "a.parquet"), [*rows[:-1], [*rows[-1], 1]])
    windows = Windows(manifest, 4)
    with (
        SampleReader(windows, ShardCache(tmp_path / "other", 1 << 20)) as reader,
        pytest.raises(ValueError, match="the shard changed since the manifest was built"),
    ):
        reader.read([0])
    with pytest.raises(ValueError, match=r"is a parquet shard, .*pass a ShardCache"):
        SampleReader(windows)


@pytest.mark.parametrize("format_name", ["parquet", "hf"])
@pytest.mark.parametrize(
    ("column", "values", "kind", "message"),
    [
        (
            "text",
            ["a", "b"],
            pa.string(),
            "column 'text' of .*: is a string column, not token ids; tokenize first or name "
            "the token column with column=",
        ),
        (
            "input_ids",
            [[0.5, 1.0], [2.0]],
            pa.list_(pa.float32()),
            "column 'input_ids' of .*: holds lists of float, not integer token ids; save the "
            "token ids as integers .* or name the token column with column=",
        ),
        (
            "input_ids",
            [3, 4],
            pa.int64(),
            "column 'input_ids' of .*: is a column of int64, not a list of token ids per row; "
            "name the token column with column=",
        ),
        (
            "input_ids",
            [[1, 2], None],
            INT32_LISTS,
            "column 'input_ids' of .*: 1 rows are null; drop or fill them",
        ),
    ],
)
def test_a_column_that_is_not_token_lists_is_refused(
    tmp_path: Path, format_name: str, column: str, values: list[Any], kind: Any, message: str
) -> None:
    if format_name == "parquet":
        url = str(tmp_path / "bad.parquet")
        write_parquet(url, values, kind, column=column)
    else:
        (url,) = write_hf(str(tmp_path / "ds"), [values], kind, column=column)
    with pytest.raises(ValueError, match=message):
        describe_shard(url, format_name, column=column)


@pytest.mark.parametrize("format_name", ["parquet", "hf"])
def test_a_missing_column_is_refused_naming_the_columns_there(
    tmp_path: Path, format_name: str
) -> None:
    rows = documents(5, seed=9)
    if format_name == "parquet":
        write_parquet(str(tmp_path / "a.parquet"), rows, column="tokens")
        urls = [str(tmp_path / "a.parquet")]
        columns = "text, tokens"
    else:
        write_hf(str(tmp_path / "ds"), [rows], column="tokens")
        urls = [str(tmp_path / "ds")]
        columns = "tokens"
    with pytest.raises(
        ValueError,
        match=rf"column 'input_ids': not in .* \(its columns: {columns}\); name the token "
        "column with column=",
    ):
        Manifest.build(urls, format_name)
    assert Manifest.build(urls, format_name, column="tokens").tokens == len(flat(rows))


def test_a_directory_that_save_to_disk_did_not_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "data-00000-of-00001.arrow").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=r"hf dataset .*plain: no state\.json; pass a directory written by "
        r"datasets\.Dataset\.save_to_disk",
    ):
        Manifest.build([str(tmp_path / "plain")], "hf")

    # A DatasetDict: one folder per split, and dataset_dict.json.
    write_hf(str(tmp_path / "dict" / "train"), [documents(3, seed=10)])
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(ValueError, match=r"a DatasetDict .*; pass one split's directory, e\.g\."):
        Manifest.build([str(tmp_path / "dict")], "hf")
    assert Manifest.build([str(tmp_path / "dict" / "train")], "hf").tokens > 0

    (tmp_path / "plain" / "state.json").write_text('{"_data_files": []}')
    with pytest.raises(
        ValueError, match=r"state\.json's _data_files is \[\], not a list of \{\"filename\""
    ):
        Manifest.build([str(tmp_path / "plain")], "hf")

    (tmp_path / "plain" / "state.json").write_text(
        '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}'
    )
    with pytest.raises(ValueError, match=r"not an Arrow IPC stream .*save_to_disk wrote"):
        Manifest.build([str(tmp_path / "plain")], "hf")


def test_a_file_that_is_not_parquet_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError, match=r"not a Parquet file .*Dataset\.to_parquet"):
        describe_shard(str(tmp_path / "tokens.npy"), "parquet")
