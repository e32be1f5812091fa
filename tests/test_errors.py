"""One error contract: every error is a SharedDataError AND the builtin a caller catches.

Pinned over every dataset kind (``tests/kinds.py``): indexing out of range or with
the wrong type, argument validation, unpicklable items; and for the classes
themselves: each lives in ``errors.py``, is exported from ``shareddata``, is drawn in
the module's tree, and crosses ranks with its type.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from kinds import COLUMN_KINDS, KINDS, make

import shareddata as sd
from shareddata import distributed, errors

CLASSES = [
    getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each kind once, over 8 rows (the checks below only index and fail)."""
    root = tmp_path_factory.mktemp("kinds")
    return {kind: make(kind, root / kind, rows=8, progress=False)[0] for kind in KINDS}


# -- the classes ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_is_exported_drawn_and_a_builtin_too(cls):
    assert cls.__name__ in sd.__all__ and getattr(sd, cls.__name__) is cls
    assert f" {cls.__name__} " in errors.__doc__ or f"{cls.__name__} (" in errors.__doc__
    assert issubclass(cls, sd.SharedDataError)
    if cls is not sd.SharedDataError:  # and what an existing except clause catches
        builtin = [b for b in cls.__mro__ if b.__module__ == "builtins" and b is not Exception]
        assert builtin and builtin[0] is not object, cls.__mro__


def test_every_class_of_errors_py_is_in_its_all():
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and value.__module__ == errors.__name__
    }
    assert defined == {c.__name__ for c in CLASSES}


def test_old_import_locations_still_work():
    from shareddata.datasets._materialise import ItemMismatchError, ItemValueError

    assert ItemMismatchError is errors.ItemMismatchError
    assert ItemValueError is errors.ItemValueError
    assert distributed.LocalRankError is errors.LocalRankError
    assert distributed.LocalRankTimeoutError is errors.LocalRankTimeoutError
    assert distributed.ShardingNotSupportedError is errors.ShardingNotSupportedError


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_an_error_of_local_rank_0_is_raised_with_its_class_on_the_others(cls):
    info = distributed.error_info(cls("boom"))
    again = distributed.rebuild_error(info, "local rank 0 failed: ")
    assert type(again) is cls and "boom" in str(again)


def test_a_foreign_class_arrives_as_a_named_local_rank_error():
    class Theirs(Exception):
        pass

    again = distributed.rebuild_error(distributed.error_info(Theirs("x")), "")
    assert type(again) is sd.LocalRankError and "Theirs" in str(again)
    assert type(distributed.rebuild_error(distributed.error_info(KeyError("k")), "")) is KeyError


# -- every dataset kind --------------------------------------------------------------


@contextmanager
def both(builtin: type[BaseException]) -> Iterator[pytest.ExceptionInfo[BaseException]]:
    """``pytest.raises`` for an error that is ``builtin`` and a SharedDataError."""
    with pytest.raises(builtin) as err:
        yield err
    assert isinstance(err.value, sd.SharedDataError), repr(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_indexing_errors_are_shareddata_errors_and_builtins(built, kind):
    ds = built[kind]
    with both(IndexError) as err:
        ds[8]
    assert "8" in str(err.value)
    with both(IndexError):
        ds[-9]
    with both(TypeError):
        ds[1.5]
    with both(TypeError):
        ds["0"]
    if kind != "shared_list":  # a list takes ints and slices only
        with both(IndexError):
            ds[[0, 8]]
        with both(IndexError):
            ds[torch.tensor([3, -9])]
        with both(TypeError):
            ds[torch.tensor([0.5])]
        with both(TypeError):
            ds[[True, False]]


@pytest.mark.parametrize("kind", KINDS)
def test_argument_errors_are_shareddata_errors_and_builtins(tmp_path, kind):
    with both(ValueError) as err:
        make(kind, tmp_path, rows=4, share="everywhere", progress=False)
    assert "everywhere" in str(err.value)
    with both(ValueError):
        make(kind, tmp_path, rows=4, shard="rank", progress=False, reuse=True)
    with both(TypeError):
        make(kind, tmp_path, rows=4, timeout="soon", progress=False, reuse=True)
    with both(ValueError):
        make(kind, tmp_path, rows=4, timeout=-1, progress=False, reuse=True)
    if kind in COLUMN_KINDS:
        with both(ValueError):
            make(kind, tmp_path, rows=4, output="list", progress=False, reuse=True)
    if kind != "shared_list":
        with both(TypeError):
            make(kind, tmp_path, rows=4, transform=3, progress=False, reuse=True)


def test_shard_node_of_a_one_shot_iterable_says_why():
    with both(NotImplementedError) as err:
        sd.SharedList((i for i in range(4)), shard="node")
    assert isinstance(err.value, sd.ShardingNotSupportedError)
    assert "one-shot iterable" in str(err.value) and "Pass a list" in str(err.value)
    # a sized sequence shards (outside torchrun the node's share is every item)
    assert list(sd.SharedList(range(4), shard="node", progress=False)) == [0, 1, 2, 3]


def test_unpicklable_items_name_the_item():
    lock = threading.Lock()
    for bad in (lambda: 1, lock):  # AttributeError / TypeError from pickle itself
        with both(TypeError) as err:
            sd.SharedList([1, 2, bad], progress=False)
        assert "item 2" in str(err.value) and type(bad).__name__ in str(err.value)

    class Local:  # a local class: pickle raises AttributeError
        pass

    with both(TypeError) as err:
        sd.SharedList([Local()], progress=False)
    assert isinstance(err.value, sd.UnpicklableItemError)
    assert isinstance(err.value, sd.UnsupportedDtypeError)  # what it was before


def test_shared_dataset_item_errors(tmp_path):
    class Drifting(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return (i, "a") if i < 2 else ("two", "a")

    with both(TypeError) as err:
        sd.SharedDataset(Drifting(), progress=False)
    assert isinstance(err.value, sd.ItemMismatchError) and "item 2" in str(err.value)
    with both(ValueError):
        sd.SharedDataset([], progress=False)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with both(TypeError):
        sd.SharedDataset(Stream(), progress=False)
    with both(ValueError):
        sd.SharedDataset([1, 2], num_workers=-1, progress=False)


def test_pickled_errors_keep_their_class():
    error = sd.IndexOutOfRangeError("index 9 is out of range")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is sd.IndexOutOfRangeError and isinstance(again, IndexError)
