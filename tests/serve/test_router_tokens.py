"""Text <-> token ids of the reference model (``backend.serve.tokens``)."""

from __future__ import annotations

from kvpool.backend.serve import tokens as tok
from kvpool.backend.serve.model_config import EOS_TOKEN


def test_text_is_its_utf8_bytes_and_back():
    text = "héllo, 世界 👋"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text


def test_ids_beyond_the_bytes_are_left_out_and_bad_bytes_replaced():
    assert tok.decode([104, tok.EOS_TOKEN, 105, 300]) == "hi"
    assert tok.decode([0xFF, 104]) == "\ufffdh"


def test_the_stream_never_splits_a_character_and_equals_the_whole():
    ids = tok.encode("aé世👋b") + [0xE4]  # ends in the first byte of a character that never completes
    for cut in range(len(ids) + 1):
        s = tok.TextStream()
        parts = [s.feed(ids[:cut]), s.feed(ids[cut:]), s.flush()]
        assert "".join(parts) == tok.decode(ids)
        assert "\ufffd" not in parts[0]  # a character cut in two is held back, not replaced
    s = tok.TextStream()
    assert s.feed([0xE4, 0xB8]) == "" and s.feed([0x96]) == "世"


def test_eos_is_the_model_configs():
    assert tok.EOS_TOKEN == EOS_TOKEN
