"""Atomic writes (sae_env/files.py): a reader, or a run that resumes, sees the whole old file or the whole new one."""

from __future__ import annotations

import pytest

from sae_env.files import atomic_path, check_output_file, set_aside, write_json, write_text


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "out" / "report.md"
    write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.md"]
    write_json(path.with_suffix(".json"), {"a": 1})
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json", "report.md"]


def test_outputs_that_cannot_be_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        write_text(out, "x")
    (out / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output_file(out / "f" / "g.json")
    assert sorted(p.name for p in out.iterdir()) == ["f"]


def test_set_aside_never_overwrites(tmp_path):
    for n in range(3):
        (tmp_path / "cells").mkdir(exist_ok=True)
        (tmp_path / "cells" / "c.json").write_text(str(n))
        set_aside(tmp_path, tmp_path / "cells" / "c.json")
    aside = tmp_path / "aside" / "cells"
    assert sorted((p.name, p.read_text()) for p in aside.iterdir()) == [("c.json", "0"), ("c.json.1", "1"),
                                                                         ("c.json.2", "2")]
