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
