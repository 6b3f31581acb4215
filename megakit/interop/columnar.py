"""Parquet files and ``datasets.save_to_disk`` directories as records, read with pyarrow, piece by piece.

Hub data sets arrive as Parquet (one file or many, each in row groups) and as the Arrow files that
``datasets.Dataset.save_to_disk`` writes (``data-*.arrow`` beside ``state.json``). Both are columns, not lines;
``prepare-data`` reads them as it reads JSONL: one record (a dict, one row) at a time, a large file cut into
pieces (a Parquet row group, an Arrow record batch) that go to the workers. Reading through pyarrow, not
``datasets``, keeps its cache and its ``fsspec`` out of the run: nothing is written beside the inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

SUFFIXES = (".parquet", ".arrow")
STATE = "state.json"  # datasets' save_to_disk: its data files in order, under "_data_files"
SPLITS = "dataset_dict.json"  # a DatasetDict's save_to_disk: one save_to_disk directory per split


def is_columnar(path: Path) -> bool:
    """Whether the file is Parquet or Arrow, read by columns rather than as text."""
    return path.suffix in SUFFIXES


def saved_dataset(directory: Path) -> list[Path] | None:
    """The Arrow files of a ``save_to_disk`` directory in their order, or None when it is not one. A DatasetDict
    gives its ``train`` split (the one a model trains on; name another split's directory to read that one)."""
    if (directory / SPLITS).is_file():
        splits = json.loads((directory / SPLITS).read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(
                f"{directory} holds the splits {', '.join(splits)} and no 'train'; give the directory "
                f"of the split to read, e.g. {directory / splits[0]}"
                if splits
                else f"{directory} is empty"
            )
        directory = directory / "train"
    if not (directory / STATE).is_file():
        return None
    files = json.loads((directory / STATE).read_text()).get("_data_files", [])
    return [directory / f["filename"] for f in files]


def _pieces(path: Path):
    """The file's pieces: a ParquetFile (its row groups), or the list of an Arrow file's record batches, memory-mapped
    (the IPC stream format that datasets writes, or the file format)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        return pq.ParquetFile(str(path))
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
    return reader.read_all().to_batches()


def piece_rows(path: Path) -> list[int]:
    """The rows of each piece of the file: its Parquet row groups, or its Arrow record batches."""
    pieces = _pieces(path)
    if isinstance(pieces, list):
        return [b.num_rows for b in pieces]
    return [pieces.metadata.row_group(i).num_rows for i in range(pieces.num_row_groups)]


def records(path: Path, start: int, end: int | None) -> list[tuple[dict | None, str]]:
    """The rows of pieces ``start:end`` of the file, each a dict of its columns (None for a null row), with where
    it is: the file, its row group (Parquet) or record batch (Arrow) and its row there."""
    pieces = _pieces(path)
    if isinstance(pieces, list):
        kind, first = "record batch", start
        tables = [batch.to_pylist() for batch in pieces[start:end]]
    else:
        kind, groups = "row group", list(range(pieces.num_row_groups)[start:end])
        first = groups[0] if groups else 0
        tables = [pieces.read_row_group(g).to_pylist() for g in groups]
    return [
        (row, f"{path}, {kind} {first + k}, row {n}") for k, rows in enumerate(tables) for n, row in enumerate(rows)
    ]
