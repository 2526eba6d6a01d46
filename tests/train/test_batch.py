"""Batches (autotune.train._batch): sizes, resizing, splitting and moving batches of any structure."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any, NamedTuple

import pytest
import torch

from autotune.errors import BatchError
from autotune.train._batch import batch_size, map_tensors, resize, split, to_device


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def rows(n: int, width: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor whose row i holds the value i in every column, so rows are identifiable."""
    return torch.arange(n, dtype=dtype).unsqueeze(1).expand(n, width).contiguous()


def batch_encoding(data: dict[str, Any]) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding(data)


# --- batch_size --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        rows(4),
        (rows(4), rows(4, 1)),
        [rows(4), torch.zeros(4)],
        Pair(rows(4), torch.zeros(4)),
        {"input_ids": rows(4), "labels": torch.zeros(4, dtype=torch.long)},
        {"a": (rows(4), {"b": [torch.zeros(4, 2, 2)]}), "meta": "text", "n": 7},
        {"scalar": torch.tensor(3.0), "x": rows(4)},  # a 0-dim tensor does not count
    ],
    ids=["tensor", "tuple", "list", "namedtuple", "dict", "nested", "zero-dim"],
)
def test_batch_size_of_supported_structures(batch: Any) -> None:
    assert batch_size(batch) == 4


def test_batch_size_of_batch_encoding() -> None:
    enc = batch_encoding({"input_ids": rows(5, 8), "attention_mask": torch.ones(5, 8)})
    assert not isinstance(enc, dict)  # a UserDict: must be handled as a Mapping
    assert batch_size(enc) == 5


def test_batch_size_mismatch_names_both_paths() -> None:
    batch = {"input_ids": rows(4), "labels": rows(3)}
    with pytest.raises(BatchError, match=r"batch\['input_ids'\] has 4 rows") as info:
        batch_size(batch)
    assert "batch['labels'] has 3" in str(info.value)


def test_batch_size_mismatch_in_nested_namedtuple() -> None:
    batch = {"pair": Pair(rows(2), rows(2)), "extra": [rows(2), rows(5)]}
    with pytest.raises(BatchError) as info:
        batch_size(batch)
    message = str(info.value)
    assert "batch['pair'].x has 2 rows" in message
    assert "batch['extra'][1] has 5" in message


@pytest.mark.parametrize("batch", [{1, 2}, 3, "text", None, 2.5], ids=repr)
def test_batch_size_rejects_unsupported_types(batch: Any) -> None:
    with pytest.raises(BatchError, match="not supported"):
        batch_size(batch)


def test_batch_size_rejects_numpy_array() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(BatchError, match="ndarray is not supported"):
        batch_size(np.zeros((4, 3)))


@pytest.mark.parametrize(
    "batch",
    [{"n": 3, "name": "x"}, {"scalar": torch.tensor(1.0)}, [], {}],
    ids=["non-tensors", "zero-dim-only", "empty-list", "empty-dict"],
)
def test_batch_size_rejects_batches_without_tensors(batch: Any) -> None:
    with pytest.raises(BatchError, match="no tensor"):
        batch_size(batch)


def test_batch_error_is_a_type_error() -> None:
    # Callers that only know the standard hierarchy still catch it.
    with pytest.raises(TypeError):
        batch_size({1})


# --- resize ------------------------------------------------------------------------------


def test_resize_shrinks_to_first_rows_as_views() -> None:
    x = rows(6)
    out = resize({"x": x, "tag": "keep"}, 4)
    assert torch.equal(out["x"], rows(4))
    assert out["x"].data_ptr() == x.data_ptr()  # a view, no copy
    assert out["tag"] == "keep"


def test_resize_grows_cyclically() -> None:
    x = rows(3, width=2)
    out = resize(x, 8)
    assert out.shape == (8, 2)
    assert out[:, 0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert out.is_contiguous()
    assert out.data_ptr() != x.data_ptr()


def test_resize_grows_every_leaf_consistently() -> None:
    ids = torch.arange(3)
    mask = torch.arange(30).reshape(3, 10)
    out = resize((ids, {"mask": mask}), 7)
    expected = [i % 3 for i in range(7)]
    assert out[0].tolist() == expected
    for i, row in enumerate(out[1]["mask"]):
        assert torch.equal(row, mask[expected[i]])


def test_resize_to_same_size_keeps_values() -> None:
    batch = {"x": rows(4)}
    assert torch.equal(resize(batch, 4)["x"], batch["x"])


@pytest.mark.parametrize("n", [2, 9])
def test_resize_preserves_structure_and_leaves(n: int) -> None:
    scalar = torch.tensor(0.5)
    batch = {
        "pair": Pair(rows(4), torch.zeros(4)),
        "seq": [rows(4, dtype=torch.int64), ("label", None, 3)],
        "tup": (rows(4, dtype=torch.float16),),
        "scalar": scalar,
        "ordered": OrderedDict(a=rows(4)),
    }
    out = resize(batch, n)
    assert type(out) is dict
    assert type(out["pair"]) is Pair
    assert type(out["seq"]) is list
    assert type(out["tup"]) is tuple
    assert type(out["ordered"]) is OrderedDict
    assert out["seq"][1] == ("label", None, 3)
    assert out["scalar"] is scalar  # 0-dim tensors are passed through untouched
    assert out["seq"][0].dtype == torch.int64
    assert out["tup"][0].dtype == torch.float16
    assert out["pair"].x.device == torch.device("cpu")
    assert batch_size(out) == n


def test_resize_keeps_plain_namedtuple_type() -> None:
    Sample = namedtuple("Sample", ["ids", "label"])
    out = resize(Sample(torch.arange(2), "cat"), 5)
    assert type(out) is Sample
    assert out.ids.tolist() == [0, 1, 0, 1, 0]
    assert out.label == "cat"


def test_resize_keeps_batch_encoding() -> None:
    transformers = pytest.importorskip("transformers")
    enc = batch_encoding({"input_ids": rows(2, 4), "attention_mask": torch.ones(2, 4)})
    out = resize(enc, 5)
    assert isinstance(out, transformers.BatchEncoding)
    assert out["input_ids"][:, 0].tolist() == [0, 1, 0, 1, 0]
    assert out.attention_mask.shape == (5, 4)  # attribute access still works


def test_resize_falls_back_to_dict_for_unbuildable_mappings() -> None:
    # defaultdict(new_dict) fails: its first argument must be a factory.
    from collections import defaultdict

    batch = defaultdict(list, {"x": rows(2)})
    out = resize(batch, 3)
    assert type(out) is dict
    assert out["x"][:, 0].tolist() == [0, 1, 0]


def test_resize_meta_tensors() -> None:
    out = resize({"x": torch.empty(3, 5, device="meta")}, 10)
    assert out["x"].shape == (10, 5)
    assert out["x"].device.type == "meta"


@pytest.mark.parametrize("n", [0, -1])
def test_resize_rejects_n_below_one(n: int) -> None:
    with pytest.raises(BatchError, match="1 or more"):
        resize(rows(3), n)


# --- split -------------------------------------------------------------------------------


def test_split_chunk_sizes_and_contents() -> None:
    batch = {"x": rows(10), "y": torch.arange(10), "name": "b"}
    chunks = split(batch, 4)
    assert [batch_size(c) for c in chunks] == [4, 4, 2]
    assert chunks[1]["y"].tolist() == [4, 5, 6, 7]
    assert chunks[2]["x"][:, 0].tolist() == [8, 9]
    assert all(c["name"] == "b" for c in chunks)
    assert chunks[0]["x"].data_ptr() == batch["x"].data_ptr()  # views, no copies


def test_split_chunks_concatenate_to_original() -> None:
    batch = (rows(7), Pair(torch.randn(7, 2), torch.arange(7)))
    chunks = split(batch, 3)
    assert all(type(c) is tuple and type(c[1]) is Pair for c in chunks)
    assert torch.equal(torch.cat([c[0] for c in chunks]), batch[0])
    assert torch.equal(torch.cat([c[1].x for c in chunks]), batch[1].x)
    assert torch.equal(torch.cat([c[1].y for c in chunks]), batch[1].y)


def test_split_larger_than_batch_gives_one_chunk() -> None:
    chunks = split(rows(3), 8)
    assert len(chunks) == 1
    assert torch.equal(chunks[0], rows(3))


def test_split_rejects_bad_micro_batch_size() -> None:
    with pytest.raises(BatchError, match="micro_batch_size"):
        split(rows(3), 0)


# --- to_device and map_tensors -----------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("meta")])
def test_to_device_moves_every_tensor(device: str | torch.device) -> None:
    enc = batch_encoding({"input_ids": rows(2, 4), "step": torch.tensor(1)})
    batch = {"enc": enc, "pair": Pair(rows(2), torch.zeros(2)), "n": 3}
    out = to_device(batch, device)
    target = torch.device(device).type
    assert type(out["enc"]) is type(enc)
    assert type(out["pair"]) is Pair
    assert out["enc"]["input_ids"].device.type == target
    assert out["enc"]["input_ids"].shape == (2, 4)
    assert out["enc"]["step"].device.type == target  # 0-dim tensors move too
    assert out["pair"].x.device.type == target
    assert out["pair"].x.shape == (2, 3)
    assert out["n"] == 3


def test_to_device_rejects_unsupported_type() -> None:
    with pytest.raises(BatchError):
        to_device({1, 2}, "cpu")


def test_map_tensors_skips_zero_dim_and_non_tensors() -> None:
    scalar = torch.tensor(2.0)
    out = map_tensors({"x": torch.ones(2), "s": scalar, "k": "v"}, lambda t: t * 3)
    assert out["x"].tolist() == [3.0, 3.0]
    assert out["s"] is scalar
    assert out["k"] == "v"
