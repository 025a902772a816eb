"""Output files: temporary names nobody can plant in advance, the mode a plain open gives, and a
non-regular file where a result goes refused (not read: a FIFO there would block)."""

import os
import stat

import pytest

from kvpool.cli.sim import refuse_other_run
from kvpool.errors import UserError
from kvpool.outputs import atomic_path


def test_atomic_path_makes_its_own_temporary_file_with_the_usual_mode(tmp_path):
    final = tmp_path / "sub" / "result.json"
    with atomic_path(final) as a:
        first = a
        assert a.parent == final.parent and a.is_file() and a.name != final.name
        a.write_text("x")
    with atomic_path(final) as b:
        assert b != first  # an unpredictable name each time, created exclusively
        b.write_text("y")
    assert final.read_text() == "y" and sorted(p.name for p in final.parent.iterdir()) == ["result.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(final.stat().st_mode) == 0o666 & ~mask


def test_a_planted_link_at_an_old_style_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    final = tmp_path / "out.json"
    (tmp_path / f".{final.name}.{os.getpid()}.tmp.json").symlink_to(victim)
    with atomic_path(final) as tmp:
        tmp.write_text("result")
    assert victim.read_text() == "keep" and final.read_text() == "result"


def test_a_fifo_where_a_result_goes_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):
        refuse_other_run(fifo, "abc")
    link = tmp_path / "l.json"
    link.symlink_to(tmp_path / "missing")
    with pytest.raises(UserError, match="not a regular file"):
        refuse_other_run(link, "abc")


@pytest.mark.parametrize("content", ["[" * 100_000 + "]" * 100_000, '{"id": "abc", "id": "x"' + "]", "\xff"])
def test_a_result_name_holding_what_no_run_wrote_is_refused_not_parsed_to_a_crash(tmp_path, content):
    planted = tmp_path / "r.json"
    planted.write_bytes(content.encode("latin-1"))
    with pytest.raises(UserError, match="exists and holds another run's content"):
        refuse_other_run(planted, "abc")
    assert planted.read_bytes() == content.encode("latin-1")


def test_a_result_of_this_run_is_replaced(tmp_path):
    mine = tmp_path / "r.json"
    mine.write_text('{"id": "abc", "rows": []}')
    refuse_other_run(mine, "abc")  # no error: the same run may write it again
