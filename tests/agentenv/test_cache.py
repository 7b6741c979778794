"""build_once: a cache folder is built in a temporary sibling, checked, marked last, and rebuilt when it lies."""

import json
import logging

import pytest

from agentenv.cache import COMPLETE, build_once


def check_answer(folder):
    if json.loads((folder / "answer.json").read_text()) != 42:
        raise ValueError("answer.json is not 42")


def write_answer(folder):
    (folder / "answer.json").write_text("42")


def test_a_crashed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    def half_then_crash(folder):
        (folder / "answer.json").write_text("4")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="killed mid-build"):
        build_once(tmp_path / "thing", half_then_crash, check_answer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing.lock"]

    built = []
    folder = build_once(tmp_path / "thing", lambda f: (built.append(f), write_answer(f)), check_answer, record="r")
    assert folder == tmp_path / "thing" and len(built) == 1 and (folder / COMPLETE).read_text() == "r"
    assert build_once(tmp_path / "thing", built.append, check_answer) == folder and len(built) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing", "thing.lock"]


def test_a_build_that_fails_its_check_is_never_marked(tmp_path):
    with pytest.raises(ValueError, match="not 42"):
        build_once(tmp_path / "thing", lambda f: (f / "answer.json").write_text("41"), check_answer)
    assert not (tmp_path / "thing").exists()


def test_a_marked_folder_whose_files_do_not_load_is_rebuilt_with_one_log_line(tmp_path, caplog):
    folder = build_once(tmp_path / "thing", write_answer, check_answer)
    (folder / "answer.json").unlink()  # what transformers 5.19 left on a rank other than 0: the marker alone
    with caplog.at_level(logging.WARNING, logger="agentenv.cache"):
        assert build_once(tmp_path / "thing", write_answer, check_answer) == folder
    assert check_answer(folder) is None and (folder / COMPLETE).is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"rebuilding {folder}: its files do not load (FileNotFoundError: [Errno 2] No such file or directory: "
        f"'{folder / 'answer.json'}')"
    ]


def test_a_folder_without_its_marker_is_replaced(tmp_path):
    (tmp_path / "thing").mkdir()
    (tmp_path / "thing" / "stale").write_text("from an older layout")
    folder = build_once(tmp_path / "thing", write_answer, check_answer, marker="done.json")
    assert sorted(p.name for p in folder.iterdir()) == ["answer.json", "done.json"]
