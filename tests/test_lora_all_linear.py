"""``--lora-targets all-linear`` (peft's shorthand, as HF users write ``target_modules="all-linear"``):
expanded against the model as peft 0.21 expands it (``spec.lora_targets``), checked against peft's own
expansion on the real transformers model built on the meta device; refused in one line for a
mixture-of-experts model, whose experts peft adapts too."""
import json

import pytest

import trainmem
from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.spec.lora_targets import all_linear_targets, is_all_linear
from trainmem.spec.resolve import model_of

peft = pytest.importorskip("peft")
SEVEN = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _peft_all_linear(spec) -> set[str]:
    """The leaf names peft's get_peft_model adapts under target_modules="all-linear"."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(**spec.config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    return {k.rsplit(".", 1)[-1] for k, m in wrapped.named_modules()
            if hasattr(m, "lora_A") and not k.endswith(("lora_A", "lora_B"))}


@pytest.mark.parametrize("name,layers", [("llama-3.2-1b", "num_hidden_layers=1"), ("gpt2", "n_layer=1"),
                                         ("qwen2.5-7b", "num_hidden_layers=1"), ("falcon-7b", "num_hidden_layers=1")])
def test_expansion_matches_peft(name, layers):
    spec = model_of(name, {"set": [layers]})
    assert set(all_linear_targets(spec)) == _peft_all_linear(spec)


def test_output_embedding_and_vision_tower_left_out():
    llava = all_linear_targets(model_of("llava-1.5-7b", {}))
    assert "lm_head" not in llava and not {"fc1", "fc2", "out_proj", "patch_embedding"} & set(llava)
    assert set(SEVEN.split(",")) == set(llava)


@pytest.mark.parametrize("value", ["all-linear", "ALL-LINEAR", "all_linear"])
def test_shorthand_spellings(value):
    assert is_all_linear((value,)) and not is_all_linear(("q_proj",)) and not is_all_linear(None)


def test_cli_all_linear_equals_the_listed_modules(capsys):
    runs = []
    for targets in ("all-linear", SEVEN):
        assert main(["estimate", "qwen2.5-7b", "--lora-rank", "16", "--lora-targets", targets, "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["peak_allocated"] == runs[1]["peak_allocated"]
    q = trainmem.estimate("qwen2.5-7b", lora_rank=16, lora_targets="all-linear")
    assert q.peak_allocated == runs[0]["peak_allocated"]
    default = trainmem.estimate("qwen2.5-7b", lora_rank=16)  # peft's default: q_proj, v_proj
    assert default.peak_allocated != q.peak_allocated


def test_moe_refused_in_one_line(capsys):
    assert main(["estimate", "mixtral-8x7b", "--lora-rank", "8", "--lora-targets", "all-linear"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mixture-of-experts" in err[0] and "--lora-targets q_proj" in err[0]
    with pytest.raises(TrainmemError, match="mixture-of-experts"):
        trainmem.estimate("mixtral-8x7b", lora_rank=8, lora_targets="all-linear")
