"""Legal but pointless setups: the run works, the option does nothing; one warning line says so."""
import trainmem
from trainmem.cli import main


def test_sharding_over_one_rank_is_a_warning():
    r = trainmem.estimate("gpt2", zero=3)
    assert any("--zero 3 with --dp 1" in w for w in r.warnings)
    assert not trainmem.estimate("gpt2", zero=3, dp=8).warnings
    r = trainmem.estimate("gpt2", fsdp="full")
    assert any("--fsdp full with --dp 1" in w for w in r.warnings)


def test_more_loss_chunks_than_tokens_is_a_warning(capsys):
    assert main(["estimate", "gpt2", "--seq-len", "16", "--loss-chunks", "64"]) == 0
    cap = capsys.readouterr()
    assert "trainmem: warning: --loss-chunks 64 exceeds the 16 tokens" in cap.err  # one line on stderr
    assert "--loss-chunks 64 exceeds" not in cap.out
