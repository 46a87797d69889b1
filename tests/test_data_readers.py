"""One reader for the files users keep rows in: JSONL, a JSON array, Parquet, Arrow (file and stream)
and directories saved by `datasets` give the same token file, for text, fine-tuning and preference rows
alike; a file that is not text is refused, never tokenised as bytes (one process, CPU)."""

import json
import sys

import pytest

from mfsdp.cli import main as cli_main
from mfsdp.data import TokenFile

pytestmark = pytest.mark.timeout(120)
pa = pytest.importorskip("pyarrow")


def _turn(role, content):
    return {"role": role, "content": content}


TEXT = [{"text": "hello world"}, {"text": "good thanks"}]
SAMPLES = [{"prompt": "Q: one plus two?", "completion": " three"},
           {"messages": [_turn("user", "hello"), _turn("assistant", "hello world")]}]
PAIRS = [{"prompt": [_turn("user", "how many?")], "chosen": [_turn("assistant", "three")],
          "rejected": [_turn("assistant", "ten")]},
         {"chosen": [_turn("user", "hi"), _turn("assistant", "hello")],  # implicit: its prompt column is null
          "rejected": [_turn("user", "hi"), _turn("assistant", "go away")]}]


def _write(kind, tmp_path, rows):
    """``rows`` saved as ``kind``; the path to give prepare-data."""
    import pyarrow.parquet as pq
    table = pa.Table.from_struct_array(pa.array(rows))  # columns from every row (from_pylist: the first's)
    path = tmp_path / {"jsonl": "rows.jsonl", "array": "rows.json", "parquet": "rows.parquet",
                       "arrow_file": "rows.arrow", "saved": "saved"}.get(kind, "x")
    if kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "array":
        path.write_text(json.dumps(rows, indent=2))
    elif kind == "parquet":
        pq.write_table(table, path)
    elif kind == "arrow_file":
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
    else:  # datasets' own: save_to_disk, and the Arrow stream file it writes
        from datasets import Dataset
        Dataset(table).save_to_disk(str(tmp_path / "saved"))
        path = tmp_path / "saved" if kind == "saved" else next((tmp_path / "saved").glob("*.arrow"))
    return path


def _prepare(source, out, *flags):
    assert cli_main(["prepare-data", str(source), str(out), *flags]) == 0
    return out.read_bytes()


@pytest.mark.parametrize("rows, version", [(TEXT, 1), (SAMPLES, 2), (PAIRS, 3)])
def test_every_file_type_gives_the_same_token_file(tmp_path, rows, version):
    pytest.importorskip("datasets")
    expected = _prepare(_write("jsonl", tmp_path, rows), tmp_path / "jsonl.tokens")
    assert TokenFile(tmp_path / "jsonl.tokens").version == version
    for kind in ("array", "parquet", "arrow_file", "arrow_stream", "saved"):
        source = _write(kind, tmp_path, rows)
        assert _prepare(source, tmp_path / f"{kind}.tokens") == expected, kind


def _fails(capsys, source, out, *flags):
    """prepare-data's one error line (exit 2, no output file)."""
    assert cli_main(["prepare-data", str(source), str(out), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and not out.exists()
    return captured.err.removeprefix("mfsdp prepare-data: error: ").rstrip("\n")


def test_a_bad_row_is_named_by_its_line_or_row(tmp_path, capsys):
    rows = [SAMPLES[0], SAMPLES[0], {"prompt": "p"}]
    source = _write("array", tmp_path, rows)
    line = [n for n, text in enumerate(source.read_text().splitlines(), 1) if text == "  {"][2]  # the third row's
    assert _fails(capsys, source, tmp_path / "o") == (
        f"{source}:{line}: a prompt_completion row needs 'prompt' and 'completion' (its keys: 'prompt'); fix the row")
    source = _write("parquet", tmp_path, rows)
    assert _fails(capsys, source, tmp_path / "o").startswith(f"{source}, row 3: a prompt_completion row needs")
    (tmp_path / "bad.json").write_text('[{"text": "a"},\n {"text": "b"}\n {"text": "c"}]')
    assert _fails(capsys, tmp_path / "bad.json", tmp_path / "o").startswith(f"{tmp_path / 'bad.json'}:3: invalid JSON")


def test_a_missing_datasets_or_pyarrow_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    pytest.importorskip("datasets")
    saved, parquet = _write("saved", tmp_path, TEXT), _write("parquet", tmp_path, TEXT)
    capsys.readouterr()  # save_to_disk's progress bar
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert _fails(capsys, saved, tmp_path / "o") == (
        f"{saved} is a dataset saved by datasets.save_to_disk, which needs the `datasets` package; install it "
        "with pip install 'mfsdp[datasets]'")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    assert _fails(capsys, parquet, tmp_path / "o") == \
        f"reading {parquet} needs pyarrow; install it with pip install 'mfsdp[datasets]'"


def test_a_saved_dataset_dict_names_its_splits(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict(train=datasets.Dataset.from_list(TEXT), test=datasets.Dataset.from_list(TEXT))
    splits.save_to_disk(str(tmp_path / "dd"))
    capsys.readouterr()
    assert _fails(capsys, tmp_path / "dd", tmp_path / "o") == (
        f"{tmp_path / 'dd'} holds the splits train, test; pass one of them, such as {tmp_path / 'dd' / 'train'}")


def test_a_file_that_is_not_text_is_refused_and_text_still_reads(tmp_path, capsys):
    parquet = _write("parquet", tmp_path, TEXT)
    disguised = tmp_path / "data.txt"
    disguised.write_bytes(parquet.read_bytes())
    assert _fails(capsys, disguised, tmp_path / "o").startswith(
        f"{disguised} is not text but a Parquet file: name it *.parquet; prepare-data reads UTF-8 text and")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"abc\0\x01\x02")
    assert "is not text but a binary file (it holds NUL bytes)" in _fails(capsys, binary, tmp_path / "o")
    latin1 = tmp_path / "notes.txt"
    latin1.write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    assert _fails(capsys, latin1, tmp_path / "o").startswith(
        f"{latin1}:2: byte 0xe9 is not UTF-8 text; prepare-data reads UTF-8 text and")
    text = tmp_path / "story.txt"
    text.write_text("café au lait")
    _prepare(text, tmp_path / "t.tokens")
    assert TokenFile(tmp_path / "t.tokens").tokens.tolist() == [*"café au lait".encode(), 256]
