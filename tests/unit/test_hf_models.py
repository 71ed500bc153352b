"""Llama and Qwen checkpoints in Hugging Face format: parity with transformers, loading,
refusals, export, and the checkpoint's own tokenizer and chat template."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from pipeline.errors import InvalidConfigError
from pipeline.policy import hf_weights, tensorfile
from pipeline.policy.chat import ChatTokenizer
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.hf_config import hf_shapes, model_config, read_model_config
from pipeline.policy.hf_init import init_checkpoint
from pipeline.policy.hf_weights import expected_tensors, export, load_model, load_params
from pipeline.policy.model import token_logprobs
from pipeline.policy.sampler import DecodeEngine

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf"
FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: init_checkpoint(root / f, f, "tiny", seed=0) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(
    family: str, checkpoints: dict[str, Path]
) -> None:
    """Float32 logits within 1e-4 of transformers' own implementation, and the same 32
    greedy tokens from the key-value-cached sampler (fixtures: make_reference.py)."""
    ref = np.load(FIXTURES / f"{family}.npz")
    weights = checkpoints[family] / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == str(ref["weights_sha256"]), (
        "the random checkpoint differs from the one the reference was made from"
    )
    assert float(ref["min_margin"]) > 1e-3  # no greedy step is a near-tie
    cfg = read_model_config(checkpoints[family])
    model = load_model(cfg)
    ids = jnp.asarray(ref["input_ids"])[None]
    logits, _ = model(ids, jnp.arange(ids.shape[1])[None])
    # the ids the tokenizer has match; the padded rows past it are masked out
    valid = cfg.output_vocab
    assert 0 < valid < cfg.vocab_size
    diff = float(jnp.max(jnp.abs(logits[0, :, :valid] - ref["logits"][:, :valid])))
    assert diff <= 1e-4, diff
    assert bool(jnp.all(logits[0, :, valid:] == -1e9))

    engine = DecodeEngine(model, 2, SamplingConfig(temperature=0.0), chunk=8)
    engine.append(0, [int(t) for t in ref["input_ids"]])
    greedy = [engine.step([0])[0][0] for _ in range(len(ref["greedy"]))]
    assert greedy == [int(t) for t in ref["greedy"]]


def test_shapes_of_the_format_are_those_of_the_policy() -> None:
    for cfg in (
        ModelConfig(family="qwen2", num_kv_heads=2),
        ModelConfig(family="qwen3", head_size=64, tie_embeddings=False),
        ModelConfig(family="llama", num_kv_heads=1, rope_scaling="llama3"),
    ):
        assert {n: s for n, (_, s, _) in expected_tensors(cfg).items()} == hf_shapes(cfg)


def test_both_config_styles_read_the_same() -> None:
    base = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    }
    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    new = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    a, b = model_config(old), model_config(new)
    assert a == b
    assert (a.rope_scaling, a.rope_factor, a.rope_theta, a.max_len) == ("llama3", 32.0, 5e5, 2048)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma2"}, "model type 'gemma2' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"use_sliding_window": True}, "sliding-window attention"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"hidden_size": "64"}, "'hidden_size' is '64', not a int"),
        ({"num_attention_heads": None}, "lacks 'num_attention_heads'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads 3"),
    ],
)
def test_unsupported_configurations_are_refused_in_one_sentence(
    change: dict[str, object], message: str
) -> None:
    raw = {
        "model_type": "qwen2",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        **change,
    }
    with pytest.raises(InvalidConfigError, match=message.replace("(", r"\(")):
        model_config(raw)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_weights_are_refused_before_anything_is_loaded(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = checkpoints["qwen2"]
    cfg = read_model_config(src)
    tensors = load_file(str(src / "model.safetensors"))

    def variant(name: str, edit: dict[str, np.ndarray | None]) -> ModelConfig:
        d = _copy(src, tmp_path / name)
        t = {k: v for k, v in {**tensors, **edit}.items() if v is not None}
        tensorfile.write(d / "model.safetensors", t)
        return read_model_config(d)

    q0 = "model.layers.0.self_attn.q_proj.bias"
    with pytest.raises(InvalidConfigError, match=f"missing {q0}"):
        load_params(variant("missing", {q0: None}))
    with pytest.raises(InvalidConfigError, match=r"unexpected model\.layers\.9\.mlp"):
        load_params(variant("extra", {"model.layers.9.mlp.up_proj.weight": np.zeros(2, "f4")}))
    with pytest.raises(InvalidConfigError, match=f"{q0} has shape \\[3\\]"):
        load_params(variant("shape", {q0: np.zeros(3, "f4")}))
    nan = np.array(tensors[q0])
    nan[0] = np.nan
    with pytest.raises(InvalidConfigError, match="NaN or infinity"):
        load_params(variant("nan", {q0: nan}))

    truncated = _copy(src, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(InvalidConfigError, match="the file is truncated"):
        load_params(read_model_config(truncated))
    for garbage in (b"", b"\x08" + b"\0" * 7 + b"not json", b"\xff" * 64):
        (truncated / "model.safetensors").write_bytes(garbage)
        with pytest.raises(InvalidConfigError, match="not a usable safetensors file"):
            load_params(read_model_config(truncated))

    monkeypatch.setattr(hf_weights, "available_bytes", lambda: 1000)
    with pytest.raises(InvalidConfigError, match=r"to train .* but 0\.0 GiB is available"):
        load_params(cfg, training=True)


def test_sharded_checkpoints_load_like_single_files(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints["llama"]
    tensors = load_file(str(src / "model.safetensors"))
    sharded = _copy(src, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        f = f"model-0000{i + 1}-of-00002.safetensors"
        tensorfile.write(sharded / f, {n: tensors[n] for n in part})
        weight_map |= dict.fromkeys(part, f)
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    a = load_params(read_model_config(src))
    b = load_params(read_model_config(sharded))
    leaves_a, leaves_b = (jax.tree.leaves(nnx.to_pure_dict(s)) for s in (a, b))
    pairs = zip(leaves_a, leaves_b, strict=True)
    assert all(np.array_equal(x, y) for x, y in pairs)
    weight_map[names[0]] = "../elsewhere.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidConfigError, match=r"names shard '\.\./elsewhere"):
        load_params(read_model_config(sharded))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_what_was_loaded(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Export is read back by the safetensors library (not rlstream's reader) to the same
    tensors, with the same configuration and the tokenizer files."""
    src = checkpoints[family]
    cfg = read_model_config(src)
    out = export(cfg, load_params(cfg), tmp_path / "out")
    assert load_file(str(out / "model.safetensors")).keys() == hf_shapes(cfg).keys()
    for name, array in load_file(str(out / "model.safetensors")).items():
        assert np.array_equal(array, load_file(str(src / "model.safetensors"))[name]), name
    assert read_model_config(out).same_architecture(cfg)
    assert ChatTokenizer.load(out).id == ChatTokenizer.load(src).id
    with pytest.raises(InvalidConfigError, match="is not empty"):
        export(cfg, load_params(cfg), out)


# ---- the checkpoint's tokenizer and chat template -------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # the Llama 3 and ChatML templates
def test_appended_turns_are_the_whole_conversation_rendered_at_once(
    family: str, checkpoints: dict[str, Path]
) -> None:
    tok = ChatTokenizer.load(checkpoints[family])
    (stop,) = tok.encode({"qwen2": "<|im_end|>", "llama": "<|eot_id|>"}[family])
    assert stop in tok.stop_tokens
    replies = ["Let me compute 12 * 7.", "It is 84."]
    # the token stream an episode builds, piece by piece, never re-tokenized
    stream = tok.opening("What is 12 * 7?") + tok.assistant_header
    stream += [*tok.encode(replies[0]), stop]
    stream += tok.turn("tool", "84") + tok.assistant_header
    stream += [*tok.encode(replies[1]), stop]
    stream += tok.turn("environment", "Correct! One more: 3 + 4?")
    messages = [
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": replies[0]},
        {"role": "tool", "content": "84"},
        {"role": "assistant", "content": replies[1]},
        {"role": "user", "content": "Correct! One more: 3 + 4?"},
    ]
    assert stream == tok.encode(tok.render(messages))


@pytest.mark.parametrize("family", FAMILIES)
def test_templates_render_as_transformers_renders_them(
    family: str, checkpoints: dict[str, Path]
) -> None:
    """The token ids of transformers' apply_chat_template for the fixture's conversation."""
    ref = np.load(FIXTURES / f"{family}.npz")
    tok = ChatTokenizer.load(checkpoints[family])
    chat = [
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "Let me compute."},
        {"role": "tool", "content": "84"},
        {"role": "assistant", "content": "It is 84."},
        {"role": "user", "content": "And 3 + 4?"},
    ]
    ids = tok.encode(tok.render(chat, add_generation_prompt=True))
    assert ids == [int(i) for i in ref["chat_ids"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_environments_tools_are_listed_as_transformers_lists_them(
    family: str, checkpoints: dict[str, Path]
) -> None:
    """The opening of a conversation with tools: the token ids of transformers'
    apply_chat_template(tools=...) (``make_tools_reference.py``)."""
    ref = json.loads((FIXTURES / f"{family}_tools.json").read_text())
    tok = ChatTokenizer.load(checkpoints[family])
    tools = [t["function"] for t in ref["tools"]]
    assert tok.opening(ref["prompt"], tools) == ref["ids"]
    assert tok.opening(ref["prompt"], tools) == ref["ids"]  # kept, the same
    if family != "llama":  # its template lists no tools: the same opening either way
        assert tok.opening(ref["prompt"]) != ref["ids"]
        assert '"name": "add"' in tok.decode(ref["ids"])


def test_tool_calls_use_the_templates_format(checkpoints: dict[str, Path]) -> None:
    tok = ChatTokenizer.load(checkpoints["qwen2"])
    assert tok.call is not None and tok.end_call is not None
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert tok.parse_call(tok.encode(text), None) == ("calculator", "2+3")
    llama = ChatTokenizer.load(checkpoints["llama"])
    bare = '{"name": "search", "parameters": {"q": "x", "n": 2}}'
    assert llama.parse_call(llama.encode(bare), None) == ("search", '{"q": "x", "n": 2}')
    assert llama.parse_call(llama.encode("The answer is 5."), None) is None
    assert llama.parse_call(llama.encode('{"name": '), None) is None


def test_tokenizer_id_is_a_content_hash_and_templates_are_found_in_either_file(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints["qwen2"]
    same = _copy(src, tmp_path / "same")
    assert ChatTokenizer.load(same).id == ChatTokenizer.load(src).id
    # transformers 4 keeps the template in tokenizer_config.json
    moved = _copy(src, tmp_path / "moved")
    tc = json.loads((moved / "tokenizer_config.json").read_text())
    tc["chat_template"] = (moved / "chat_template.jinja").read_text()
    (moved / "tokenizer_config.json").write_text(json.dumps(tc))
    (moved / "chat_template.jinja").unlink()
    assert ChatTokenizer.load(moved).id == ChatTokenizer.load(src).id
    (moved / "tokenizer_config.json").write_text(
        json.dumps({**tc, "chat_template": tc["chat_template"].replace("user", "human")})
    )
    assert ChatTokenizer.load(moved).id != ChatTokenizer.load(src).id

    bare = _copy(src, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(InvalidConfigError, match="has no chat template"):
        ChatTokenizer.load(bare)
    (bare / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    with pytest.raises(InvalidConfigError, match="does not compile"):
        ChatTokenizer.load(bare)
    # a template that rewrites earlier turns cannot be appended to
    (bare / "chat_template.jinja").write_text(
        "{{ messages | length }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    )
    with pytest.raises(InvalidConfigError, match="not prefix-stable"):
        ChatTokenizer.load(bare)
    (bare / "tokenizer.json").write_text("{")
    with pytest.raises(InvalidConfigError, match="is not a tokenizer"):
        ChatTokenizer.load(bare)


def test_the_policy_logprobs_are_float32_in_bfloat16(checkpoints: dict[str, Path]) -> None:
    cfg = ModelConfig.from_json(
        read_model_config(checkpoints["qwen3"]).to_json().replace("float32", "bfloat16")
    )
    model = load_model(cfg)
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    lp = token_logprobs(model, jnp.asarray([[1, 5, 9, 11]]))
    assert lp.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(lp)))


def test_a_trainers_weights_export_through_the_cli(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """``rlstream model export`` of a checkpoint the trainer saved (weights/vN) gives a
    directory that loads back to the same parameters."""
    from pipeline.cli.main import main
    from pipeline.policy.checkpoint import save_params

    cfg = read_model_config(checkpoints["qwen3"])
    model = load_model(cfg)
    saved = save_params(tmp_path / "weights" / "v3", model, 3)
    assert main(["model", "export", str(saved), "-o", str(tmp_path / "hf")]) == 0
    back = load_params(read_model_config(tmp_path / "hf"))
    pairs = zip(
        jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))),
        jax.tree.leaves(nnx.to_pure_dict(back)),
        strict=True,
    )
    assert all(np.array_equal(a, b) for a, b in pairs)
    # a run's weights folder is read as its newest version; a path without weights is refused
    assert main(["model", "export", str(tmp_path / "weights"), "-o", str(tmp_path / "x")]) == 0
    assert read_model_config(tmp_path / "x").same_architecture(read_model_config(tmp_path / "hf"))
    assert main(["model", "export", str(tmp_path / "none"), "-o", str(tmp_path / "y")]) == 2


def test_announcements_of_another_architecture_do_not_fit() -> None:
    qwen = ModelConfig(family="qwen2", path="/models/a", max_len=512)
    assert qwen.same_architecture(ModelConfig(family="qwen2", path="/elsewhere/a"))
    assert not qwen.same_architecture(ModelConfig(family="llama", path="/models/a"))
    assert not qwen.same_architecture(ModelConfig(family="qwen2", num_kv_heads=2))


def test_model_dir_is_accepted_wherever_a_preset_is(checkpoints: dict[str, Path]) -> None:
    from pipeline.launch.config import RunConfig
    from pipeline.settings import from_mapping

    d = str(checkpoints["llama"])
    run = from_mapping(RunConfig, {"model": d, "steps": 3})
    assert run.model == read_model_config(Path(d)) and run.model.family == "llama"
    assert run.trainer("ns", Path("r")).model == run.model
    assert run.producer(0, "ns", Path("r")).model == run.model
    with pytest.raises(InvalidConfigError, match="does not exist"):
        from_mapping(RunConfig, {"model": d + "-missing"})


def _hostile_copy(src: Path, dst: Path, edit: dict[str, object] | None = None) -> Path:
    shutil.copytree(src, dst)
    if edit:
        raw = json.loads((dst / "config.json").read_text())
        for key, value in edit.items():
            if key.startswith("rope_scaling."):
                raw["rope_scaling"][key.split(".", 1)[1]] = value
            else:
                raw[key] = value
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [
        ({"num_hidden_layers": 2**24}, "num_hidden_layers 16777216 is more than the 2 layers"),
        ({"num_hidden_layers": 100_000}, "num_hidden_layers 100000 is more than the 2 layers"),
        ({"rope_scaling.low_freq_factor": 0}, "must be finite positive numbers"),
        ({"rope_scaling.low_freq_factor": float("nan")}, "must be finite positive numbers"),
        ({"rope_scaling.high_freq_factor": 0.5}, "high_freq_factor above low_freq_factor"),
        ({"vocab_size": 512}, r"vocabulary \(1000 ids\) is larger than the model's vocab_size 512"),
        ({"head_dim": 15, "num_attention_heads": 4}, "head_dim 15 is odd"),
    ],
)
def test_a_hostile_config_is_refused_in_one_sentence_before_any_weight(
    checkpoints: dict[str, Path], tmp_path: Path, edit: dict[str, object], refusal: str
) -> None:
    import time

    d = _hostile_copy(checkpoints["llama"], tmp_path / "m", edit)
    start = time.monotonic()
    with pytest.raises(InvalidConfigError, match=refusal):
        read_model_config(d)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("template", "refusal"),
    [
        ("{% include 'x' %}", r"uses \{% include %\}"),
        ("{% import 'x' as y %}{{ y }}", r"uses \{% import %\}"),
        ("{% from 'x' import y %}", r"uses \{% from \.\.\. import %\}"),
        ("{% extends 'x' %}", r"uses \{% extends %\}"),
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
            "takes more than 2 s",
        ),
        ("{{ 'x' * 10**10 }}", "needs more than 1024 MB|takes more than 2 s"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
            "needs more than 1024 MB|takes more than 2 s",  # whichever bound it meets first
        ),
        (
            "{% for i in range(30000) %}{{ 'abcdefghij' * 10 }}{% endfor %}",
            "more than 1048576 characters",
        ),
        (
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% if m.role == 'user' %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}",
            "does not write the user's first message once",
        ),
        (
            "{% for m in messages %}<{{ m.role }}>{{ m.content | replace(' ', '_') }}"
            "<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}",
            "changes the text of the user's first message beyond trimming it",
        ),
    ],
)
def test_a_hostile_chat_template_is_refused_at_load_within_bounds(
    checkpoints: dict[str, Path], tmp_path: Path, template: str, refusal: str
) -> None:
    import resource
    import time

    d = _hostile_copy(checkpoints["llama"], tmp_path / "m")
    (d / "chat_template.jinja").write_text(template)
    start = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidConfigError, match=refusal):
        ChatTokenizer.load(d)
    assert time.monotonic() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def test_episodes_append_turns_without_rendering(checkpoints: dict[str, Path]) -> None:
    """The template runs only at load: an episode's pieces are substitutions, and a
    trimming template (llama's) trims the text it is given."""
    from pipeline.policy import template

    tok = ChatTokenizer.load(checkpoints["llama"])
    calls = []
    real = template.render_bounded
    template.render_bounded = lambda *a: calls.append(a) or real(*a)  # type: ignore[assignment]
    try:
        import pipeline.policy.chat as chat

        original = chat.render_bounded
        chat.render_bounded = template.render_bounded
        opening, tool = tok.opening("  hello \n"), tok.turn("tool", "42")
    finally:
        template.render_bounded = real  # type: ignore[assignment]
        chat.render_bounded = original
    assert calls == []
    whole = [{"role": "user", "content": "hello"}]
    assert opening == tok.encode(tok.render(whole))
    assert tool[-1] in tok.stop_tokens or tok.decode(tool, specials=True).endswith("<|eot_id|>")


def test_model_inspect_reads_every_tensor_and_refuses_non_finite_weights(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.cli.main import main

    src = checkpoints["qwen3"]
    assert main(["model", "inspect", str(src)]) == 0
    d = _hostile_copy(src, tmp_path / "nan")
    tensors = load_file(str(src / "model.safetensors"))
    bad = np.array(tensors["model.norm.weight"])
    bad[1] = np.inf
    tensorfile.write(d / "model.safetensors", {**tensors, "model.norm.weight": bad})
    capsys.readouterr()
    assert main(["model", "inspect", str(d)]) == 2
    err = capsys.readouterr().err
    assert "1 tensors of" in err and "hold NaN or infinity: model.norm.weight" in err
