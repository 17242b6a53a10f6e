"""LoRA adapters in Hugging Face PEFT's format (issue 15, item 2): PEFT loads maxlm's exported
adapter onto maxlm's exported base and computes maxlm's logits; an adapter PEFT writes loads into
maxlm (``--adapter``) and computes PEFT's; and what maxlm cannot read is refused in one line."""

import json

import jax
import numpy as np
import pytest

from test_lora import LLAMA, _cfg, _random_adapters, _tokens

from maxlm import config as config_lib
from maxlm import model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _hf_logits(net, ids):
    with torch.no_grad():
        return net(torch.from_numpy(np.asarray(ids, np.int64))).logits.float().numpy()


def _export(tmp_path, cfg, params, mode, name, **kw):
    from maxlm.data.tokenizer import ByteTokenizer
    from maxlm.hf.export import export_model
    from maxlm.hf.load import LoadedModel

    loaded = LoadedModel(cfg, params, ByteTokenizer(), None, f"random {name}")
    out = tmp_path / name
    export_model(loaded, out, lora=mode, say=lambda _: None, **kw)
    return out


@pytest.mark.parametrize("targets", [r"attn/(q|v)_proj$", "attn/|mlp/|lm_head"], ids=["q_v", "all_and_head"])
def test_peft_loads_our_adapter_onto_our_base(tmp_path, targets):
    cfg = _cfg(lora_targets=targets, lora_alpha=32.0)
    params = _random_adapters(cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
    base_dir = _export(tmp_path, cfg, params, "base", "base")
    adapter_dir = _export(tmp_path, cfg, params, "peft", "adapter", base_model=str(base_dir))
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["lora_alpha"] == 32.0 and conf["peft_type"] == "LORA"
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    net = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = _tokens(length=40)
    want = np.asarray(model.forward(cfg, params, ids)[0])[..., :cfg.vocab_size]
    np.testing.assert_allclose(_hf_logits(net, ids), want, atol=2e-4, rtol=0)
    # and the merged export is the same function for transformers alone
    merged_dir = _export(tmp_path, cfg, params, "merge", "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(merged, ids), want, atol=2e-4, rtol=0)


def test_an_adapter_trained_by_peft_loads_into_maxlm(tmp_path):
    """PEFT writes the adapter (rsLoRA, k/o/down targets, random weights); maxlm --adapter reads it."""
    from maxlm.hf.load import load_model

    base_cfg = config_lib.ModelConfig(**LLAMA)
    base_params = model.init_params(base_cfg, jax.random.PRNGKey(3))
    base_dir = _export(tmp_path, base_cfg, base_params, "merge", "base")
    net = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    peft_cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "down_proj"], use_rslora=True,
                               init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(0)
    net = peft.get_peft_model(net, peft_cfg).eval()
    net.save_pretrained(tmp_path / "peft_adapter")
    # a maxlm run directory for the base: hf import of the export
    from maxlm.hf.convert import import_checkpoint

    import_checkpoint(base_dir, tmp_path / "base_run", dtype="float32")
    loaded = load_model(tmp_path / "base_run", adapter=tmp_path / "peft_adapter")
    assert loaded.cfg.lora_rank == 4 and sorted(loaded.cfg.lora_paths()) == ["attn/k_proj", "attn/o_proj", "mlp/down_proj"]
    ids = _tokens(length=40)
    got = np.asarray(model.forward(loaded.cfg, loaded.params, ids)[0])[..., :base_cfg.vocab_size]
    np.testing.assert_allclose(got, _hf_logits(net, ids), atol=2e-4, rtol=0)


def test_adapter_errors_are_one_line(tmp_path, capsys):
    from maxlm.hf.load import LoadError, load_model

    base_cfg = config_lib.ModelConfig(**LLAMA)
    base_dir = _export(tmp_path, base_cfg, model.init_params(base_cfg, jax.random.PRNGKey(3)), "merge", "base")
    with pytest.raises(LoadError, match="not a PEFT adapter directory"):
        load_model(base_dir, adapter=tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["qkv"]}))
    with pytest.raises(LoadError, match=r"target_modules \['qkv'\] are not Llama Linears"):
        load_model(base_dir, adapter=bad)
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True,
                                                          "target_modules": ["q_proj"]}))
    with pytest.raises(LoadError, match="use_dora = True is not supported"):
        load_model(base_dir, adapter=bad)
    from maxlm import hf

    code = hf.main(["export", str(base_dir), "--out", str(tmp_path / "x"), "--lora", "peft"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has no LoRA adapters" in err[0], err
