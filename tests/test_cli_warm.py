"""`kvstrata warm` fails cleanly on bad input, before joining any cluster: a prompt file that
cannot be read exits 2 naming it; a TTL that is not a duration is a usage error naming it.
Ray-free; the warm itself runs end to end in tests/e2e/test_vllm_cpu_warm.py."""

from __future__ import annotations

import pytest

import kvstrata.actors.client as client
from kvstrata.cli import main


def test_a_missing_prompt_file_exits_2_naming_it_without_joining_a_cluster(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(client, "join_cluster", lambda *a, **k: pytest.fail("joined a cluster"))
    missing = tmp_path / "nope.txt"
    assert main(["warm", "--model", "m", "--prompt-file", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


@pytest.mark.parametrize("ttl", ["forever", "-5", "0"])
def test_a_bad_ttl_is_a_usage_error_naming_it(tmp_path, capsys, ttl):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    with pytest.raises(SystemExit) as exit_:
        main(["warm", "--model", "m", "--prompt-file", str(prompt), "--ttl", ttl])
    assert exit_.value.code == 2 and "--ttl" in capsys.readouterr().err


def test_a_prompt_file_that_is_not_utf8_exits_2_naming_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(client, "join_cluster", lambda *a, **k: pytest.fail("joined a cluster"))
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("café au lait".encode("latin-1"))
    assert main(["warm", "--model", "m", "--prompt-file", str(prompt)]) == 2
    err = capsys.readouterr().err
    assert str(prompt) in err and "not UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("chat", ['{"role": "user", "content": "hi"}', '["hi"]', "not json"])
def test_a_chat_file_that_is_not_a_list_of_messages_exits_2_naming_it(monkeypatch, tmp_path, capsys, chat):
    monkeypatch.setattr(client, "join_cluster", lambda *a, **k: pytest.fail("joined a cluster"))
    prompt = tmp_path / "chat.json"
    prompt.write_text(chat)
    assert main(["warm", "--model", "m", "--prompt-file", str(prompt), "--chat"]) == 2
    err = capsys.readouterr().err
    assert str(prompt) in err and "JSON list of messages" in err
