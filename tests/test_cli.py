"""The `tandem serve` demo runs the shipped model; bad settings fail with a message."""

from deploy.cli import main


def test_serve_demo_prints_replies_and_speed(capsys):
    assert main(["serve", "--max-tokens", "6", "--prompt", "Repeat after me: ok"]) == 0
    out = capsys.readouterr().out
    assert "user:      Repeat after me: ok" in out and "tokens/s" in out


def test_serve_refuses_a_missing_model(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_serve_refuses_a_prompt_over_the_context(capsys):
    assert main(["serve", "--max-model-len", "8", "--max-tokens", "6", "--prompt", "Repeat after me: ok"]) == 2
    assert "exceeds the model context of 8 tokens" in capsys.readouterr().err
