"""The Hugging Face round trip a user makes: import a transformers LLaMA (GQA; untied and tied),
train it 5 steps on data prepared with a tokenizer, export, then `LlamaForCausalLM.
from_pretrained` + `generate` and `AutoTokenizer.from_pretrained` on the export; its logits
equal ratrain's API within 1e-5 of the largest |logit|, and greedy generation agrees."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ratrain import api
from ratrain.data import load_tokenizer, prepare
from tests._tokenizer_util import make_bpe
from tests._prereq import need

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[1]


def _run(*argv):
    p = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, f"{argv}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_train_export_transformers(tmp_path, tie):
    torch = need("torch")
    transformers = need("transformers")
    tok_path, docs = make_bpe(tmp_path, vocab_size=300)
    tok = load_tokenizer(str(tok_path))
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, eos_token_id=tok.eot_id))
    src.save_pretrained(str(tmp_path / "src"))
    data = prepare([str(docs)], tmp_path / "data" / "train.bin", tokenizer=str(tok_path),
                   val_fraction=0.1)
    job = tmp_path / "job.yaml"
    job.write_text(f"""
model: {{seq_len: 32}}
parallel: {{micro_batch: 2, num_micro_batches: 2}}
optim: {{lr: 1.0e-3, warmup_steps: 0}}
data: {{tokens: {data.train}}}
init: {{from_hf: {tmp_path / "src"}}}
checkpoint: {{interval: 5, resume: never}}
run: {{steps: 5, dir: {tmp_path / "run"}, threads: 1}}
""")
    _run("ratrain.train", "--config", str(job))
    out = tmp_path / "export"
    _run("ratrain.export", "--hf", str(out), "--checkpoint", str(tmp_path / "run" / "checkpoints"))
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "config.json", "model.safetensors"} <= set(os.listdir(out))
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["max_position_embeddings"] == 64  # the imported model's, not seq_len 32
    assert hf_cfg["tie_word_embeddings"] is tie and hf_cfg["eos_token_id"] == tok.eot_id

    model = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def f7(x):\n    return"
    ids = [int(i) for i in tok.encode(text)]
    assert hf_tok.encode(text) == ids and hf_tok.eos_token == "<|endoftext|>"
    with api.load(str(tmp_path / "run" / "checkpoints"), precision="fp32") as mine:
        assert mine.step == 5
        ours = mine.logits([ids])  # (1, T, V)
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits.numpy()
        scale = float(np.abs(theirs).max())
        rel = float(np.abs(ours - theirs).max()) / scale
        print(f"{'tied' if tie else 'untied'}: max |logit difference| / max |logit| = {rel:.2e}")
        assert rel <= 1e-5
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                pad_token_id=tok.eot_id)[0].tolist()
        assert greedy[:len(ids)] == ids
        assert mine.generate(ids, len(greedy) - len(ids), temperature=0,
                             stop=tok.eot_id) == greedy
        assert mine.complete(text, 4, temperature=0).startswith(text)
