from __future__ import annotations

import gzip

import pytest

from proxy.protocol import tokenizer


def test_offline_encodings_match_known_ids() -> None:
    # Reference ids from tiktoken's own documentation and tests.
    assert tokenizer.get_encoding("cl100k_base").encode("hello world") == [15339, 1917]
    assert tokenizer.get_encoding("o200k_base").encode("hello world") == [24912, 2375]


def test_model_to_encoding() -> None:
    assert tokenizer.encoding_name_for_model("gpt-4o-mini") == "o200k_base"
    assert tokenizer.encoding_name_for_model("gpt-4-turbo") == "cl100k_base"
    assert tokenizer.encoding_name_for_model("gpt-3.5-turbo") == "cl100k_base"
    assert tokenizer.encoding_name_for_model("text-embedding-3-small") == "cl100k_base"
    assert tokenizer.encoding_name_for_model("o3-mini") == "o200k_base"
    assert tokenizer.encoding_name_for_model("meta-llama/Llama-3-8B") == "o200k_base"


def test_tampered_file_is_refused() -> None:
    path = tokenizer._data_dir() / "cl100k_base.tiktoken.gz"
    data = bytearray(gzip.decompress(path.read_bytes()))
    data[100] ^= 1
    with pytest.raises(tokenizer.EncodingUnavailable, match="does not match"):
        tokenizer.load_ranks("cl100k_base", bytes(data))


def test_special_token_text_is_counted_not_rejected() -> None:
    assert tokenizer.count_text("gpt-4o", "<|endoftext|>") > 1


def test_count_messages_includes_framing() -> None:
    text = "How many tokens is this?"
    n = tokenizer.count_messages("gpt-4o", [{"role": "user", "content": text}])
    assert n == tokenizer.count_text("gpt-4o", text) + tokenizer.count_text("gpt-4o", "user") + 6
    parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    assert tokenizer.count_messages("gpt-4o", parts) == n
