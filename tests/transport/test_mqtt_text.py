"""Strings a broker accepts (pure): what is cleaned from user properties, which response topics fail."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.transport.mqtt_text import is_publish_topic, mqtt_text


def test_controls_become_spaces_and_invalid_code_points_replacement_characters():
    text = "Got invalid dimensions\n index: 1\tExpected: 10\r\x00\x7f\x85 \ud800 \ufffe \U0010ffff \ufdd0"
    assert mqtt_text(text) == "Got invalid dimensions  index: 1 Expected: 10     \ufffd \ufffd \ufffd \ufffd"
    assert mqtt_text("plain é 漢 😀 ok") == "plain é 漢 😀 ok"


@given(st.text())
def test_cleaned_text_is_valid_utf8_without_controls(text):
    cleaned = mqtt_text(text)
    cleaned.encode("utf-8")  # no surrogates left: strict encoding succeeds
    assert len(cleaned) == len(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in cleaned)


@pytest.mark.parametrize(
    ("topic", "ok"),
    [
        ("fedge/f/infer-reply/client-1", True),
        ("é/漢", True),
        ("", False),
        ("a/#", False),
        ("a/+/b", False),
        ("a\nb", False),
        ("a\x00b", False),
        ("a\ud800", False),
        ("x" * 65_536, False),
        (None, False),
        (b"bytes", False),
    ],
)
def test_publish_topics(topic, ok):
    assert is_publish_topic(topic) is ok
