"""GGUF files of a checkpoint, read back by the gguf package's own reader (the format
llama.cpp loads): every tensor under llama.cpp's name with the checkpoint's values, the
vocabulary and the architecture's sizes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pipeline.policy import gguf_file
from pipeline.policy.hf_init import init_checkpoint


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_a_checkpoint_reads_back_from_its_gguf_file(tmp_path: Path, family: str) -> None:
    import gguf

    model = init_checkpoint(tmp_path / family, family, "tiny", seed=0)
    out = gguf_file.write_checkpoint(model, tmp_path / f"{family}.gguf")
    assert not list(tmp_path.glob(".*.partial"))
    reader = gguf.GGUFReader(str(out))
    config = json.loads((model / "config.json").read_text())
    fields = {f.name: f for f in reader.fields.values()}
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    assert arch == family
    assert int(fields[f"{arch}.block_count"].parts[-1][0]) == config["num_hidden_layers"]
    assert len(fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]
    assert not bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0])
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    hf = load_file(str(model / "model.safetensors"))
    for name, value in hf.items():
        got = tensors[gguf_file.gguf_name(name)].reshape(value.shape)
        np.testing.assert_array_equal(got, value.astype(np.float32))
    # Llama 3's rope scaling travels as llama.cpp's per-frequency factors
    assert ("rope_freqs.weight" in tensors) == (family == "llama")
    if family == "llama":
        factors = tensors["rope_freqs.weight"]
        head = config["hidden_size"] // config["num_attention_heads"]
        assert factors.shape == (head // 2,)
        assert factors[0] == 1.0 and factors[-1] == config["rope_scaling"]["factor"]


def test_what_gguf_cannot_hold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no GGUF writer for model_type 'gpt2'"):
        gguf_file.write(tmp_path / "x.gguf", {"model_type": "gpt2"}, {}, [])
    with pytest.raises(ValueError, match="no GGUF name"):
        gguf_file.gguf_name("model.layers.0.mlp.experts.weight")
    with pytest.raises(ValueError, match="no GGUF name"):
        gguf_file.gguf_name("transformer.h.0.attn.weight")
